#pragma once

#include "mpipe/detail/config.h"

// The session: what every call of a pipeline goes through, as the scope of
// one call (Call): its life (lock, memory watch, rollback), the agreement
// across processes, and its plans through the executor with the timeline
// recorded.

#include "mpipe/detail/pipeline/session.h"

#include "mpipe/detail/runtime/programs.h"
#include "mpipe/detail/runtime/errors.h"

#include "mpipe/simulate.h"
#include "mpipe/state.h"

#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>

namespace mpipe {

// Note [Plan, then run]
// ~~~~~~~~~~~~~~~~~~~~~~
// A call's own file drives it from start to end, in one pass: the public
// method opens a Call (the call lock, the memory watch, the rollback of
// stateful modules on failure; across processes, the call on every rank),
// describes the call from its arguments (a CallInfo; across processes the
// first rank describes it and every rank agrees on that description), checks
// it, builds its plan (the executor's CallSpec: the items, the programs,
// where inputs come from and outputs go, and how to hand results back),
// executes it and finishes the call. Its describe, check and plan steps read
// the pipeline through a PipelineView and change nothing. The calls live
// with the data they move: pipeline/micro_batch_calls-inl.h (forward,
// train_step) and pipeline/time_step_calls-inl.h (constant_forward,
// sequence_forward, constant_train_step). Which calls a CUDA graph replays is
// the graph policy's (cuda/graph_policy-inl.h), which runs the call's eager
// form when it captures.

namespace detail {

MPIPE_FUNC PipelineParts::PipelineParts(ModelPipelineImpl& owner)
    : self(owner), stages(owner.register_module("stages", torch::nn::ModuleList())) {}

/// The key of a graphed call: what its capture depends on.
MPIPE_FUNC GraphKey key_of(const char* method, const CallInfo& info, const at::Tensor& x,
                              const at::Tensor& target, bool training) {
  GraphKey key;
  key.method = method;
  key.items = info.n_items;
  key.rows = info.rows;
  key.reduce = info.reduce != 0;
  key.time_chunk = info.time_chunk;
  key.schedule = static_cast<int>(info.schedule);
  key.reduction = static_cast<int>(info.reduction);
  key.input_sizes = x.sizes().vec();
  key.input_dtype = x.scalar_type();
  if (target.defined()) {
    key.target_sizes = target.sizes().vec();
    key.target_dtype = target.scalar_type();
  }
  key.training = training;
  key.inference = c10::InferenceMode::is_enabled();
  return key;
}

/// The memory watch's start: `method` when options.track_memory, else null.
MPIPE_FUNC const char* begin_watch(PipelineParts& parts, const char* method) {
  if (!parts.self.options.track_memory()) return nullptr;
  parts.life.begin_watch(parts.stages);
  return method;
}

MPIPE_FUNC Call::Call(PipelineParts& parts, const char* method)
    : parts_(parts),
      method_(method),
      lock_(parts.life.mutex()),
      watch_{parts, begin_watch(parts, method)},
      rollback_(parts.stages.stateful),  // Note [State snapshots]
      view_(parts.view()) {
  start_with_fresh_casts();  // Note [Autocast in the pipeline]
  if (view_.distributed()) {
    remote_ = parts.group.open(method, parts.self.options.process_group(), parts.stages.devices,
                               parts.executor, late_);
  }
}

MPIPE_FUNC Call::~Call() {
  remote_.reset();
  // State does not outlive a constant_train_step, whatever happens; the
  // rollback, which runs after, puts a failed call's state back as it was.
  if (reset_after_) reset_states(parts_.self);
}

MPIPE_FUNC bool Call::describes() const {
  TORCH_CHECK(late_.empty(), late_);
  return first();
}

MPIPE_FUNC at::Tensor Call::replay(const at::Tensor& x, const at::Tensor& y, const CallInfo& info,
                                   bool step, const GraphPolicy::EagerStep& eager) {
  if (remote_) return {};
  const GraphKey key = key_of(method_, info, x, y, parts_.self.is_training());
  if (step) return parts_.graphs.step(parts_.self, parts_.stages, key, x, y, eager);
  return parts_.graphs.call(parts_.self, parts_.stages, key, x,
                            [&](const at::Tensor& xg, bool threaded) {
                              return eager(xg, at::Tensor(), threaded);
                            });
}

MPIPE_FUNC CallInfo Call::agree(const std::optional<CallInfo>& mine) {
  if (!describes()) return remote_->await_call(method_);
  CallInfo info = *mine;
  if (remote_) {
    info.method = method_code(method_);
    remote_->announce(info);
  }
  return info;
}

MPIPE_FUNC void Call::reset_states_now(bool after) {
  reset_states(parts_.self);
  reset_after_ = after;
}

MPIPE_FUNC void Call::execute(CallSpec& spec, bool threaded) {
  RECORD_USER_SCOPE("mpipe::execute");
  std::shared_ptr<Recorder> recorder;
  if (parts_.self.options.record_timeline() && !spec.remote) {  // one process's stages only (docs/distributed.md)
    // The schedule's idle fraction with unit costs, training or not (forward
    // programs give the fill-drain (n - 1) / (m + n - 1)).
    recorder = std::make_shared<Recorder>(spec.method, spec.item_name, spec.n_items,
                                          parts_.stages.devices, schedules::bubble(spec.programs));
    if (spec.training) recorder->describe_schedule(spec.schedule, stage_ranks(spec.programs));
  }
  spec.recorder = recorder.get();
  parts_.executor.run(spec, parts_.stages.forwards, threaded);
  if (recorder) parts_.timeline.pending = recorder;
}

MPIPE_FUNC void Call::finish() {
  finished_ = true;
  if (remote_) remote_->finish("", method_);  // throws another rank's failure
}

MPIPE_FUNC void Call::fail() {
  const std::exception_ptr error = std::current_exception();
  if (!remote_ || finished_) std::rethrow_exception(error);
  finished_ = true;
  const std::string what = message_of(error);
  const std::string others = remote_->finish(what, method_);
  if (others.empty()) std::rethrow_exception(error);
  // What the other ranks reported may name the root cause (the rank that
  // stalled behind the one this rank waited for).
  TORCH_CHECK(false, what, "; other ranks: ", others);
}

MPIPE_FUNC void CallLife::begin_watch(const Stages& stages) {
  counters_.clear();
  for (const auto& d : stages.devices) {
    bool seen = false;
    for (const auto& c : counters_) seen |= c.device == d;
    if (!d.is_cuda() || seen) continue;
    reset_allocator_peak(d);
    counters_.push_back({d, allocator_counters(d).allocated, -1});
  }
}

MPIPE_FUNC void CallLife::end_watch(const char* method) {
  for (auto& c : counters_) c.peak = allocator_counters(c.device).peak;
  watched_call_ = method;
}

}  // namespace detail

}  // namespace mpipe
