// Compiles mpipe/detail/group-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/group-inl.h"
