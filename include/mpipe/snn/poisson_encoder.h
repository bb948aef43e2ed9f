#pragma once

// The outermost mpipe header of a file (Note [Header-only mode]).
#ifndef MPIPE_DETAIL_OUTER
#define MPIPE_DETAIL_OUTER 24
#endif

// snn::PoissonEncoder: poisson_encode (mpipe/snn/encoding.h) as a module.

#include <mpipe/snn/encoding.h>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace mpipe {
namespace snn {

/// poisson_encode as a module, e.g. the first layer of a pipeline's stage 0.
/// Each call draws fresh spikes (reproducibly: README, "Random draws").
class PoissonEncoderImpl : public torch::nn::Module {
 public:
  at::Tensor forward(const at::Tensor& x) { return poisson_encode(x); }
};
TORCH_MODULE(PoissonEncoder);

}  // namespace snn
}  // namespace mpipe

#if MPIPE_DETAIL_OUTER == 24
#undef MPIPE_DETAIL_OUTER
#include "mpipe/detail/header_only.h"
#endif
