// Compiles mpipe/detail/autocast-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/autocast-inl.h"
