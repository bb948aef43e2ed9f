#pragma once

// Private: the executor's actions, F(i, s), B(i, s) and its halves I and W,
// for every call kind (Note [One runtime] in executor.h).

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/executor_run.h"

#include "mpipe/detail/runtime/backward_scope.h"
#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/recorder.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <string>
#include <utility>

namespace mpipe {
namespace detail {

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

// Note [Training runtime]
// ~~~~~~~~~~~~~~~~~~~~~~~
// train_step cuts the autograd graph at every stage boundary: stage j's
// forward of micro-batch i runs on detached copies of its inputs that require
// grad (floating-point ones; stage 0's only where the caller's do), and keeps
// (inputs, outputs) until its backward. The last stage's forward also computes
// the micro-batch's weighted loss. B(j, i) calls autograd on stage j's piece
// alone: backward(loss_i) on the last stage, backward(outputs, grads)
// elsewhere, where grads are the gradients of stage j's outputs that B(j + 1,
// i) sent back (the .grad of its detached inputs). So each stage's backward is
// an action the schedule can place, which is what lets 1F1B free a
// micro-batch's activations as soon as its backward ran. Autograd runs each
// backward op on its forward op's stream, and the backward call's own thread
// has stage j's stream current, so the engine's final sync makes the input
// gradients safe to hand on from that stream.
//
// Checkpointing: a checkpointed forward runs under NoGradGuard and keeps only
// its inputs (and what it popped) and the state of the stage's Stateful
// modules (Note [State snapshots]); its backward runs the stage again (under
// RecomputeGuard) from that module state, with the random draws of the same
// (stage, micro-batch) (Note [Random draws]), puts the module state back where
// it was, then backpropagates. Dropout therefore draws the same mask and a
// neuron advances once per micro-batch. On the last stage a checkpointed
// forward skips the loss: the recompute computes it, so loss_fn runs once per
// micro-batch in every mode. Losses are summed in micro-batch order after the
// step, so the returned loss does not depend on the schedule. Nothing is
// checkpointed in eval mode.

MPIPE_FUNC void Executor::forward_action(Run& run, int64_t j, int64_t i, const char*& phase) {
  CallSpec& call = *run.call;
  const StagePlace& stage = place(j);
  const c10::optional<c10::Stream> compute = stream_for(call, j, i);  // Note [Lanes]
  const bool last = j + 1 == n_total();
  const uint64_t first_node = ChunkNodes::now();
  Tensors in;
  if (j == 0 && call.same_input && i > 0) {
    in = run.stage0_input;
  } else if (j == 0) {
    in = run.from_caller(0, i, call.source(i));
    if (call.same_input) run.stage0_input = in;
  } else {
    in = run.transport->receive(j, Key{Key::Activation, i, {}});
  }
  Run::Saved* sv = call.training ? &run.saved[local(j)][static_cast<size_t>(i)]
                                 : nullptr;
  // Chained: by micro-batch, never on the last stage (Note [Checkpointed
  // time steps]).
  const bool ckpt =
      call.training &&
      (call.chained ? !last && checkpointed(call.checkpoint, call.time_chunks.micro_batch(i),
                                            call.time_chunks.micro_batches())
                    : checkpointed(call.checkpoint, i, call.n_items));
  if (sv) {
    sv->checkpointed = ckpt;
    if (!(call.chained && j == 0)) {  // chained: the caller's graph is the chain's
      for (size_t k = 0; k < in.size(); ++k) {
        in[k] = leaf(in[k], j > 0 || (k < call.input_requires_grad.size() &&
                                      call.input_requires_grad[k]));
      }
    }
    if (!(call.chained && j == 0) || ckpt) sv->inputs = in;  // chained: for the recompute
  }

  c10::OptionalStreamGuard stream_guard(compute);
  MicroBatchGuard micro_batch(call.micro_batch_of(i));
  // Ends before the hand-off, so the next stage's task starts after it.
  c10::optional<TaskSpan> span;
  span.emplace(call.recorder, j, i, TaskKind::Forward, stage.device, compute);
  Tensors out;
  {
    RngScope draws(run.rng, j, i);
    std::map<std::string, at::Tensor> own;  // training: this stage's stashes, as stashed
    SkipScope skips(
        [&](const std::string& name, at::Tensor t) {
          run.skips.stash(name, i, j);
          if (sv) {
            own[name] = t;
            if (!ckpt) sv->stashed[name] = t;
          }
          run.transport->send(j, -1, Key{Key::Skip, i, name}, {sv ? t.detach() : t});
        },
        [&](const std::string& name) {
          const int64_t from = run.skips.pop(name, i, j);
          at::Tensor t = run.transport->receive(j, Key{Key::Skip, i, name})[0];
          if (sv && from == j) {
            // Stashed and popped by this stage: no boundary for the gradient to cross.
            t = own.at(name);
            sv->stashed.erase(name);
          } else if (sv) {
            t = leaf(t, true);
            sv->popped[name] = t;
            sv->popped_from[name] = from;
          }
          return t;
        });
    CastGradsGuard casts(run.cast_grads.empty() ? nullptr : run.cast_grads[local(j)].get());
    // A stage's own error (a shape mismatch, most often) also gets the shapes
    // the stage was given and where they came from.
    auto call_stage = [&] {
      try {
        return (*run.forwards)[local(j)](in);
      } catch (const c10::Error& e) {
        std::string shapes;
        for (const auto& t : in) {
          shapes += c10::str(shapes.empty() ? "" : ", ",
                             t.defined() ? c10::str(t.sizes()) : std::string("undefined"));
        }
        TORCH_CHECK(false, e.what_without_backtrace(), " (the stage's input",
                    in.size() == 1 ? ": shape " : "s: shapes ", shapes,
                    j > 0 ? c10::str(", the output of stage ", j - 1) : std::string(", the call's"),
                    ")");
      }
      return Tensors();  // not reached: TORCH_CHECK threw
    };
    if (ckpt) {
      // Chained: a micro-batch is recomputed from the state before its first chunk.
      if (call.stateful && (!call.chained || call.time_chunks.chunk(i) == 0)) {
        sv->state_before = StateSnapshot((*call.stateful)[local(j)]);
      }
      c10::NoGradGuard no_grad;
      // No cast made here may enter autocast's cache: made without grad, it
      // would serve the recompute, and no gradient would reach its weight.
      AutocastState uncached = AutocastState::current();
      uncached.cache = false;
      AutocastScope autocast(uncached);
      out = call_stage();
    } else {
      out = call_stage();
    }
  }
  TORCH_CHECK(!out.empty(), "the stage returned no tensor");
  for (size_t k = 0; k < out.size(); ++k) {
    TORCH_CHECK(out[k].defined(), "the stage returned an undefined tensor",
                out.size() > 1 ? c10::str(" (output ", k, " of ", out.size(), ")") : "");
  }
  if (last) {
    // Every stage ran item i: a stash no stage popped is an error of its
    // stasher, not of this stage's loss or output (Note [Skip connections]).
    const auto unpopped = run.skips.unpopped(i);
    if (unpopped.second >= 0) {
      const int64_t s = unpopped.second;
      const bool here = s >= first_ && local(s) < stages_.size();  // else on another rank
      try {
        TORCH_CHECK(false, "mpipe::ModelPipeline::", call.method, ": stage ", s,
                    here ? c10::str(" (on ", place(s).device, rank_, ")") : std::string(),
                    " stashed '", unpopped.first, "' for ", call.item_name, " ", i, " of ",
                    call.n_items, call.time_chunks.steps_of(i), ", but no stage popped it (",
                    s == j ? c10::str("stage ", s, " did not, and no stage follows it")
                           : c10::str("neither stage ", s, " itself nor a later stage did"),
                    "; each stash is popped once, by the stashing stage or a later one)");
      } catch (...) {
        throw DescribedFailure{std::current_exception()};
      }
    }
    if (call.chained) {
      call.sink(i, std::move(out));
      if (i + 1 == call.n_items) {
        phase = call.time_chunks.pick("the loss, after item", "the loss, after time chunk",
                                      "the loss, after time step");
        at::Tensor loss = call.chain_loss();
        call.losses[static_cast<size_t>(i)] = loss.detach();
        sv->outputs = {loss};
      }
      sv->nodes = ChunkNodes{first_node, ChunkNodes::now()};
    } else if (call.training) {
      Tensors targets = run.from_caller(j, i, call.target(i));
      if (ckpt) {
        sv->targets = std::move(targets);  // the recompute computes the loss
      } else {
        phase = "loss of micro-batch";
        at::Tensor loss = call.loss(i, out, targets);
        call.losses[static_cast<size_t>(i)] = loss.detach();
        sv->outputs = {loss};
      }
    } else {
      call.sink(i, std::move(out));
    }
    return;
  }
  if (sv && !ckpt) sv->outputs = out;
  if (sv) sv->nodes = ChunkNodes{first_node, ChunkNodes::now()};
  span.reset();
  if (sv) {
    for (auto& t : out) t = t.detach();
  }
  run.transport->send(j, j + 1, Key{Key::Activation, i, {}}, std::move(out));
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

MPIPE_FUNC void Executor::recompute_micro_batch(Run& run, int64_t j, int64_t i,
                                                const char*& phase) {
  CallSpec& call = *run.call;
  const StagePlace& stage = place(j);
  const int64_t first = i - call.time_chunks.chunk(i);
  const int64_t end = first + call.time_chunks.per_micro_batch();
  auto& saved = run.saved[local(j)];
  StateSnapshot& before = saved[static_cast<size_t>(first)].state_before;
  phase = call.time_chunks.pick("recompute of item", "recompute of time chunk",
                                "recompute of time step");
  const RecomputedState state(before, before.empty() ? nullptr : &(*call.stateful)[local(j)]);
  RecomputeGuard recompute;
  for (int64_t q = first; q < end; ++q) {
    Run::Saved& s = saved[static_cast<size_t>(q)];
    TaskSpan span(call.recorder, j, q, TaskKind::Recompute, stage.device, stage.compute);
    RngScope draws(run.rng, j, q);
    SkipScope skips(
        [&](const std::string& name, at::Tensor t) { s.stashed[name] = std::move(t); },
        [&](const std::string& name) { return recompute_pop(s.popped, s.stashed, name); });
    CastGradsGuard casts(run.cast_grads.empty() ? nullptr : run.cast_grads[local(j)].get());
    const uint64_t lo = ChunkNodes::now();
    try {
      s.outputs = (*run.forwards)[local(j)](s.inputs);
    } catch (...) {  // named by the chunk that failed, not the backward's
      throw DescribedFailure{describe_failure(call, phase, j, q)};
    }
    s.nodes = ChunkNodes{lo, ChunkNodes::now()};
    s.checkpointed = false;
  }
  phase = call.time_chunks.pick("backward of item", "backward of time chunk",
                                "backward of time step");
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
  if (sv.checkpointed && call.chained) {
    recompute_micro_batch(run, j, i, phase);  // Note [Checkpointed time steps]
  }
  Tensors roots = sv.outputs;
  std::map<std::string, at::Tensor> stashed = sv.stashed;
  if (sv.checkpointed) {
    phase = "recompute of micro-batch";
    TaskSpan span(call.recorder, j, i, TaskKind::Recompute, stage.device, stage.compute);
    RngScope draws(run.rng, j, i);  // the forward's draws again (Note [Random draws])
    // Run from the module state the forward started from (Note [State snapshots]).
    const RecomputedState state(sv.state_before, sv.state_before.empty()
                                                     ? nullptr
                                                     : &(*call.stateful)[local(j)]);
    RecomputeGuard recompute;
    CastGradsGuard casts(run.cast_grads.empty() ? nullptr : run.cast_grads[local(j)].get());
    SkipScope skips(
        [&](const std::string& name, at::Tensor t) { stashed[name] = std::move(t); },
        [&](const std::string& name) { return recompute_pop(sv.popped, stashed, name); });
    Tensors out = (*run.forwards)[local(j)](sv.inputs);
    if (last) {
      phase = "loss of micro-batch";
      at::Tensor loss = call.loss(i, out, sv.targets);
      call.losses[static_cast<size_t>(i)] = loss.detach();
      roots = {loss};
    } else {
      roots = std::move(out);
    }
  }
  if (sv.checkpointed) phase = split ? "input gradient of micro-batch" : "backward of micro-batch";
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
    // Stage 0's inputs are the caller's tensors (kept only for a recompute):
    // their gradients go on through the caller's graph.
    Tensors leaves = j > 0 ? sv.inputs : Tensors();
    if (j == 0) input_grads.clear();
    for (const auto& p : sv.popped) leaves.push_back(p.second);
    const Tensors got = run.chains[local(j)].backward(r, g, sv.nodes, leaves,
                                                      /*final=*/i == 0, run.stops);
    const size_t n_in = j > 0 ? sv.inputs.size() : 0;
    for (size_t k = 0; k < n_in; ++k) input_grads[k] = got[k];
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
    run.transport->send(j, sv.popped_from.at(p.first), Key{Key::SkipGradient, i, p.first},
                        {p.second});
  }
  span.reset();
  if (j > 0) {
    run.transport->send(j, j - 1, Key{Key::Gradient, i, {}}, std::move(input_grads));
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
