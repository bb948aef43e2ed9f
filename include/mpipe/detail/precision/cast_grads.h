#pragma once

// Private: the low-precision weight copies of mpipe::Linear in a training step
// (Note [Cast gradients per step]).

#include <ATen/core/Tensor.h>

#include <mutex>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

/// One stage's copies in one train_step call.
class CastGrads {
 public:
  /// The copy of `weight` that the stage's micro-batches share: an
  /// autocast-dtype leaf, made at the first use. Undefined when the weight
  /// does not qualify (autocast off on its device, grad mode off, not a
  /// float32 leaf that requires grad).
  at::Tensor weight_for(const at::Tensor& weight);
  /// Adds each copy's summed gradient to its weight's .grad (converting once),
  /// on the caller's current stream, and forgets the copies.
  void flush();

 private:
  std::mutex mutex_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;  // (weight, copy)
};

/// Makes `grads` the one mpipe::Linear consults on this thread for a scope.
class CastGradsGuard {
 public:
  explicit CastGradsGuard(CastGrads* grads);
  ~CastGradsGuard();
  CastGradsGuard(const CastGradsGuard&) = delete;
  CastGradsGuard& operator=(const CastGradsGuard&) = delete;

 private:
  CastGrads* previous_;
};

}  // namespace detail
}  // namespace mpipe
