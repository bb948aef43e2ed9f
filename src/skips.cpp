// Compiles mpipe/detail/skips-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/skips-inl.h"
