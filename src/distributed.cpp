// Compiles mpipe/detail/distributed-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/distributed-inl.h"
