// Compiles mpipe/detail/distributed_none-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/distributed_none-inl.h"
