#pragma once

// Private: the weight half of a split backward (Note [Split backward]).

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace mpipe {
namespace detail {

/// Prepared before the input pass I(i) of a stage, run as W(i):
///   WeightPass w(roots, grads, inputs);  // before autograd::grad(roots, inputs, ...)
///   ...autograd::grad(roots, inputs, grads, /*retain_graph=*/true)...
///   w.run();  // later: accumulates the gradients of every other leaf
/// `grads` holds an undefined tensor for a root whose gradient is 1 (a loss).
class WeightPass {
 public:
  WeightPass() = default;
  WeightPass(std::vector<at::Tensor> roots, std::vector<at::Tensor> grads,
             const std::vector<at::Tensor>& inputs);

  /// Accumulates the weight gradients, once; then frees what it held.
  void run();
  /// True when W reuses the gradients I computed (no activation gradient is
  /// computed twice); false when it backpropagates from the roots again.
  bool reuses_input_pass() const;

 private:
  struct Plan;
  std::shared_ptr<Plan> plan_;  // shared by copies (Saved is copied while empty)
};

}  // namespace detail
}  // namespace mpipe
