// Compiles mpipe/detail/remote-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/remote-inl.h"
