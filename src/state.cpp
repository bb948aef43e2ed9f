// Compiles mpipe/detail/state-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/state-inl.h"
