#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/snn/encoding.h"
#include "mpipe/detail/cuda/device_probe.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

namespace mpipe {
namespace snn {

MPIPE_FUNC at::Tensor poisson_encode(const at::Tensor& x, bool checked) {
  TORCH_CHECK(x.defined() && at::isFloatingType(x.scalar_type()),
              "mpipe::snn::poisson_encode: x must be a floating-point tensor of probabilities");
  if (!checked) return at::rand_like(x).le(x).to(x.scalar_type());  // SpikingJelly's rule
  // One rule on every device (encoding.h): one reduction, its two values read
  // back at once (a host sync on a GPU). A CUDA graph being captured can read
  // nothing back, so the check is left out of the capture.
  if (x.numel() > 0 && !detail::capturing_graph(x.device())) {
    // LibTorch 1.13 has no aminmax for Half on the CPU: a float copy, exact.
    const bool cpu_half = x.is_cpu() && x.scalar_type() == at::kHalf;
    const auto range = at::aminmax(cpu_half ? x.to(at::kFloat) : x);
    const at::Tensor ends =
        at::stack({std::get<0>(range), std::get<1>(range)}).to(at::kCPU, at::kDouble);
    const double lo = ends.data_ptr<double>()[0], hi = ends.data_ptr<double>()[1];
    TORCH_CHECK(lo >= 0 && hi <= 1,  // false for NaN too
                "mpipe::snn::poisson_encode: x must lie in [0, 1], got values in [", lo, ", ",
                hi, "]");
  }
  return at::rand_like(x).lt(x).to(x.scalar_type());
}

MPIPE_FUNC at::Tensor rate_from_sum(const at::Tensor& summed_spikes, int64_t T) {
  TORCH_CHECK(T > 0, "mpipe::snn::rate_from_sum: T must be positive, got ", T);
  return summed_spikes / static_cast<double>(T);
}

MPIPE_FUNC at::Tensor rate_from_sequence(const at::Tensor& spikes) {
  TORCH_CHECK(spikes.dim() >= 1 && spikes.size(0) > 0,
              "mpipe::snn::rate_from_sequence: expected a [T, N, ...] sequence with T > 0, got "
              "shape ",
              spikes.sizes());
  return spikes.mean(0);
}

MPIPE_FUNC at::Tensor predict(const at::Tensor& rate) {
  TORCH_CHECK(rate.dim() >= 1, "mpipe::snn::predict: expected rates [N, C], got shape ",
              rate.sizes());
  return rate.argmax(-1);
}

MPIPE_FUNC at::Tensor rate_mse_loss(const at::Tensor& rate, const at::Tensor& labels) {
  TORCH_CHECK(rate.dim() == 2, "mpipe::snn::rate_mse_loss: expected rates [N, C], got shape ",
              rate.sizes());
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == rate.size(0),
              "mpipe::snn::rate_mse_loss: expected labels [", rate.size(0), "], got shape ",
              labels.sizes());
  const at::Tensor target =
      at::one_hot(labels.to(rate.device(), at::kLong), rate.size(1)).to(rate.scalar_type());
  return at::mse_loss(rate, target);
}

}  // namespace snn
}  // namespace mpipe
