#pragma once

#include "mpipe/detail/config.h"

// The forward-type calls, forward, constant_forward and sequence_forward:
// their kinds and their plans (Note [Plan, then run] in session-inl.h), and
// constant_train_step's plan, which is constant_forward's with a loss.

#include "mpipe/detail/pipeline/pipeline_state.h"
#include "mpipe/detail/pipeline/step_parts-inl.h"

#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/cuda/device_probe.h"
#include "mpipe/detail/runtime/programs.h"
#include "mpipe/detail/runtime/rng.h"
#include "mpipe/detail/runtime/scatter.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/state.h"

#include <algorithm>

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace mpipe {


namespace detail {
/// Results handed to the caller: usable on its current streams.
MPIPE_FUNC Tensors for_caller(Tensors out) {
  for (const auto& t : out) detail::record_on_current(t);
  return out;
}


/// What a time-step call's items are called in messages (the item's
/// micro-batch and steps follow its number: TimeChunks::steps_of).
MPIPE_FUNC const char* item_name(const TimeChunks& chunks) {
  return chunks.pick("item", "time chunk", "time step");
}
}  // namespace detail

// forward ------------------------------------------------------------------

MPIPE_FUNC Tensors ModelPipelineImpl::State::forward(const std::vector<Input>& inputs,
                                                     Split split, bool graphable_call) {
  CallKind kind;
  kind.method = "forward";
  kind.graphable = graphable_call;
  kind.describe = [&] {
    detail::CallInfo c;
    c.batch = detail::split_batch("forward", inputs);
    c.rows = detail::split_rows(split, "forward", c.batch);
    c.n_items = (c.batch - 1) / c.rows + 1;  // not (batch + rows - 1) / rows: rows may be huge
    return c;
  };
  kind.plan = [&](const detail::CallInfo& info, const std::vector<Input>& in, const at::Tensor&,
                  detail::RemoteCall* remote) { return plan_forward(info, in, remote); };
  return run_call(kind, inputs);
}

MPIPE_FUNC ModelPipelineImpl::State::Plan ModelPipelineImpl::State::plan_forward(
    const detail::CallInfo& info, const std::vector<Input>& inputs,
    detail::RemoteCall* remote) {
  const int64_t n_stages = executor.n_total();
  Plan plan;
  detail::CallSpec& spec = plan.spec;
  spec.method = "forward";
  spec.item_name = "micro-batch";
  spec.n_items = info.n_items;
  spec.micro_batched = true;
  spec.programs = schedules::forward_only(spec.n_items, n_stages);
  auto in = std::make_shared<const std::vector<Input>>(inputs);
  spec.source = [in, rows = info.rows, batch = info.batch](int64_t i) {
    return detail::micro_batch(*in, i, rows, batch);
  };
  spec.caller_tensors = detail::tensors_of(inputs);
  spec.remote = remote;
  auto outs = std::make_shared<std::vector<Tensors>>(static_cast<size_t>(spec.n_items));
  spec.sink = [outs](int64_t i, Tensors o) { (*outs)[static_cast<size_t>(i)] = std::move(o); };
  TORCH_CHECK(self.options.lanes() >= 0, "mpipe::ModelPipeline::forward: ModelPipelineOptions::"
              "lanes must be 0 (automatic) or positive, got ", self.options.lanes());
  int64_t lanes = self.options.lanes() > 0 ? self.options.lanes() : (in_graph_run ? 2 : 1);
  // Under autocast a stage's micro-batches share the casts of its weights
  // (Note [Autocast in the pipeline]), made on the stream of the first: other
  // lanes would read them unordered.
  if (detail::AutocastState::current().any()) lanes = 1;
  if (lanes > 1 && !remote) {  // Note [Lanes]: stages that keep no state
    spec.lanes = lanes;
    for (size_t j = 0; j < stateful.size(); ++j) {
      spec.lane_stages.push_back(stateful[j].empty() && stages[j]->buffers().empty());
    }
  }
  plan.results = [outs, remote, n_stages](const detail::CallSpec&) -> Tensors {
    if (remote && !remote->last()) return {};
    return detail::for_caller(
        detail::gather("forward", "micro-batch", n_stages - 1, *outs, false, true));
  };
  return plan;
}

// constant_forward (and constant_train_step's plan) -------------------------

// Note [Time chunks]
// ~~~~~~~~~~~~~~~~~~
// With multi-step stages (ModelPipelineOptions::step_mode(Multi), or a
// time_chunk given to the call) the items that flow through the stages are
// chunks of k consecutive time steps, time-major [k, N, ...], not single
// steps: each stage call runs k steps at once (stateless layers on [k*N, ...]
// through SeqToANN, neurons as one fused multi-step kernel), so a stage makes
// T/k calls instead of T, while chunks still overlap across stages as steps
// do. k = 1 pipelines every step (most overlap, most calls); k >= T is one
// chunk (no overlap over time). The last chunk may be shorter. State carries
// from chunk to chunk as it does from step to step, and the outputs are cut
// back into steps (and summed step by step when reducing), so results do not
// depend on k, except where a layer's result depends on how many rows it
// sees at once: batch statistics (SpikingConvBlock normalises step by step
// in training for this reason), a BLAS that rounds a product over k*N rows
// differently from one over N rows (MKL, cuBLAS: the last bit), and the
// summation order of weight gradients. With ModelPipelineOptions::time_chunk
// 0 the pipeline picks k (resolve_chunk): T on one device, where one chunk
// measured fastest (bench/RESULTS.md, runs H and I).

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

MPIPE_FUNC int64_t ModelPipelineImpl::State::resolve_chunk(int64_t chunk, int64_t T) const {
  if (chunk != detail::kAutoChunk) return chunk;
  // Measured on one GPU: one chunk of all T steps is fastest, since stages
  // that share a device gain nothing from overlapping. Across devices, about
  // four chunks per device keep each busy (the fill-drain bubble is D - 1 of
  // n + D - 1 items).
  const int64_t n_devices = pipeline_devices();
  if (n_devices <= 1) return T;
  return std::max<int64_t>(1, (T + 4 * n_devices - 1) / (4 * n_devices));
}

MPIPE_FUNC int64_t ModelPipelineImpl::State::pipeline_devices() const {
  if (distributed()) return static_cast<int64_t>(layout.first.size());
  std::vector<c10::Device> seen;
  for (const auto& d : devices) {
    if (std::find(seen.begin(), seen.end(), d) == seen.end()) seen.push_back(d);
  }
  return static_cast<int64_t>(seen.size());
}

MPIPE_FUNC int64_t ModelPipelineImpl::State::resolve_rows(const char* method,
                                                         const std::optional<Split>& split,
                                                         int64_t batch, int64_t T, int64_t chunk,
                                                         bool fresh) const {
  if (!split) {
    // The pipeline's choice (Note [Micro-batches over time]): the whole batch,
    // unless multi-step chunks give fewer than 2 items per device; then
    // about 4 items per device. Only for calls that start from reset state:
    // state carried from call to call must find the same split.
    const int64_t n_devices = pipeline_devices();
    if (!fresh || chunk <= 0 || batch <= 1 || n_devices <= 1) return 0;
    const int64_t n_chunks = (T + chunk - 1) / chunk;
    if (n_chunks >= 2 * n_devices) return 0;
    const int64_t m = std::min(batch, (4 * n_devices + n_chunks - 1) / n_chunks);
    return detail::split_rows(Split::chunks(m), method, batch);
  }
  TORCH_CHECK(batch > 0 || split->value() == 1, "mpipe::ModelPipeline::", method,
              ": a micro-batch split (", detail::split_name(*split), " ", split->value(),
              ") needs a batched input with rows to split; no input is batched");
  if (batch <= 0) return 0;
  return detail::split_rows(*split, method, batch);
}

MPIPE_FUNC detail::CallInfo ModelPipelineImpl::State::constant_call_info(
    const char* method, const std::vector<Input>& inputs, int64_t T, int64_t chunk,
    const std::optional<Split>& split, bool fresh) const {
  const int64_t batch = detail::batch_size(method, inputs, 0);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::", method,
              ": T (the number of time steps) must be positive, got ", T);
  detail::CallInfo c;
  c.n_items = T;
  c.chunk = resolve_chunk(chunk, T);
  c.batch = batch;
  c.rows = resolve_rows(method, split, batch, T, c.chunk, fresh);
  return c;
}

