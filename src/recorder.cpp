// Compiles mpipe/detail/recorder-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/recorder-inl.h"
