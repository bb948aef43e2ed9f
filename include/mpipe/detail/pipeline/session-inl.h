#pragma once

#include "mpipe/detail/config.h"

// The session: what every call of a pipeline goes through around the
// executor. The call's life (lock, memory watch, rollback), the agreement
// across processes, a CUDA graph's replay where the graph policy allows one
// (cuda/graph_policy-inl.h), else the plan through the executor with the
// timeline recorded.

#include "mpipe/detail/pipeline/session.h"

#include "mpipe/detail/runtime/programs.h"
#include "mpipe/detail/runtime/items.h"

#include "mpipe/simulate.h"
#include "mpipe/state.h"

#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>

namespace mpipe {

MPIPE_FUNC ModelPipelineImpl::Parts::Parts(ModelPipelineImpl& owner)
    : self(owner), stages(owner.register_module("stages", torch::nn::ModuleList())) {}

// Note [Plan, then run]
// ~~~~~~~~~~~~~~~~~~~~~
// Every call is a kind (detail::CallKind) with its arguments, and three
// steps that read the pipeline through a PipelineView and change nothing:
// describe checks the arguments and describes the call (a CallInfo, the same
// on every rank across processes), check makes the checks every rank makes
// given that description, and plan builds the executor's CallSpec (the
// items, the programs, where inputs come from and outputs go) and how to
// hand results back. One session, Parts::call, runs any kind: the call's
// life (lock, memory watch, rollback), across processes the first rank's
// description told to every rank, else a CUDA graph's replay where the call
// allows one, and the plan through the executor (execute: the timeline
// recorded around it). The kinds live with the data they move:
// pipeline/micro_batch_calls-inl.h (forward, train_step) and
// pipeline/time_step_calls-inl.h (constant_forward, sequence_forward,
// constant_train_step), each beside its public method.

namespace detail {

/// The key of a graphed call: what its capture depends on.
MPIPE_FUNC GraphKey key_of(const CallKind& kind, const CallInfo& info, bool training) {
  GraphKey key;
  key.method = kind.method;
  key.items = info.n_items;
  key.rows = info.rows;
  key.reduce = info.reduce != 0;
  key.time_chunk = info.time_chunk;
  key.schedule = static_cast<int>(info.schedule);
  key.reduction = static_cast<int>(info.reduction);
  const at::Tensor& x = kind.inputs[0].tensor;
  key.input_sizes = x.sizes().vec();
  key.input_dtype = x.scalar_type();
  if (kind.target.defined()) {
    key.target_sizes = kind.target.sizes().vec();
    key.target_dtype = kind.target.scalar_type();
  }
  key.training = training;
  key.inference = c10::InferenceMode::is_enabled();
  return key;
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

MPIPE_FUNC Tensors ModelPipelineImpl::Parts::call(const detail::CallKind& kind) {
  RECORD_USER_SCOPE(std::string("mpipe::") + kind.method);  // the call, for profilers
  const ModelPipelineOptions& options = self.options;
  const bool threaded = options.worker_threads();
  // State does not outlive a constant_train_step, whatever happens. The
  // rollback (guarded) is set up before, so a failed step ends with the state
  // of its start, not reset (Note [State snapshots]).
  struct FreshState {
    torch::nn::Module& m;
    bool after;
    FreshState(torch::nn::Module& module, bool before, bool after_) : m(module), after(after_) {
      if (before || after) reset_states(m);
    }
    ~FreshState() {
      if (after) reset_states(m);
    }
  };
  return life.guarded(kind.method, options.track_memory(), stages, [&]() -> Tensors {
    const detail::PipelineView p = view();
    if (p.distributed()) {
      FreshState fresh(self, kind.reset_first, kind.fresh_state);
      return group.across(
          kind.method, options.process_group(), stages.devices, executor,
          [&](detail::RemoteCall& call) {
            const detail::CallInfo info = detail::PipelineGroup::agree(
                call, kind.method, [&] { return kind.describe(p); });
            kind.check(p, info, &call);
            const std::vector<Input> none;
            return execute(kind.plan(p, info, call.first() ? kind.inputs : none,
                                      call.last() ? kind.target : at::Tensor(), &call),
                            threaded);
          });
    }
    // A call refused for its arguments leaves the modules' state alone.
    const detail::CallInfo info = kind.describe(p);
    kind.check(p, info, nullptr);
    FreshState fresh(self, kind.reset_first, kind.fresh_state);
    if (kind.graphable) {  // a CUDA graph's replay, where the graph policy allows one
      const at::Tensor& x = kind.inputs[0].tensor;
      const detail::GraphKey key = detail::key_of(kind, info, self.is_training());
      auto eager = [&](const at::Tensor& xg, const at::Tensor& yg, bool th) {
        return detail::one_output(kind.method,
                                  execute(kind.plan(p, info, {Input(xg)}, yg, nullptr), th));
      };
      const at::Tensor out =
          kind.step ? graphs.step(self, stages, key, x, kind.target, eager)
                    : graphs.call(self, stages, key, x, [&](const at::Tensor& xg, bool th) {
                        return eager(xg, at::Tensor(), th);
                      });
      if (out.defined()) return {out};
    }
    return execute(kind.plan(p, info, kind.inputs, kind.target, nullptr), threaded);
  });
}

MPIPE_FUNC Tensors ModelPipelineImpl::Parts::execute(detail::Plan plan, bool threaded) {
  detail::CallSpec& spec = plan.spec;
  {
    RECORD_USER_SCOPE("mpipe::execute");
    std::shared_ptr<detail::Recorder> recorder;
    if (self.options.record_timeline() && !spec.remote) {  // one process's stages only (docs/distributed.md)
      // The schedule's idle fraction with unit costs, training or not (forward
      // programs give the fill-drain (n - 1) / (m + n - 1)).
      recorder = std::make_shared<detail::Recorder>(spec.method, spec.item_name, spec.n_items,
                                                    stages.devices, schedules::bubble(spec.programs));
      if (spec.training) recorder->describe_schedule(spec.schedule, detail::stage_ranks(spec.programs));
    }
    spec.recorder = recorder.get();
    executor.run(spec, stages.forwards, threaded);
    if (recorder) timeline.pending = recorder;
  }
  RECORD_USER_SCOPE("mpipe::results");
  return plan.results(spec);
}

}  // namespace mpipe
