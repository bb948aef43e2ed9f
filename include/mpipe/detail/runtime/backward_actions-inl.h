#pragma once

// Private: the executor's backward actions for every call kind (Note [One
// runtime] in executor.h): B(i, s), its halves I (input gradient) and W
// (weight gradient), and the recompute of a checkpointed stage before its
// backward (Note [Training runtime] in actions-inl.h).

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/executor_run.h"

#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/recorder.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <c10/core/AutogradState.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/version.h>

#include <map>
#include <set>
#include <string>
#include <utility>

#if defined(TORCH_VERSION_MAJOR) && TORCH_VERSION_MAJOR >= 2
#define MPIPE_BACKWARD_ON_CALLER 1
#endif

namespace mpipe {
namespace detail {

// Note [Backward on the worker's thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch's autograd engine runs every CUDA node on one thread per device,
// whichever thread called backward. With all stages on one GPU, the backward
// of every stage and micro-batch then queues on that one thread while the
// workers wait: on narrow-mlp (4 stages of 8 Linear(1024), 8 micro-batches)
// that thread was busy 38 of a step's 58 ms, 256 AddmmBackward nodes at about
// 100 µs of host time each (bench/RESULTS.md, the profile of issue 15).
// LibTorch 2 can run a backward on the calling thread instead (the
// multithreading flag of the thread's AutogradState; Python's
// torch.autograd.set_multithreading_enabled): each worker then runs its own
// stage's backward, and the stages' host work proceeds in parallel, as their
// forwards do. Each node still runs on the stream of its forward, so the GPU
// sees the same work. LibTorch 1.x lacks the flag and keeps the engine's
// threads (its CPU nodes already run on the calling thread). The caller's
// own graph upstream of the pipeline runs after the call, from the caller's
// thread, on the engine's threads (backward_through_caller in
// pipeline/session-inl.h). Backward always runs with autocast off (Note
// [Autocast in the pipeline]).

/// The scope every backward of the pipeline runs in.
class BackwardScope {
 public:
  BackwardScope() {
#ifdef MPIPE_BACKWARD_ON_CALLER
    auto& state = c10::AutogradState::get_tls_state();
    previous_ = state.get_multithreading_enabled();
    state.set_multithreading_enabled(false);  // this thread runs the backward
#endif
  }
  ~BackwardScope() {
#ifdef MPIPE_BACKWARD_ON_CALLER
    c10::AutogradState::get_tls_state().set_multithreading_enabled(previous_);
#endif
  }
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

 private:
  NoAutocast no_autocast_;
#ifdef MPIPE_BACKWARD_ON_CALLER
  bool previous_ = true;
#endif
};

/// For a recompute's lifetime, the stage's module state is the one `before`
/// saved; then the state of now again (Note [State snapshots]).
class RecomputedState {
 public:
  RecomputedState(const StateSnapshot& before, const std::vector<StatefulModule>* modules)
      : now_(before.empty() ? StateSnapshot() : StateSnapshot(*modules)) {
    before.load();
  }
  ~RecomputedState() {
    try {
      now_.load();
    } catch (...) {  // an error already on its way is the one to report
    }
  }
  RecomputedState(const RecomputedState&) = delete;
  RecomputedState& operator=(const RecomputedState&) = delete;

