#pragma once

#include "mpipe/detail/config.h"

// The time-step calls, constant_forward, sequence_forward and
// constant_train_step: their public methods, and each call's description,
// checks, plan and results (Note [Plan, then run] in session-inl.h).
// constant_train_step's plan is constant_forward's with the loss of the
// summed outputs, backpropagated chunk by chunk (Note [Chained backward] in
// runtime/time_chunks.h).

#include "mpipe/detail/pipeline/session.h"

#include "mpipe/detail/distributed/replicas.h"
#include "mpipe/detail/runtime/programs.h"
#include "mpipe/detail/runtime/recompute.h"
#include "mpipe/detail/runtime/items.h"
#include "mpipe/detail/runtime/time_chunks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <memory>

namespace mpipe {
namespace detail {

// Note [Micro-batches over time]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Time chunks alone leave devices idle when there are few of them: with one
// chunk of all T steps there is one item and D - 1 devices wait, and small
// chunks pay the per-call cost more often. So the time-step calls also take
// a micro-batch split (`split`, ModelPipelineOptions::time_micro_batches):
// the batch is cut as forward cuts it (dim 0; dim 1 of a sequence), and the
// items are (micro-batch m, chunk c) pairs, numbered micro-batch after
// micro-batch, i = m * C + c (TimeChunks). Each stage call runs under
// MicroBatchGuard{m, M}, so every micro-batch has its own neuron state (Note
// [Per-micro-batch state]); the last stage's outputs are kept per
// micro-batch (summed step by step, or per step) and joined along the batch
// dimension at the end. constant_train_step takes the loss once, of the
// joined sums, and its chained backward (Note [Chained backward]) runs
// unchanged: B(i) runs item i's nodes, and a gradient bound for another
// micro-batch's nodes is carried from item to item until it reaches them.
// Why this order and not chunk after chunk (i = c * M + m): a stage runs its
// items one after another whichever order they come in, so both fill the
// pipeline alike (n = M * C items, D - 1 of n + D - 1 slots idle), but
// this one makes each stage's operations, and so the order in which weight
// gradients are summed, those of the plain loop "for each micro-batch, for
// each step", which the results therefore equal bit for bit
// (tests/test_time_micro_batches.cpp).
//
// The automatic split (time_micro_batches 0, resolve_rows) cuts the batch
// only for multi-step stages over D > 1 devices whose chunks make fewer than
// 2 items per device, and only in calls that start from reset state
// (constant_train_step, reset_state_each_call): state carried on to the next
// call needs that call's split to be the same, and T may change it. Then
// into about 4 items per device. Measured on 2 CPU
// ranks (bench/RESULTS.md, SNN training step, T = 8): the speed-up follows
// the item count whichever axis makes it (1 x 8 steps, 2 x 4, 4 x 2, 8 x 1
// items all reach 1.58-1.66x of an ideal 2x; 2 items 1.23-1.33x), and more
// than 4 items per device add 2-5 %. Splitting changes what layers that
// depend on the batch rows compute, and single-step calls keep the plain
// per-step loop's results bit for bit, so the whole batch stays the default
// wherever chunks alone fill the pipeline.

/// Steps per stage call: `chunk` as given (0: single steps), or for
/// kAutoChunk the pipeline's choice (Note [Time chunks]).
MPIPE_FUNC int64_t resolve_time_chunk(const PipelineView& p, int64_t chunk, int64_t T) {
  if (chunk != kAutoChunk) return chunk;
  // Measured on one GPU: one chunk of all T steps is fastest, since stages
  // that share a device gain nothing from overlapping. Across devices, about
  // four chunks per device keep each busy (the fill-drain bubble is D - 1 of
  // n + D - 1 items).
  const int64_t n_devices = p.devices();
  if (n_devices <= 1) return T;
  return std::max<int64_t>(1, (T + 4 * n_devices - 1) / (4 * n_devices));
}

/// Rows per micro-batch of a time-step call over a batch of `batch` rows
/// (0: one micro-batch); `split` empty: the pipeline's choice (Note
/// [Micro-batches over time]), which cuts only calls that start from reset
/// state (`fresh`).
MPIPE_FUNC int64_t resolve_rows(const PipelineView& p, const char* method,
                                const std::optional<Split>& split, int64_t batch, int64_t T,
                                int64_t chunk, bool fresh) {
  if (!split) {
    // The pipeline's choice: the whole batch, unless multi-step chunks give
    // fewer than 2 items per device; then about 4 items per device. Only for
    // calls that start from reset state: state carried from call to call
    // must find the same split.
    const int64_t n_devices = p.devices();
    if (!fresh || chunk <= 0 || batch <= 1 || n_devices <= 1) return 0;
    const int64_t n_chunks = (T + chunk - 1) / chunk;
    if (n_chunks >= 2 * n_devices) return 0;
    const int64_t m = std::min(batch, (4 * n_devices + n_chunks - 1) / n_chunks);
    return split_rows(Split::chunks(m), method, batch);
  }
  TORCH_CHECK(batch > 0 || split->value() == 1, "mpipe::ModelPipeline::", method,
              ": a micro-batch split (", split_name(*split), " ", split->value(),
              ") needs a batched input with rows to split; no input is batched");
  if (batch <= 0) return 0;
  return split_rows(*split, method, batch);
}

/// What a time-step call's items are called in messages (the item's
/// micro-batch and steps follow its number: TimeChunks::steps_of).
MPIPE_FUNC const char* item_name(const TimeChunks& chunks) {
  return chunks.pick("item", "time chunk", "time step");
}

/// What every time-step call is given besides its own arguments.
struct TimeStepArgs {
  const char* method;
  const std::vector<Input>& inputs;
  bool one_tensor;  // through the Tensor overload
  std::optional<int64_t> time_chunk;
  std::optional<Split> split;
};

/// A time-step call described over T steps of a batch of `batch` rows
/// (checked); `fresh`: it starts from reset state.
MPIPE_FUNC CallInfo time_steps(const PipelineView& p, const TimeStepArgs& a, int64_t T,
                               int64_t batch, bool reduce, bool fresh) {
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::", a.method,
              ": T (the number of time steps) must be positive, got ", T);
  const auto split = split_of(p.options(), a.method, a.split, a.inputs);
  CallInfo c;
  c.n_items = T;
  c.reduce = reduce;
  c.time_chunk = resolve_time_chunk(p, time_chunk_of(p.options(), a.method, a.time_chunk), T);
  c.batch = batch;
  c.rows = resolve_rows(p, a.method, split, batch, T, c.time_chunk, fresh);
  return c;
}

/// A time-step call's spec: T steps in chunks, of each micro-batch, forward
/// programs, the last stage's outputs kept in `outs`.
MPIPE_FUNC Plan time_step_items(const char* method, const CallInfo& info, const PipelineView& p,
                                RemoteCall* remote, const std::shared_ptr<TimeStepOutputs>& outs) {
  Plan plan;
  CallSpec& spec = plan.spec;
  const TimeChunks chunks{info.n_items, info.time_chunk, info.rows, info.batch};
  spec.method = method;
  spec.item_name = item_name(chunks);
  spec.n_items = chunks.count();
  spec.time_chunks = chunks;
  spec.remote = remote;
  spec.programs = schedules::forward_only(spec.n_items, p.n_stages());
  spec.sink = [outs](int64_t i, Tensors o) { outs->add_item(i, std::move(o)); };
  return plan;
}

/// Runs a time-step call on every rank: `describe(p)` where this rank
/// describes it, `check(p, info, remote)`, the modules' state reset first
/// (`reset_first`) and after (`reset_after`), then `plan(p, info, inputs,
/// target, remote)` executed, or a CUDA graph's replay of it (`step`: a
/// training step's loss function, null for a no-grad call).
template <typename Describe, typename Check, typename MakePlan>
Tensors run_time_steps(PipelineParts& parts, const TimeStepArgs& a, const at::Tensor& target,
                       bool reset_first, bool reset_after, const LossFunction* step,
                       Describe describe,
                       Check check, MakePlan plan) {
  Call call(parts, a.method);
  try {
    const PipelineView& p = call.view();
    std::optional<CallInfo> mine;
    if (call.describes()) mine = describe(p);
    const CallInfo info = call.agree(mine);
    check(p, info, call.remote());
    if (reset_first || reset_after) call.reset_states_now(reset_after);
    auto eager = [&](const std::vector<Input>& in, const at::Tensor& y, bool threaded,
                     RemoteCall* remote) {
      Plan made = plan(p, info, in, y, remote);
      call.execute(made.spec, threaded);
      return made.results(made.spec);
    };
    at::Tensor replayed;
    if (a.one_tensor) {
      replayed = call.replay(a.inputs[0].tensor, target, info, step,
                             [&](const at::Tensor& x, const at::Tensor& y, bool threaded) {
                               return one_output(a.method, eager({Input(x)}, y, threaded, nullptr));
                             });
    }
    const std::vector<Input> none;
    Tensors out = replayed.defined()
                      ? Tensors{replayed}
                      : eager(call.first() ? a.inputs : none, call.last() ? target : at::Tensor(),
                              p.options().worker_threads(), call.remote());
    call.finish();
    return out;
  } catch (...) {
    call.fail();
  }
}

// constant_forward and constant_train_step ---------------------------------------

/// constant_forward's plan (the same input at every step) or, with
/// `loss_fn`, constant_train_step's.
MPIPE_FUNC Plan constant_plan(const PipelineView& p, const CallInfo& info,
                              const std::vector<Input>& in, const at::Tensor& y,
                              const LossFunction* loss_fn, RemoteCall* remote) {
  const int64_t n_stages = p.n_stages();
  const char* name = loss_fn ? "constant_train_step" : "constant_forward";
  auto outs = std::make_shared<TimeStepOutputs>(info.reduce != 0 || loss_fn,
                                                TimeChunks{info.n_items, info.time_chunk, info.rows,
                                                           info.batch});
  Plan plan = time_step_items(name, info, p, remote, outs);
  CallSpec& spec = plan.spec;
  const TimeChunks chunks = spec.time_chunks;
  auto kept = std::make_shared<const std::vector<Input>>(in);
  const Tensors tensors = tensors_of(in);
  if (chunks.split()) {
    spec.source = [kept, chunks](int64_t i) {
      return chunks.multi() ? repeated_chunk(*kept, chunks, i) : constant_step(*kept, chunks, i);
    };
  } else if (chunks.multi()) {
    // Every chunk is the same view unless the last is shorter.
    spec.same_input = info.n_items % info.time_chunk == 0 || spec.n_items == 1;
    spec.source = [kept, chunks](int64_t i) { return repeated_chunk(*kept, chunks, i); };
  } else {
    spec.same_input = true;
    spec.source = [tensors](int64_t) { return tensors; };
  }
  spec.caller_tensors = tensors;
  if (!loss_fn) {
    plan.results = [outs, remote, name, n_stages](const CallSpec&) -> Tensors {
      if (remote && !remote->last()) return {};
      return for_caller(outs->results(name, n_stages - 1, /*stack=*/false));
    };
    return plan;
  }
  // constant_train_step: the loss of the summed outputs, then backward chunk
  // by chunk (Note [Chained backward]).
  spec.programs = chained(spec.n_items, n_stages);
  spec.training = spec.chained = true;
  // By micro-batch (Note [Checkpointed time steps] in runtime/backward_actions-inl.h).
  spec.checkpoint = p.training() ? p.options().checkpoint() : Checkpoint::Never;
  spec.stateful = &p.stages.stateful;
  for (const auto& t : tensors) spec.input_requires_grad.push_back(t.defined() && t.requires_grad());
  if (y.defined()) spec.caller_tensors.push_back(y);
  spec.chain_loss = [outs, name, n_stages, loss_fn = *loss_fn, y] {  // on the last stage's stream
    return scalar_loss(loss_fn, for_caller(outs->results(name, n_stages - 1, false)), y);
  };
  // Data parallelism: the replicas' gradients averaged (a mean loss).
  std::shared_ptr<ReplicaGradients> replicas;
  if (remote && remote->group().replicas() > 1) {
    replicas = std::make_shared<ReplicaGradients>(p.module.parameters(), *remote);
  }
  plan.results = [remote, replicas, tensors](const CallSpec& done) -> Tensors {
    at::Tensor loss = done.loss_sum;
    if (remote && !remote->last()) loss = at::Tensor();
    if (loss.defined()) record_on_current(loss);  // the executor's join made it the caller's
    // The last backward (item 0's) caught the inputs' gradients whole.
    if (!tensors.empty()) backward_through_caller(tensors, done.input_grads[0]);
    if (replicas) replicas->reduce(/*mean=*/true, loss);
    return loss.defined() ? Tensors{loss} : Tensors{};
  };
  return plan;
}

/// constant_forward, or with `loss_fn` constant_train_step.
MPIPE_FUNC Tensors constant_call(PipelineParts& parts, const TimeStepArgs& a, int64_t T,
                                 bool reduce, const LossFunction* loss_fn = nullptr,
                                 const at::Tensor& target = {}) {
  const bool reset = parts.self.options.reset_state_each_call();
  return run_time_steps(
      parts, a, target, /*reset_first=*/reset, /*reset_after=*/loss_fn != nullptr,
      /*step=*/loss_fn,
      [&](const PipelineView& p) {
        check_runnable(p, a.method, a.one_tensor ? &a.inputs[0].tensor : nullptr);
        return time_steps(p, a, T, batch_size(a.method, a.inputs, 0), reduce, loss_fn || reset);
      },
      [&](const PipelineView& p, const CallInfo& info, RemoteCall* remote) {
        if (!loss_fn) return;
        check_grad_mode(a.method);
        // Checkpointing by micro-batch, never the last stage (Note
        // [Checkpointed time steps]); micro-batch 0 is checkpointed whenever
        // any is.
        const TimeChunks chunks{info.n_items, info.time_chunk, info.rows, info.batch};
        if (p.training() && checkpointed(p.options().checkpoint(), 0, chunks.micro_batches())) {
          check_checkpointable(p, a.method, /*except_last=*/true);
        }
        if (!remote || remote->last()) check_loss_fn(a.method, *loss_fn);
      },
      [&](const PipelineView& p, const CallInfo& info, const std::vector<Input>& in,
          const at::Tensor& y, RemoteCall* remote) {
        return constant_plan(p, info, in, y, loss_fn, remote);
      });
}

// sequence_forward ----------------------------------------------------------------

MPIPE_FUNC Plan sequence_plan(const PipelineView& p, const CallInfo& info,
                              const std::vector<Input>& in, RemoteCall* remote) {
  const int64_t n_stages = p.n_stages();
  auto outs = std::make_shared<TimeStepOutputs>(info.reduce != 0,
                                                TimeChunks{info.n_items, info.time_chunk, info.rows,
                                                           info.batch});
  Plan plan = time_step_items("sequence_forward", info, p, remote, outs);
  CallSpec& spec = plan.spec;
  auto kept = std::make_shared<const std::vector<Input>>(in);
  spec.source = [kept, chunks = spec.time_chunks](int64_t i) {
    return chunks.multi() ? sequence_chunk(*kept, chunks, i) : time_step(*kept, chunks, i);
  };
  spec.caller_tensors = tensors_of(in);
  plan.results = [outs, remote, n_stages](const CallSpec&) -> Tensors {
    if (remote && !remote->last()) return {};
    return for_caller(outs->results("sequence_forward", n_stages - 1, /*stack=*/true));
  };
  return plan;
}

MPIPE_FUNC Tensors sequence_call(PipelineParts& parts, const TimeStepArgs& a, bool reduce) {
  const bool reset = parts.self.options.reset_state_each_call();
  return run_time_steps(
      parts, a, at::Tensor(), reset, false, /*step=*/nullptr,
      [&](const PipelineView& p) {
        check_runnable(p, a.method, a.one_tensor ? &a.inputs[0].tensor : nullptr,
                       /*time_major=*/true);
        const int64_t T = batch_size(a.method, a.inputs, 0);
        TORCH_CHECK(T != -1, "mpipe::ModelPipeline::sequence_forward: no input is batched; a "
                    "batched input is [T, N, ...]");
        const int64_t batch = batch_size(a.method, a.inputs, 1);
        TORCH_CHECK(T > 0, "mpipe::ModelPipeline::sequence_forward: the sequence has no time "
                    "steps (T = 0)");
        return time_steps(p, a, T, batch, reduce, reset);
      },
      [](const PipelineView&, const CallInfo&, RemoteCall*) {},
      [&](const PipelineView& p, const CallInfo& info, const std::vector<Input>& in,
          const at::Tensor&, RemoteCall* remote) { return sequence_plan(p, info, in, remote); });
}

}  // namespace detail

