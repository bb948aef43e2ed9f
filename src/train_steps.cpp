// Compiles mpipe/detail/train_steps-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/train_steps-inl.h"
