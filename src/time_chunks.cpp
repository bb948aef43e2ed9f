// Compiles mpipe/detail/time_chunks-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/time_chunks-inl.h"