// The public methods ---------------------------------------------------------

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_forward(const at::Tensor& x, int64_t T,
                                                          bool reduce,
                                                          std::optional<int64_t> time_chunk,
                                                          std::optional<Split> split) {
  const std::vector<Input> inputs{x};
  return detail::one_output("constant_forward",
                            detail::constant_call(*parts_, {"constant_forward", inputs, true,
                                                            time_chunk, split},
                                                  T, reduce));
}

MPIPE_FUNC Tensors ModelPipelineImpl::constant_forward(const std::vector<Input>& inputs, int64_t T,
                                                       bool reduce,
                                                       std::optional<int64_t> time_chunk,
                                                       std::optional<Split> split) {
  return detail::constant_call(*parts_, {"constant_forward", inputs, false, time_chunk, split}, T,
                               reduce);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::sequence_forward(const at::Tensor& x_seq, bool reduce,
                                                          std::optional<int64_t> time_chunk,
                                                          std::optional<Split> split) {
  const std::vector<Input> inputs{x_seq};
  return detail::one_output("sequence_forward",
                            detail::sequence_call(*parts_, {"sequence_forward", inputs, true,
                                                            time_chunk, split},
                                                  reduce));
}

MPIPE_FUNC Tensors ModelPipelineImpl::sequence_forward(const std::vector<Input>& inputs,
                                                       bool reduce,
                                                       std::optional<int64_t> time_chunk,
                                                       std::optional<Split> split) {
  return detail::sequence_call(*parts_, {"sequence_forward", inputs, false, time_chunk, split},
                               reduce);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_train_step(const at::Tensor& x, int64_t T,
                                                             const at::Tensor& target,
                                                             const LossFunction& loss_fn,
                                                             std::optional<int64_t> time_chunk,
                                                             std::optional<Split> split) {
  // x keeps its autograd identity: with gradients, never graphed.
  const std::vector<Input> inputs{x};
  return detail::one_output(
      "constant_train_step",
      detail::constant_call(*parts_, {"constant_train_step", inputs, true, time_chunk, split}, T,
                            false, &loss_fn, target));
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_train_step(const std::vector<Input>& inputs,
                                                             int64_t T, const at::Tensor& target,
                                                             const LossFunction& loss_fn,
                                                             std::optional<int64_t> time_chunk,
                                                             std::optional<Split> split) {
  return detail::one_output(
      "constant_train_step",
      detail::constant_call(*parts_, {"constant_train_step", inputs, false, time_chunk, split}, T,
                            false, &loss_fn, target));
}

}  // namespace mpipe
