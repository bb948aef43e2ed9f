// Compiles mpipe/detail/snn/surrogate-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/snn/surrogate-inl.h"
