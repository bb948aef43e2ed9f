// Compiles mpipe/detail/snn/fused_neuron-inl.h into libmpipe
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/snn/fused_neuron-inl.h"
