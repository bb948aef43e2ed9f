#pragma once

// mpipe's spiking-neural-network toolkit: neurons, surrogate gradients,
// encoders and rate decoding. State handling: mpipe/state.h.

#include <mpipe/snn/encoding.h>
#include <mpipe/snn/neuron.h>
#include <mpipe/snn/poisson_encoder.h>
#include <mpipe/snn/surrogate.h>
#include <mpipe/state.h>
