#pragma once

// State that lives across calls (membrane potentials, recurrent state): the
// interface the model-wide reset looks for, and per-micro-batch storage.
//
// Note [Per-micro-batch state]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// forward(x, split_size) runs one stage on several micro-batches, one after
// another. A stateful module must not carry micro-batch 0's state into
// micro-batch 1 (the reference Python class does, so its results depend on the
// split). The pipeline therefore tells each stage call which micro-batch it
// serves: around every call of a stage's forward, the runtime sets a
// thread-local MicroBatch {index, count} (count = number of micro-batches of
// that call; index 0 of 1 for constant_forward and sequence_forward, whose
// items are time steps of one batch, and outside any pipeline). A stateful
// module keeps one slot per micro-batch, PerMicroBatch<T> does the
// bookkeeping, so T calls of forward(x_t, split) give what T calls of the
// plain model on the whole batch give, for every split. Keep the split fixed
// between resets: a different split means different slots.
//
// Modules that hold state derive from mpipe::Stateful as well as from
// torch::nn::Module and implement reset_state(); reset_states(module) resets
// every such module in a tree (a pipeline included).

#include <torch/nn/module.h>

#include <cstdint>
#include <vector>

namespace mpipe {

/// Which micro-batch the current stage call serves.
struct MicroBatch {
  int64_t index = 0;
  int64_t count = 1;
};

/// The micro-batch of the stage call running on this thread ({0, 1} outside
/// a pipeline).
MicroBatch current_micro_batch() noexcept;

/// Sets the current micro-batch for this thread while it lives; the pipeline
/// uses it around each stage call, tests may use it to drive a module by hand.
class MicroBatchGuard {
 public:
  explicit MicroBatchGuard(MicroBatch micro_batch) noexcept;
  ~MicroBatchGuard();
  MicroBatchGuard(const MicroBatchGuard&) = delete;
  MicroBatchGuard& operator=(const MicroBatchGuard&) = delete;

 private:
  MicroBatch previous_;
};

/// One value per micro-batch, chosen by current_micro_batch().
template <typename T>
class PerMicroBatch {
 public:
  /// The slot of the current micro-batch (default-constructed at first use).
  T& get() {
    const MicroBatch mb = current_micro_batch();
    TORCH_CHECK(mb.index >= 0 && mb.index < mb.count, "mpipe::PerMicroBatch: micro-batch ",
                mb.index, " of ", mb.count, " is out of range");
    if (slots_.size() < static_cast<size_t>(mb.count)) slots_.resize(static_cast<size_t>(mb.count));
    return slots_[static_cast<size_t>(mb.index)];
  }
  void clear() { slots_.clear(); }
  std::vector<T>& slots() { return slots_; }
  const std::vector<T>& slots() const { return slots_; }

 private:
  std::vector<T> slots_;
};

/// A module whose output depends on earlier calls.
class Stateful {
 public:
  virtual ~Stateful() = default;
  /// Forgets all state, for every micro-batch.
  virtual void reset_state() = 0;
  /// Whether the module holds state now (false right after reset_state()).
  /// The default, true, is the safe answer for modules that cannot tell.
  virtual bool holds_state() const { return true; }
};

/// Calls reset_state() on every module in `module`'s tree (itself included)
/// that derives from mpipe::Stateful. Returns how many were reset.
int64_t reset_states(torch::nn::Module& module);

}  // namespace mpipe
