// Compiles mpipe/detail/memory-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/memory-inl.h"
