#pragma once

#include "mpipe/detail/config.h"

// The time-step calls, constant_forward, sequence_forward and
// constant_train_step: their public methods, and their kinds' description,
// checks, plan and results (Note [Plan, then run] in session-inl.h).
// constant_train_step's plan is constant_forward's with the loss of the
// summed outputs, backpropagated chunk by chunk (Note [Chained backward] in
// runtime/chunk_chain.h).

#include "mpipe/detail/pipeline/call_checks.h"
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

/// What the time-step calls share: T steps of the inputs, cut into chunks
/// of `time_chunk` steps and micro-batches of `split`.
class TimeStepCall : public CallKind {
 public:
  TimeStepCall(const char* method_, const std::vector<Input>& inputs, bool one_tensor_,
               std::optional<int64_t> time_chunk, std::optional<Split> split)
      : CallKind(method_, inputs), time_chunk_(time_chunk), split_(split) {
    one_tensor = graphable = one_tensor_;
  }

 protected:
  /// The call described over T steps of a batch of `batch` rows (checked).
  CallInfo steps(const PipelineView& p, int64_t T, int64_t batch, bool reduce, bool fresh) const {
    TORCH_CHECK(T > 0, "mpipe::ModelPipeline::", method,
                ": T (the number of time steps) must be positive, got ", T);
    const auto split = split_of(p.options(), method, split_, inputs);
    CallInfo c;
    c.n_items = T;
    c.reduce = reduce;
    c.time_chunk = resolve_time_chunk(p, time_chunk_of(p.options(), method, time_chunk_), T);
    c.batch = batch;
    c.rows = resolve_rows(p, method, split, batch, T, c.time_chunk, fresh);
    return c;
  }

  /// The spec's items: T steps in chunks, of each micro-batch, taken from
  /// the inputs by `source`, the last stage's outputs kept in `outs`.
  static Plan items(const char* method, const CallInfo& info, const PipelineView& p,
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

  std::optional<int64_t> time_chunk_;
  std::optional<Split> split_;
};

// constant_forward and constant_train_step ---------------------------------------

/// The same input at every step; with a loss function, constant_train_step.
class ConstantCall : public TimeStepCall {
 public:
  ConstantCall(const char* method_, const std::vector<Input>& inputs, int64_t T, bool reduce,
               bool one_tensor_, std::optional<int64_t> time_chunk, std::optional<Split> split,
               const LossFunction* loss_fn = nullptr, const at::Tensor& y = {})
      : TimeStepCall(method_, inputs, one_tensor_, time_chunk, split),
        T_(T),
        reduce_(reduce),
        loss_fn_(loss_fn) {
    target = y;
  }

  CallInfo describe(const PipelineView& p) const override {
    check_runnable(p, method, one_tensor ? &inputs[0].tensor : nullptr);
    const bool fresh = loss_fn_ || p.options().reset_state_each_call();
    return steps(p, T_, batch_size(method, inputs, 0), reduce_, fresh);
  }

  void check(const PipelineView& p, const CallInfo& info, RemoteCall* remote) const override {
    if (!loss_fn_) return;
    check_grad_mode(method);
    // Checkpointing by micro-batch, never the last stage (Note [Checkpointed
    // time steps]); micro-batch 0 is checkpointed whenever any is.
    const TimeChunks chunks{info.n_items, info.time_chunk, info.rows, info.batch};
    if (p.training() && checkpointed(p.options().checkpoint(), 0, chunks.micro_batches())) {
      check_checkpointable(p, method, /*except_last=*/true);
    }
    if (!remote || remote->last()) check_loss_fn(method, *loss_fn_);
  }

  Plan plan(const PipelineView& p, const CallInfo& info, const std::vector<Input>& in,
            const at::Tensor& y, RemoteCall* remote) const override {
    const int64_t n_stages = p.n_stages();
    const char* name = method;
    auto outs = std::make_shared<TimeStepOutputs>(info.reduce != 0 || loss_fn_,
                                                  TimeChunks{info.n_items, info.time_chunk, info.rows,
                                                             info.batch});
    Plan plan = items(name, info, p, remote, outs);
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
    if (!loss_fn_) {
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
    if (y.defined()) spec.caller_tensors.push_back(y);
    spec.chain_loss = [outs, name, n_stages, loss_fn = *loss_fn_, y] {  // on the last stage's stream
      return scalar_loss(loss_fn, for_caller(outs->results(name, n_stages - 1, false)), y);
    };
    // Data parallelism: the replicas' gradients averaged (a mean loss).
    auto replicas = std::make_shared<ReplicaGradients>(p.module.parameters(), remote);
    plan.results = [remote, replicas](const CallSpec& done) -> Tensors {
      at::Tensor loss = done.loss_sum;
      if (remote && !remote->last()) loss = at::Tensor();
      if (loss.defined()) record_on_current(loss);  // the executor's join made it the caller's
      replicas->reduce(/*mean=*/true, loss);
      return loss.defined() ? Tensors{loss} : Tensors{};
    };
    return plan;
  }

 private:
  int64_t T_;
  bool reduce_;
  const LossFunction* loss_fn_;  // constant_train_step
};

// sequence_forward ----------------------------------------------------------------

class SequenceCall : public TimeStepCall {
 public:
  using TimeStepCall::TimeStepCall;
  bool reduce = false;