MPIPE_FUNC Tensors ModelPipelineImpl::State::constant_forward(const std::vector<Input>& inputs,
                                                              int64_t T, bool reduce, int64_t chunk,
                                                              const std::optional<Split>& split,
                                                              bool graphable_call) {
  CallKind kind;
  kind.method = "constant_forward";
  kind.graphable = graphable_call;
  kind.reset_first = self.options.reset_state_each_call();
  kind.describe = [&] {
    detail::CallInfo c = constant_call_info("constant_forward", inputs, T, chunk, split,
                                            self.options.reset_state_each_call());
    c.reduce = reduce;
    return c;
  };
  kind.plan = [&](const detail::CallInfo& info, const std::vector<Input>& in, const at::Tensor&,
                  detail::RemoteCall* remote) {
    return plan_constant("constant_forward", info, in, remote);
  };
  return run_call(kind, inputs);
}

MPIPE_FUNC ModelPipelineImpl::State::Plan ModelPipelineImpl::State::plan_constant(
    const char* method, const detail::CallInfo& info, const std::vector<Input>& inputs,
    detail::RemoteCall* remote, const LossFunction& loss_fn, const at::Tensor& target) {
  const int64_t n_stages = executor.n_total();
  // Note [Time chunks], Note [Micro-batches over time]
  const detail::TimeChunks chunks{info.n_items, info.chunk, info.rows, info.batch};
  Plan plan;
  detail::CallSpec& spec = plan.spec;
  spec.method = method;
  spec.item_name = detail::item_name(chunks);
  spec.n_items = chunks.count();
  spec.time_chunks = chunks;
  spec.remote = remote;
  spec.programs = loss_fn ? detail::chained(spec.n_items, n_stages)
                          : schedules::forward_only(spec.n_items, n_stages);
  auto in = std::make_shared<const std::vector<Input>>(inputs);
  const Tensors tensors = detail::tensors_of(inputs);
  if (chunks.split()) {
    spec.source = [in, chunks](int64_t i) {
      return chunks.multi() ? detail::repeated_chunk(*in, chunks, i)
                            : detail::constant_step(*in, chunks, i);
    };
  } else if (chunks.multi()) {
    // Every chunk is the same view unless the last is shorter.
    spec.same_input = info.n_items % info.chunk == 0 || spec.n_items == 1;
    spec.source = [in, chunks](int64_t i) { return detail::repeated_chunk(*in, chunks, i); };
  } else {
    spec.same_input = true;
    spec.source = [tensors](int64_t) { return tensors; };
  }
  spec.caller_tensors = tensors;
  auto outs = std::make_shared<detail::TimeStepOutputs>(info.reduce != 0 || loss_fn, chunks);
  spec.sink = [outs](int64_t i, Tensors o) { outs->add_item(i, std::move(o)); };
  if (!loss_fn) {
    plan.results = [outs, remote, method, n_stages](const detail::CallSpec&) -> Tensors {
      if (remote && !remote->last()) return {};
      return detail::for_caller(outs->results(method, n_stages - 1, /*stack=*/false));
    };
    return plan;
  }
  // constant_train_step: the loss of the summed outputs, then backward chunk
  // by chunk (Note [Chained backward]).
  spec.training = spec.chained = true;
  // By micro-batch (Note [Checkpointed time steps] in runtime/backward_actions-inl.h).
  spec.checkpoint = self.is_training() ? self.options.checkpoint() : Checkpoint::Never;
  spec.stateful = &stateful;
  if (target.defined()) spec.caller_tensors.push_back(target);
  spec.chain_loss = [outs, method, n_stages, loss_fn, target] {  // on the last stage's stream
    return detail::scalar_loss(loss_fn,
                               detail::for_caller(outs->results(method, n_stages - 1, false)),
                               target);
  };
  plan.results = [remote](const detail::CallSpec& done) -> Tensors {
    if (remote && !remote->last()) return {};
    detail::record_on_current(done.losses.back());  // the caller's streams waited for the stages
    return {done.losses.back()};
  };
  return plan;
}

