#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_POISSON_ENCODER_H_
#define MPIPE_SNN_POISSON_ENCODER_H_

// snn::PoissonEncoder: poisson_encode (mpipe/snn/encoding.h) as a module.

#include <mpipe/snn/encoding.h>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace mpipe {
namespace snn {

/// poisson_encode as a module, e.g. the first layer of a pipeline's stage 0.
/// Each call draws fresh spikes (reproducibly: docs/design.md, "Random draws").
class PoissonEncoderImpl : public torch::nn::Module {
 public:
  /// `checked` false: SpikingJelly's rule (poisson_encode(x, false): any x, no check).
  explicit PoissonEncoderImpl(bool checked = true) : checked_(checked) {}
  /// poisson_encode(x): spikes, 1 with probability x, in x's dtype.
  at::Tensor forward(const at::Tensor& x) {
    return poisson_encode(x, checked_);
  }

 private:
  bool checked_;
};
/// A holder for PoissonEncoderImpl, as torch::nn's modules have.
TORCH_MODULE(PoissonEncoder);

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_POISSON_ENCODER_H_
