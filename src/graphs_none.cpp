// Compiles mpipe/detail/graphs_none-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/graphs_none-inl.h"
