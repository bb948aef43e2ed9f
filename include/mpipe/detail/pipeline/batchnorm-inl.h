#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/batchnorm.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <any>
#include <tuple>
#include <vector>

namespace mpipe {

namespace detail {

/// Everything a call can change (Note [State snapshots]).
template <typename Part>
struct DeferredBatchNormState {
  std::vector<Part> parts;  // their tensors are never written in place
  at::Tensor running_mean, running_var, num_batches_tracked;  // clones
};

}  // namespace detail

MPIPE_FUNC DeferredBatchNormImpl::DeferredBatchNormImpl(DeferredBatchNormOptions options_)
    : options(options_) {
  TORCH_CHECK(options.num_features() > 0,
              "mpipe::DeferredBatchNorm: num_features must be positive, got ",
              options.num_features());
  reset();
}

MPIPE_FUNC void DeferredBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", at::ones({c}));
    bias = register_parameter("bias", at::zeros({c}));
  }
  running_mean = register_buffer("running_mean", at::zeros({c}));
  running_var = register_buffer("running_var", at::ones({c}));
  num_batches_tracked = register_buffer("num_batches_tracked", at::zeros({}, at::kLong));
  reset_state();
}

MPIPE_FUNC void DeferredBatchNormImpl::reset_state() { parts_.clear(); }

MPIPE_FUNC at::Tensor DeferredBatchNormImpl::forward(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 2 && x.size(1) == options.num_features(),
              "mpipe::DeferredBatchNorm: expected input [N, ", options.num_features(),
              ", ...], got shape ", x.sizes());
  if (!is_training()) {
    return at::batch_norm(x, weight, bias, running_mean, running_var, /*training=*/false, 0.0,
                          options.eps(), /*cudnn_enabled=*/true);
  }
  // Normalise with this micro-batch's statistics, leave the running ones alone.
  at::Tensor y = at::batch_norm(x, weight, bias, at::Tensor(), at::Tensor(), /*training=*/true,
                                0.0, options.eps(), /*cudnn_enabled=*/true);
  {
    c10::NoGradGuard no_grad;
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
    at::Tensor xd = x.detach();
    if (xd.scalar_type() == at::kHalf || xd.scalar_type() == at::kBFloat16) xd = xd.to(at::kFloat);
    // This micro-batch's mean and sum of squared deviations, in double.
    const auto var_mean = at::var_mean(xd, at::IntArrayRef(dims), /*unbiased=*/false,
                                       /*keepdim=*/false);
    const int64_t nb = x.numel() / options.num_features();
    parts_.push_back(Part{current_micro_batch().index, nb,
                          std::get<1>(var_mean).to(at::kDouble),
                          std::get<0>(var_mean).to(at::kDouble) * static_cast<double>(nb)});
  }
  // Once every micro-batch was seen, in whatever order a program ran them.
  if (static_cast<int64_t>(parts_.size()) == current_micro_batch().count) commit();
  return y;
}

MPIPE_FUNC void DeferredBatchNormImpl::commit() {
  c10::NoGradGuard no_grad;
  // In micro-batch order (Note [Deferred BatchNorm]): Chan, Golub and
  // LeVeque's pairwise update, one micro-batch at a time.
  std::stable_sort(parts_.begin(), parts_.end(),
                   [](const Part& a, const Part& b) { return a.micro_batch < b.micro_batch; });
  at::Tensor mean = parts_[0].mean, m2 = parts_[0].m2;
  int64_t count = parts_[0].rows;
  for (size_t k = 1; k < parts_.size(); ++k) {
    const Part& b = parts_[k];
    const double na = static_cast<double>(count), nb = static_cast<double>(b.rows);
    const double n = na + nb;
    const at::Tensor delta = b.mean - mean;
    mean = mean + delta * (nb / n);
    m2 = m2 + b.m2 + delta * delta * (na * nb / n);
    count += b.rows;
  }
  const double n = static_cast<double>(count);
  const at::Tensor unbiased = count > 1 ? m2 / (n - 1) : m2 / n;
  const double m = options.momentum();
  running_mean.mul_(1 - m).add_(mean.to(running_mean.options()) * m);
  running_var.mul_(1 - m).add_(unbiased.to(running_var.options()) * m);
  num_batches_tracked.add_(1);
  reset_state();
}

MPIPE_FUNC std::any DeferredBatchNormImpl::save_state() const {
  c10::NoGradGuard no_grad;
  return detail::DeferredBatchNormState<Part>{parts_, running_mean.clone(), running_var.clone(),
                                              num_batches_tracked.clone()};
}

MPIPE_FUNC void DeferredBatchNormImpl::load_state(const std::any& state) {
  const auto& s = std::any_cast<const detail::DeferredBatchNormState<Part>&>(state);
  c10::NoGradGuard no_grad;
  parts_ = s.parts;
  running_mean.copy_(s.running_mean);
  running_var.copy_(s.running_var);
  num_batches_tracked.copy_(s.num_batches_tracked);
}

MPIPE_FUNC void DeferredBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::DeferredBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=" << options.momentum() << ", affine=" << options.affine() << ")";
}

}  // namespace mpipe
