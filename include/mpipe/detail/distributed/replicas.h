#pragma once

// Private: the gradient all-reduce of data-parallel replicas after a
// training step (Note [Data parallel replicas]).

#include "mpipe/detail/distributed/link.h"
#include "mpipe/detail/distributed/remote.h"

#include <ATen/Functions.h>

#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

// Note [Data parallel replicas]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With GroupOptions::replicas R > 1, each replica trains on its own batch
// and, after the step, what the step added to each parameter's gradient is
// summed across the R replicas of its stage (one c10d allreduce per device
// and dtype, on the group of those replicas), then divided by R for
// LossReduction::Mean: the gradients of one step on the R batches together
// (as many rows each). Gradients accumulated before the step are kept out of
// the sum, so accumulation over several steps stays exact. The last ranks'
// losses are reduced the same way.
class ReplicaGradients {
 public:
  /// Made before the step, on a rank whose group has replicas > 1.
  ReplicaGradients(std::vector<at::Tensor> params, detail::RemoteCall& remote)
      : remote_(&remote), params_(std::move(params)) {
    for (const auto& p : params_) {
      before_.push_back(p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
    }
  }

  void reduce(bool mean, at::Tensor& loss) {
    std::vector<at::Tensor> added;
    for (size_t k = 0; k < params_.size(); ++k) {
      at::Tensor& p = params_[k];
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);  // every replica sends one
      at::Tensor g = p.grad();
      if (before_[k].defined()) g.sub_(before_[k]);
      added.push_back(g);
    }
    if (loss.defined()) added.push_back(loss);
    detail::allreduce_replicas(remote_->group(), added, mean);
    for (size_t k = 0; k < params_.size(); ++k) {
      if (before_[k].defined()) params_[k].grad().add_(before_[k]);
    }
  }

 private:
  detail::RemoteCall* remote_;
  std::vector<at::Tensor> params_, before_;
};

}  // namespace detail
}  // namespace mpipe
