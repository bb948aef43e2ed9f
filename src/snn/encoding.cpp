// Compiles mpipe/detail/snn/encoding-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/snn/encoding-inl.h"
