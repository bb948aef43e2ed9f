// Compiles mpipe/detail/split_backward-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/split_backward-inl.h"
