// Compiles mpipe/detail/device-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/device-inl.h"