// sequence_forward ----------------------------------------------------------

namespace detail {
/// sequence_forward's T, from its inputs (checked).
MPIPE_FUNC int64_t sequence_length(const std::vector<Input>& inputs) {
  const int64_t T = detail::batch_size("sequence_forward", inputs, 0);
  TORCH_CHECK(T != -1, "mpipe::ModelPipeline::sequence_forward: no input is batched; a "
              "batched input is [T, N, ...]");
  detail::batch_size("sequence_forward", inputs, 1);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::sequence_forward: the sequence has no time steps "
              "(T = 0)");
  return T;
}
}  // namespace detail

MPIPE_FUNC Tensors ModelPipelineImpl::State::sequence_forward(const std::vector<Input>& inputs,
                                                              bool reduce, int64_t chunk,
                                                              const std::optional<Split>& split,
                                                              bool graphable_call) {
  CallKind kind;
  kind.method = "sequence_forward";
  kind.graphable = graphable_call;
  kind.reset_first = self.options.reset_state_each_call();
  kind.describe = [&] {
    detail::CallInfo c;
    c.n_items = detail::sequence_length(inputs);
    c.reduce = reduce;
    c.chunk = resolve_chunk(chunk, c.n_items);
    c.batch = detail::batch_size("sequence_forward", inputs, 1);
    c.rows = resolve_rows("sequence_forward", split, c.batch, c.n_items, c.chunk,
                          self.options.reset_state_each_call());
    return c;
  };
  kind.plan = [&](const detail::CallInfo& info, const std::vector<Input>& in, const at::Tensor&,
                  detail::RemoteCall* remote) { return plan_sequence(info, in, remote); };
  return run_call(kind, inputs);
}

