// The SNN subsystem of libmpipe: its -inl.h files compiled once
// (Note [Header-only mode] in mpipe/detail/config.h).
#include "mpipe/detail/snn/encoding-inl.h"
#include "mpipe/detail/snn/fused_neuron-inl.h"
#include "mpipe/detail/snn/monitor-inl.h"
#include "mpipe/detail/snn/neuron-inl.h"
#include "mpipe/detail/snn/surrogate-inl.h"
