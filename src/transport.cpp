// Compiles mpipe/detail/transport-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/transport-inl.h"