MPIPE_FUNC ModelPipelineImpl::State::Plan ModelPipelineImpl::State::plan_sequence(
    const detail::CallInfo& info, const std::vector<Input>& inputs,
    detail::RemoteCall* remote) {
  const int64_t n_stages = executor.n_total();
  // Note [Time chunks], Note [Micro-batches over time]
  const detail::TimeChunks chunks{info.n_items, info.chunk, info.rows, info.batch};
  Plan plan;
  detail::CallSpec& spec = plan.spec;
  spec.method = "sequence_forward";
  spec.item_name = detail::item_name(chunks);
  spec.n_items = chunks.count();
  spec.time_chunks = chunks;
  spec.remote = remote;
  spec.programs = schedules::forward_only(spec.n_items, n_stages);
  auto in = std::make_shared<const std::vector<Input>>(inputs);
  spec.source = [in, chunks](int64_t i) {
    return chunks.multi() ? detail::sequence_chunk(*in, chunks, i)
                          : detail::time_step(*in, chunks, i);
  };
  spec.caller_tensors = detail::tensors_of(inputs);
  auto outs = std::make_shared<detail::TimeStepOutputs>(info.reduce != 0, chunks);
  spec.sink = [outs](int64_t i, Tensors o) { outs->add_item(i, std::move(o)); };
  plan.results = [outs, remote, n_stages](const detail::CallSpec&) -> Tensors {
    if (remote && !remote->last()) return {};
    return detail::for_caller(outs->results("sequence_forward", n_stages - 1, /*stack=*/true));
  };
  return plan;
}

}  // namespace mpipe
