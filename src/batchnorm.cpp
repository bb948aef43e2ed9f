// Compiles mpipe/detail/batchnorm-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/batchnorm-inl.h"
