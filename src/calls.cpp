// Compiles mpipe/detail/calls-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/calls-inl.h"
