#include "mpipe/batchnorm.h"

#include "mpipe/checkpoint.h"
#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <vector>

namespace mpipe {

DeferredBatchNormImpl::DeferredBatchNormImpl(DeferredBatchNormOptions options_)
    : options(options_) {
  TORCH_CHECK(options.num_features() > 0,
              "mpipe::DeferredBatchNorm: num_features must be positive, got ",
              options.num_features());
  reset();
}

void DeferredBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", at::ones({c}));
    bias = register_parameter("bias", at::zeros({c}));
  }
  running_mean = register_buffer("running_mean", at::zeros({c}));
  running_var = register_buffer("running_var", at::ones({c}));
  num_batches_tracked = register_buffer("num_batches_tracked", at::zeros({}, at::kLong));
  sum_ = sum_squares_ = at::Tensor();
  count_ = 0;
}

at::Tensor DeferredBatchNormImpl::forward(const at::Tensor& x) {
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
  if (is_recomputing()) return y;
  {
    c10::NoGradGuard no_grad;
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
    const at::Tensor xd = x.detach().to(running_mean.scalar_type());
    const at::Tensor s = xd.sum(dims), ss = (xd * xd).sum(dims);
    sum_ = sum_.defined() ? sum_ + s : s;
    sum_squares_ = sum_squares_.defined() ? sum_squares_ + ss : ss;
    count_ += x.numel() / options.num_features();
  }
  const MicroBatch mb = current_micro_batch();
  if (mb.index + 1 == mb.count) commit();
  return y;
}

void DeferredBatchNormImpl::commit() {
  c10::NoGradGuard no_grad;
  const double n = static_cast<double>(count_);
  const at::Tensor mean = sum_ / n;
  const at::Tensor var = (sum_squares_ / n - mean * mean).clamp_min(0);
  const at::Tensor unbiased = count_ > 1 ? var * (n / (n - 1)) : var;
  const double m = options.momentum();
  running_mean.mul_(1 - m).add_(mean.to(running_mean.device()) * m);
  running_var.mul_(1 - m).add_(unbiased.to(running_var.device()) * m);
  num_batches_tracked.add_(1);
  sum_ = sum_squares_ = at::Tensor();
  count_ = 0;
}

void DeferredBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::DeferredBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=" << options.momentum() << ", affine=" << options.affine() << ")";
}

}  // namespace mpipe
