// Compiles mpipe/detail/timeline-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/timeline-inl.h"
