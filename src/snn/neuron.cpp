// Compiles mpipe/detail/snn/neuron-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/snn/neuron-inl.h"
