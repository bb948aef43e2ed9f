// Compiles mpipe/detail/cast_grads-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/cast_grads-inl.h"
