#pragma once

// Private: what one Executor::run holds while its actions run, shared by
// executor-inl.h (the run), actions-inl.h and backward_actions-inl.h (the
// actions).

#include "mpipe/detail/config.h"

#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/precision/cast_grads.h"
#include "mpipe/detail/runtime/time_chunks.h"
#include "mpipe/detail/runtime/executor.h"
#include "mpipe/detail/runtime/rng.h"
#include "mpipe/detail/runtime/skips.h"
#include "mpipe/detail/runtime/split_backward.h"
#include "mpipe/detail/runtime/state_snapshot.h"
#include "mpipe/detail/runtime/transport.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace mpipe {
namespace detail {

inline bool can_require_grad(const at::Tensor& t) {
  return t.defined() && (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()));
}

/// A detached copy of `t` that requires grad when `grad` and it can.
inline at::Tensor leaf(const at::Tensor& t, bool grad) {
  if (!t.defined()) return t;
  at::Tensor out = t.detach();
  if (grad && can_require_grad(out)) out.requires_grad_(true);
  return out;
}

/// The gradient a leaf got in backward; undefined when it got none.
inline at::Tensor grad_of(const at::Tensor& leaf) {
  return leaf.defined() && leaf.requires_grad() ? leaf.grad() : at::Tensor();
}

/// A hand-off held back while this thread runs a pair of operations
/// (Op::with_next, Note [DualPipeV]): sent once both ran.
struct HeldHandOff {
  int64_t from, to;
  Key key;
  Tensors values;
};
MPIPE_INLINE_VAR thread_local std::vector<HeldHandOff>* t_held = nullptr;

/// An error that already says what happened and where: run_action reports it
/// as it is instead of as a failure of the action that found it.
struct DescribedFailure {
  std::exception_ptr error;
};

struct Executor::Run {
  struct Saved {
    Tensors inputs;   // detached leaves
    Tensors outputs;  // backward roots: the outputs, or {loss} on the last stage
    Tensors targets;  // last stage, checkpointed: for the recomputed loss
    std::map<std::string, at::Tensor> stashed;  // roots, with gradients from the poppers
    std::map<std::string, at::Tensor> popped;   // leaves, their gradients go to...
    std::map<std::string, int64_t> popped_from;  // ...the stasher
    StateSnapshot state_before;  // checkpointed: the stage's module state before forward
    bool checkpointed = false;
    WeightPass weights;  // split backward: prepared by I(i), run by W(i)
    ChunkNodes nodes;    // chained: the nodes the forward made (Note [Chained backward])
  };

  CallSpec* call = nullptr;
  const std::vector<StageForward>* forwards = nullptr;
  std::unique_ptr<LocalTransport> local;
  std::unique_ptr<Transport> remote;  // a call across processes (CallLink::attach)
  Transport* transport = nullptr;           // remote, else local
  std::map<std::string, std::shared_ptr<c10::Event>> entries;  // by device: the caller's work
  at::ThreadLocalState tls;
  AutocastState autocast = AutocastState::current();  // Note [Autocast in the pipeline]
  CallRng rng;
  SkipTable skips;
  Tensors stage0_input;                   // same_input: received once
  std::vector<std::vector<Saved>> saved;  // [stage][item], training only
  std::vector<std::unique_ptr<CastGrads>> cast_grads;  // [stage]: Note [Cast gradients per step]
  std::vector<ChunkChain> chains;                      // [stage], chained calls
  std::set<const torch::autograd::Node*> stops;        // chained: the caller's inputs' nodes

  std::mutex mutex;  // guards what follows
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  int64_t finished = 0;
  int64_t expected = 0;  // worker programs queued
  std::condition_variable done;

  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::move(e);
    }
    failed.store(true, std::memory_order_release);
    transport->abort();
  }

  /// Stage `from` hands `values` to stage `to`, now or, inside a pair, once
  /// the pair ran (Executor::run_pair).
  void hand_off(int64_t from, int64_t to, const Key& key, Tensors values) {
    if (t_held) {
      t_held->push_back(HeldHandOff{from, to, key, std::move(values)});
    } else {
      transport->send(from, to, key, std::move(values));
    }
  }

  /// The caller's tensors made usable by stage `to`.
  Tensors from_caller(int64_t to, int64_t item, Tensors values) const {
    for (auto& v : values) {
      if (!v.defined()) continue;
      auto it = entries.find(v.device().str());
      v = local->accept(to, item, {v}, it == entries.end() ? nullptr : it->second)[0];
    }
    return values;
  }
};

}  // namespace detail
}  // namespace mpipe