 private:
  StateSnapshot now_;
};

/// A recompute's pop(name): the leaf its forward popped from another stage,
/// or (taken) what the recompute itself stashed.
inline at::Tensor recompute_pop(const std::map<std::string, at::Tensor>& popped,
                                std::map<std::string, at::Tensor>& stashed,
                                const std::string& name) {
  auto it = popped.find(name);
  if (it != popped.end()) return it->second;
  auto own = stashed.find(name);
  TORCH_CHECK(own != stashed.end(), "pop('", name,
              "'): the recompute popped a name its forward did not");
  at::Tensor t = own->second;
  stashed.erase(own);
  return t;
}

// Note [Checkpointed time steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// constant_train_step checkpoints by micro-batch (Note [Micro-batches over
// time]): a checkpointed micro-batch's chunks run forward without a graph,
// keeping their inputs and, before the first, the stage's module state.
// A chunk's graph cannot be rebuilt alone: it reads the state the chunk
// before left, through that chunk's graph (Note [Chained backward]). So the
// micro-batch's first backward on the stage (its last chunk's) runs all its
// chunks again, in order, from the saved state, each under its own random
// draws (Note [Random draws]), records each chunk's nodes as its forward
// would have, and puts the module state back; the chunks' backwards then run
// as usual. A stage holds a micro-batch's graph only from that recompute to
// its last backward, one micro-batch at a time (with one micro-batch, the
// whole batch's graph, but not from its forward on). The last stage is never
// checkpointed: its outputs of every micro-batch feed the one loss, so it
// would have to keep them all anyway.

MPIPE_FUNC void Executor::recompute(Run& run, int64_t j, int64_t i, const char*& phase,
                                   bool split) {
  CallSpec& call = *run.call;
  const StagePlace& stage = place(j);
  const bool last = j + 1 == n_total();
  // A training step's micro-batch is one item; a time-step call's spans its
  // time chunks (Note [Checkpointed time steps]).
  const int64_t first = call.chained ? i - call.time_chunks.chunk(i) : i;
  const int64_t end = call.chained ? first + call.time_chunks.per_micro_batch() : i + 1;
  auto& saved = run.saved[local(j)];
  StateSnapshot& before = saved[static_cast<size_t>(first)].state_before;
  phase = call.chained ? call.time_chunks.pick("recompute of item", "recompute of time chunk",
                                               "recompute of time step")
                       : "recompute of micro-batch";
  // Run from the module state the forward started from (Note [State snapshots]).
  const RecomputedState state(before, before.empty() ? nullptr : &(*call.stateful)[local(j)]);
  RecomputeGuard recompute;
  for (int64_t q = first; q < end; ++q) {
    Run::Saved& s = saved[static_cast<size_t>(q)];
    TaskSpan span(call.recorder, j, q, TaskKind::Recompute, stage.device, stage.compute);
    RngScope draws(run.rng, j, q);  // the forward's draws again (Note [Random draws])
    SkipScope skips(
        [&](const std::string& name, at::Tensor t) { s.stashed[name] = std::move(t); },
        [&](const std::string& name) { return recompute_pop(s.popped, s.stashed, name); });
    CastGradsGuard casts(run.cast_grads.empty() ? nullptr : run.cast_grads[local(j)].get());
    const uint64_t lo = ChunkNodes::now();
    try {
      s.outputs = (*run.forwards)[local(j)](s.inputs);
    } catch (...) {  // named by the item that failed, not the backward's
      throw DescribedFailure{describe_failure(call, phase, j, q)};
    }
    s.nodes = ChunkNodes{lo, ChunkNodes::now()};
    s.checkpointed = false;
    if (last) {  // a checkpointed forward skipped the loss (Note [Training runtime])
      phase = "loss of micro-batch";
      at::Tensor loss = call.loss(q, s.outputs, s.targets);
      call.losses[static_cast<size_t>(q)] = loss.detach();
      s.outputs = {call.loss_scale != 1.0 ? loss * call.loss_scale : loss};
    }
  }
  phase = call.chained ? call.time_chunks.pick("backward of item", "backward of time chunk",
                                               "backward of time step")
          : split      ? "input gradient of micro-batch"
                       : "backward of micro-batch";
}

MPIPE_FUNC void Executor::backward_action(Run& run, int64_t j, int64_t i, const char*& phase,
                                          bool split) {
  CallSpec& call = *run.call;
  const StagePlace& stage = place(j);
  const bool last = j + 1 == n_total();
  Run::Saved& sv = run.saved[local(j)][static_cast<size_t>(i)];
  Tensors grads;
  if (!last) grads = run.transport->receive(j, Key{Key::Gradient, i, {}});

  c10::OptionalStreamGuard stream_guard(stage.compute);
  MicroBatchGuard micro_batch(call.micro_batch_of(i));
  if (sv.checkpointed) recompute(run, j, i, phase, split);  // Note [Checkpointed time steps]
  const Tensors roots = sv.outputs;
  const std::map<std::string, at::Tensor> stashed = sv.stashed;
  c10::optional<TaskSpan> span;  // ends before the hand-off, as in forward_action
  span.emplace(call.recorder, j, i, split ? TaskKind::BackwardInput : TaskKind::Backward,
               stage.device, stage.compute);
  std::vector<at::Tensor> r, g;
  for (size_t k = 0; k < roots.size(); ++k) {
    if (!roots[k].requires_grad()) continue;
    if (last) {
      r.push_back(roots[k]);
      g.emplace_back();  // the loss: implicitly 1
    } else if (k < grads.size() && grads[k].defined()) {
      r.push_back(roots[k]);
      g.push_back(grads[k]);
    }
  }
  for (const auto& s : stashed) {
    at::Tensor gs = run.transport->receive(j, Key{Key::SkipGradient, i, s.first})[0];
    if (s.second.requires_grad() && gs.defined()) {
      r.push_back(s.second);
      g.push_back(gs);
    }
  }
  Tensors input_grads(sv.inputs.size());
  std::map<std::string, at::Tensor> popped_grads;
  BackwardScope backward_scope;  // Note [Backward on the worker's thread]
  if (call.chained) {  // Note [Chained backward]: chunk i's nodes, from the last chunk down
    // Stage 0's inputs are the caller's tensors, which every chunk reads:
    // the last backward (chunk 0's) catches their gradients whole.
    Tensors leaves;
    std::vector<size_t> input_of;  // stage 0: the caller's input each leaf is
    if (j == 0) {
      input_grads.assign(call.input_requires_grad.size(), at::Tensor());
      std::set<std::pair<const torch::autograd::Node*, uint32_t>> seen;  // an input given twice: once
      for (size_t k = 0; k < call.input_requires_grad.size(); ++k) {
        if (!call.input_requires_grad[k]) continue;
        const auto e = torch::autograd::impl::gradient_edge(call.caller_tensors[k]);
        if (!seen.emplace(e.function.get(), e.input_nr).second) continue;
        leaves.push_back(call.caller_tensors[k]);
        input_of.push_back(k);
      }
    } else {
      leaves = sv.inputs;
      for (size_t k = 0; k < leaves.size(); ++k) input_of.push_back(k);
    }
    const size_t n_in = leaves.size();
    for (const auto& p : sv.popped) leaves.push_back(p.second);
    const Tensors got = run.chains[local(j)].backward(r, g, sv.nodes, leaves,
                                                      /*final=*/i == 0, run.stops,
                                                      /*caller_leaves=*/j == 0 ? n_in : 0);
    for (size_t k = 0; k < n_in; ++k) input_grads[input_of[k]] = got[k];
    size_t at = n_in;
    for (const auto& p : sv.popped) popped_grads[p.first] = got[at++];
  } else if (!split) {
    if (!r.empty()) torch::autograd::backward(r, g);
    for (size_t k = 0; k < sv.inputs.size(); ++k) input_grads[k] = grad_of(sv.inputs[k]);
    for (const auto& p : sv.popped) popped_grads[p.first] = grad_of(p.second);
  } else {
    // Note [Split backward]: the gradients of the inputs now, keeping the
    // graph (and the gradients W needs) for W(i).
    std::vector<at::Tensor> xs;
    for (const auto& x : sv.inputs) {
      if (x.defined() && x.requires_grad()) xs.push_back(x);
    }
    for (const auto& p : sv.popped) xs.push_back(p.second);
    if (!r.empty()) {
      sv.weights = WeightPass(r, g, xs);
      if (!xs.empty()) {
        const auto gx = torch::autograd::grad(r, xs, g, /*retain_graph=*/true,
                                              /*create_graph=*/false, /*allow_unused=*/true);
        size_t at = 0;
        for (size_t k = 0; k < sv.inputs.size(); ++k) {
          if (sv.inputs[k].defined() && sv.inputs[k].requires_grad()) input_grads[k] = gx[at++];
        }
        for (const auto& p : sv.popped) popped_grads[p.first] = gx[at++];
      }
    }
  }
  for (const auto& p : popped_grads) {
    run.hand_off(j, sv.popped_from.at(p.first), Key{Key::SkipGradient, i, p.first}, {p.second});
  }
  span.reset();
  if (j > 0) {
    run.hand_off(j, j - 1, Key{Key::Gradient, i, {}}, std::move(input_grads));
  } else {
    call.input_grads[static_cast<size_t>(i)] = std::move(input_grads);
  }
  if (!split) sv = Run::Saved{};  // this micro-batch's activations are free now
}

MPIPE_FUNC void Executor::weight_action(Run& run, int64_t j, int64_t i) {
  CallSpec& call = *run.call;
  const StagePlace& stage = place(j);
  Run::Saved& sv = run.saved[local(j)][static_cast<size_t>(i)];
  c10::OptionalStreamGuard stream_guard(stage.compute);
  MicroBatchGuard micro_batch({i, call.n_items});
  {
    TaskSpan span(call.recorder, j, i, TaskKind::BackwardWeight, stage.device, stage.compute);
    BackwardScope backward_scope;  // Note [Backward on the worker's thread]
    sv.weights.run();
  }
  sv = Run::Saved{};  // this micro-batch's activations are free now
}

}  // namespace detail
}  // namespace mpipe
