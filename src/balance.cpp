// Compiles mpipe/detail/balance-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/balance-inl.h"
