#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/batchnorm.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <any>
#include <tuple>
#include <vector>

namespace mpipe {

namespace detail {

/// Everything a call can change (Note [State snapshots]).
struct DeferredBatchNormState {
  at::Tensor mean, m2;
  int64_t count = 0, seen = 0;
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

MPIPE_FUNC void DeferredBatchNormImpl::reset_state() {
  mean_ = m2_ = at::Tensor();
  count_ = 0;
  seen_ = 0;
}

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
    // This micro-batch's mean and sum of squared deviations, combined with
    // those so far (Chan, Golub and LeVeque's pairwise update) in double.
    const auto var_mean = at::var_mean(xd, at::IntArrayRef(dims), /*unbiased=*/false,
                                       /*keepdim=*/false);
    const int64_t nb = x.numel() / options.num_features();
    const at::Tensor mean_b = std::get<1>(var_mean).to(at::kDouble);
    const at::Tensor m2_b = std::get<0>(var_mean).to(at::kDouble) * static_cast<double>(nb);
    if (count_ == 0) {
      mean_ = mean_b;
      m2_ = m2_b;
    } else {
      const double na = static_cast<double>(count_), n = na + static_cast<double>(nb);
      const at::Tensor delta = mean_b - mean_;
      mean_ = mean_ + delta * (static_cast<double>(nb) / n);
      m2_ = m2_ + m2_b + delta * delta * (na * static_cast<double>(nb) / n);
    }
    count_ += nb;
  }
  // Once every micro-batch was seen, in whatever order a program ran them.
  if (++seen_ == current_micro_batch().count) commit();
  return y;
}

MPIPE_FUNC void DeferredBatchNormImpl::commit() {
  c10::NoGradGuard no_grad;
  const double n = static_cast<double>(count_);
  const at::Tensor unbiased = count_ > 1 ? m2_ / (n - 1) : m2_ / n;
  const double m = options.momentum();
  running_mean.mul_(1 - m).add_(mean_.to(running_mean.options()) * m);
  running_var.mul_(1 - m).add_(unbiased.to(running_var.options()) * m);
  num_batches_tracked.add_(1);
  reset_state();
}

MPIPE_FUNC std::any DeferredBatchNormImpl::save_state() const {
  c10::NoGradGuard no_grad;
  return detail::DeferredBatchNormState{mean_,
                                        m2_,
                                        count_,
                                        seen_,
                                        running_mean.clone(),
                                        running_var.clone(),
                                        num_batches_tracked.clone()};
}

MPIPE_FUNC void DeferredBatchNormImpl::load_state(const std::any& state) {
  const auto& s = std::any_cast<const detail::DeferredBatchNormState&>(state);
  c10::NoGradGuard no_grad;
  mean_ = s.mean;
  m2_ = s.m2;
  count_ = s.count;
  seen_ = s.seen;
  running_mean.copy_(s.running_mean);
  running_var.copy_(s.running_var);
  num_batches_tracked.copy_(s.num_batches_tracked);
}

MPIPE_FUNC void DeferredBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::DeferredBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=" << options.momentum() << ", affine=" << options.affine() << ")";
}

}  // namespace mpipe
