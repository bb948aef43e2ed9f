// Compiles mpipe/detail/rng-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/rng-inl.h"
