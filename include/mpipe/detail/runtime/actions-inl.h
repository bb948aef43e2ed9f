#pragma once

// Private: the executor's forward action F(i, s) for every call kind (Note
// [One runtime] in executor.h); B(i, s), its halves I and W and the
// recompute of a checkpointed stage are in backward_actions-inl.h.

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/executor_run.h"

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

/// The stream of item i on stage j: its lane (Note [Lanes] in executor-inl.h).
MPIPE_FUNC c10::optional<c10::Stream> Executor::stream_for(const CallSpec& call, int64_t j,
                                                           int64_t i) const {
  const StagePlace& stage = place(j);
  if (call.lanes <= 1 || !stage.compute || !call.lane_stages[local(j)]) return stage.compute;
  return stage.lanes.at(static_cast<size_t>(i % call.lanes));
}

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
      const bool here = map_.holds(s);  // else on another rank
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
        sv->outputs = {call.loss_scale != 1.0 ? loss * call.loss_scale : loss};
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
  run.hand_off(j, j + 1, Key{Key::Activation, i, {}}, std::move(out));
}

}  // namespace detail
}  // namespace mpipe
