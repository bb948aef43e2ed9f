// Compiles mpipe/detail/device_probe_none-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/device_probe_none-inl.h"