  CallInfo describe(const PipelineView& p) const override {
    check_runnable(p, method, one_tensor ? &inputs[0].tensor : nullptr, /*time_major=*/true);
    const int64_t T = batch_size(method, inputs, 0);
    TORCH_CHECK(T != -1, "mpipe::ModelPipeline::sequence_forward: no input is batched; a "
                "batched input is [T, N, ...]");
    const int64_t batch = batch_size(method, inputs, 1);
    TORCH_CHECK(T > 0, "mpipe::ModelPipeline::sequence_forward: the sequence has no time steps "
                "(T = 0)");
    return steps(p, T, batch, reduce, p.options().reset_state_each_call());
  }

  Plan plan(const PipelineView& p, const CallInfo& info, const std::vector<Input>& in,
            const at::Tensor&, RemoteCall* remote) const override {
    const int64_t n_stages = p.n_stages();
    auto outs = std::make_shared<TimeStepOutputs>(info.reduce != 0,
                                                  TimeChunks{info.n_items, info.time_chunk, info.rows,
                                                             info.batch});
    Plan plan = items(method, info, p, remote, outs);
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
};

}  // namespace detail

// The public methods ---------------------------------------------------------

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_forward(const at::Tensor& x, int64_t T,
                                                          bool reduce,
                                                          std::optional<int64_t> time_chunk,
                                                          std::optional<Split> split) {
  const std::vector<Input> inputs{x};
  detail::ConstantCall call("constant_forward", inputs, T, reduce, true, time_chunk, split);
  call.reset_first = options.reset_state_each_call();
  return detail::one_output("constant_forward", parts_->call(call));
}

MPIPE_FUNC Tensors ModelPipelineImpl::constant_forward(const std::vector<Input>& inputs, int64_t T,
                                                       bool reduce,
                                                       std::optional<int64_t> time_chunk,
                                                       std::optional<Split> split) {
  detail::ConstantCall call("constant_forward", inputs, T, reduce, false, time_chunk, split);
  call.reset_first = options.reset_state_each_call();
  return parts_->call(call);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::sequence_forward(const at::Tensor& x_seq, bool reduce,
                                                          std::optional<int64_t> time_chunk,
                                                          std::optional<Split> split) {
  const std::vector<Input> inputs{x_seq};
  detail::SequenceCall call("sequence_forward", inputs, true, time_chunk, split);
  call.reduce = reduce;
  call.reset_first = options.reset_state_each_call();
  return detail::one_output("sequence_forward", parts_->call(call));
}

MPIPE_FUNC Tensors ModelPipelineImpl::sequence_forward(const std::vector<Input>& inputs,
                                                       bool reduce,
                                                       std::optional<int64_t> time_chunk,
                                                       std::optional<Split> split) {
  detail::SequenceCall call("sequence_forward", inputs, false, time_chunk, split);
  call.reduce = reduce;
  call.reset_first = options.reset_state_each_call();
  return parts_->call(call);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_train_step(const at::Tensor& x, int64_t T,
                                                             const at::Tensor& target,
                                                             const LossFunction& loss_fn,
                                                             std::optional<int64_t> time_chunk,
                                                             std::optional<Split> split) {
  const std::vector<Input> inputs{x};
  detail::ConstantCall call("constant_train_step", inputs, T, false, true, time_chunk, split,
                            &loss_fn, target);
  call.step = call.fresh_state = true;  // x keeps its autograd identity: with gradients, never graphed
  return detail::one_output("constant_train_step", parts_->call(call));
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_train_step(const std::vector<Input>& inputs,
                                                             int64_t T, const at::Tensor& target,
                                                             const LossFunction& loss_fn,
                                                             std::optional<int64_t> time_chunk,
                                                             std::optional<Split> split) {
  detail::ConstantCall call("constant_train_step", inputs, T, false, false, time_chunk, split,
                            &loss_fn, target);
  call.step = call.fresh_state = true;
  return detail::one_output("constant_train_step", parts_->call(call));
}

}  // namespace mpipe
