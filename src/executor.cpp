// Compiles mpipe/detail/executor-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/executor-inl.h"
