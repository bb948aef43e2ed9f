#pragma once

// Private: which stage and time step a failing node of constant_train_step's
// backward pass belongs to.
//
// Note [Backward positions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// train_step runs each stage's backward as an operation of its own, so a
// failure there is named by the operation. constant_train_step instead calls
// backward once on the loss of the summed outputs: autograd then walks the
// graph that every stage built at every time step, and an error thrown by a
// node comes back without saying whose node it was. So, in that call only,
// each stage call tags the autograd nodes it created: after stage j's forward
// of step t, the nodes reachable from its output that no earlier stage call
// tagged (the walk stops there, at the call's input, and at AccumulateGrad
// leaves) get a pre-hook that stores (j, t) as "the position that started
// last" just before the node runs. When backward throws, that position names
// the failing node's stage and step. The walk costs a few microseconds per
// stage call, and only constant_train_step pays it. With stages on several
// devices the engine runs nodes on one thread per device; the position is
// then the one that started last on any of them, which can name a stage whose
// node was running beside the failing one.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/version.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

class BackwardPositions {
 public:
  /// `input`'s own graph (the caller's) is not the pipeline's: never tagged.
  explicit BackwardPositions(const at::Tensor& input)
      : stop_(input.defined() ? input.grad_fn().get() : nullptr),
        last_(std::make_shared<std::atomic<int64_t>>(-1)) {}

  /// Tags the nodes stage `stage` created for `item`, reachable from `output`.
  void tag(int64_t stage, int64_t item, const at::Tensor& output) {
    if (!output.defined() || !output.grad_fn()) return;
    const int64_t packed = (stage << 32) | item;
    // A node already tagged (by an earlier stage call, whose hand-off ordered
    // it before this one) carries a Hook first: no set of visited nodes is
    // needed. The lock only guards graphs users share between stages.
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<torch::autograd::Node*> stack{output.grad_fn().get()};
    while (!stack.empty()) {
      torch::autograd::Node* node = stack.back();
      stack.pop_back();
      if (node == stop_ || dynamic_cast<torch::autograd::AccumulateGrad*>(node)) continue;
      auto& hooks = hooks_of(*node);
      if (!hooks.empty() && dynamic_cast<Hook*>(hooks.front().get())) continue;
      // First in line, before hooks users registered on the node's output
      // (which may be what throws).
      hooks.insert(hooks.begin(), std::make_unique<Hook>(last_, packed));
      for (const auto& edge : node->next_edges()) {
        if (edge.function) stack.push_back(edge.function.get());
      }
    }
  }

  /// (stage, item) of the tagged node that started last; (-1, -1) if none.
  std::pair<int64_t, int64_t> last() const {
    const int64_t packed = last_->load();
    if (packed < 0) return {-1, -1};
    return {packed >> 32, packed & 0xffffffff};
  }

 private:
  struct Hook : torch::autograd::FunctionPreHook {
    Hook(std::shared_ptr<std::atomic<int64_t>> last, int64_t packed)
        : last(std::move(last)), packed(packed) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
      last->store(packed);
      return grads;
    }
    std::shared_ptr<std::atomic<int64_t>> last;
    int64_t packed;
  };

  /// The pre-hooks that run first: LibTorch 2 runs the hooks registered on a
  /// node's outputs (tensor_pre_hooks) before the node's own; 1.13 keeps both
  /// in pre_hooks().
  static std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>& hooks_of(
      torch::autograd::Node& node) {
#if TORCH_VERSION_MAJOR >= 2
    return node.tensor_pre_hooks();
#else
    return node.pre_hooks();
#endif
  }

  std::mutex mutex_;
  torch::autograd::Node* stop_;  // the caller's graph begins here
  std::shared_ptr<std::atomic<int64_t>> last_;  // shared with the hooks, which outlive this
};

}  // namespace detail
}  // namespace mpipe
