#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_H_
#define MPIPE_SNN_H_

// mpipe's spiking-neural-network toolkit: neurons (single- and multi-step),
// multi-step containers, the spiking conv block, dropout over time, surrogate
// gradients, encoders and rate decoding. State handling: mpipe/state.h.

#include <mpipe/snn/containers.h>
#include <mpipe/snn/conv_block.h>
#include <mpipe/snn/dropout.h>
#include <mpipe/snn/encoding.h>
#include <mpipe/snn/monitor.h>
#include <mpipe/snn/neuron.h>
#include <mpipe/snn/poisson_encoder.h>
#include <mpipe/snn/step_mode.h>
#include <mpipe/snn/surrogate.h>
#include <mpipe/state.h>

#endif  // MPIPE_SNN_H_
