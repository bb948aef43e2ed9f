#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_STATE_H_
#define MPIPE_STATE_H_

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
// that call; for constant_forward, sequence_forward and constant_train_step
// the micro-batch of their split, index 0 of 1 without one, and outside any
// pipeline). A stateful
// module keeps one slot per micro-batch, PerMicroBatch<T> does the
// bookkeeping, so T calls of forward(x_t, split) give what T calls of the
// plain model on the whole batch give, for every split. Keep the split fixed
// between resets: a different split means different slots.
//
// Modules that hold state derive from mpipe::Stateful as well as from
// torch::nn::Module and implement reset_state(); reset_states(module) resets
// every such module in a tree (a pipeline included).
//
// Note [State snapshots]
// ~~~~~~~~~~~~~~~~~~~~~~
// Two things need to put a module's state back where it was:
//  - activation checkpointing: a checkpointed stage runs again in backward.
//    The recompute must start from the state the original forward started
//    from, and the state must end where the original forward left it, or a
//    neuron would advance twice and the gradients would be wrong. The runtime
//    saves the state of every Stateful module of the stage before a
//    checkpointed forward, loads it for the recompute and loads the state of
//    the time of the recompute again after it;
//  - failed calls: a pipeline call saves every Stateful module's state when it
//    starts and loads it back when the call throws, so a failed call leaves
//    membrane potentials, DeferredBatchNorm's statistics and users' state as
//    they were before it.
// A module opts in by returning true from supports_state_snapshots() and
// implementing save_state() / load_state(). save_state() returns the whole
// state (every micro-batch's) as a value that later forward calls must not
// change: copying tensors' handles is enough when forward assigns new tensors
// (v = f(v, x)), a module that updates tensors in place must clone them.
// PerMicroBatch::save()/load() do this for the common case. Checkpointing a
// stage that holds a Stateful module without snapshots is refused with an
// error; after a failed call such a module is left where the failure stopped
// it (reset it with reset_states).

#include <c10/util/Exception.h>

#include <any>
#include <cstdint>
#include <vector>

namespace torch {
namespace nn {
class Module;  // torch/nn/module.h: not needed here, and costly to parse
}  // namespace nn
}  // namespace torch

namespace mpipe {

/// Which micro-batch the current stage call serves.
struct MicroBatch {
  /// Its index, from 0.
  int64_t index = 0;
  /// How many micro-batches the call has.
  int64_t count = 1;
};

/// The micro-batch of the stage call running on this thread ({0, 1} outside
/// a pipeline).
MicroBatch current_micro_batch() noexcept;

/// Sets the current micro-batch for this thread while it lives; the pipeline
/// uses it around each stage call, tests may use it to drive a module by hand.
class MicroBatchGuard {
 public:
  /// Makes `micro_batch` current until the guard is destroyed, then restores the previous one.
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
  /// Drops every slot (a reset).
  void clear() { slots_.clear(); }
  /// Every slot, for Stateful::save_state (a copy of the vector: tensors share
  /// their storage, right when forward assigns new tensors to the slots).
  std::any save() const { return slots_; }
  /// Puts back what save() returned.
  void load(const std::any& saved) { slots_ = std::any_cast<const std::vector<T>&>(saved); }
  /// Every slot, by micro-batch index (those used since the last clear()).
  std::vector<T>& slots() { return slots_; }
  /// Every slot, by micro-batch index (those used since the last clear()).
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
  /// Whether save_state() and load_state() work (Note [State snapshots]);
  /// checkpointing a stage that holds this module needs them.
  virtual bool supports_state_snapshots() const { return false; }
  /// The whole state, as a value later calls of forward do not change.
  virtual std::any save_state() const;
  /// Puts back a state that save_state() returned.
  virtual void load_state(const std::any& state);
};

/// Calls reset_state() on every module in `module`'s tree (itself included)
/// that derives from mpipe::Stateful. Returns how many were reset.
int64_t reset_states(torch::nn::Module& module);

}  // namespace mpipe

#endif  // MPIPE_STATE_H_
