#pragma once

#include "mpipe/detail/config.h"

// What every call kind of a pipeline uses around the executor (its session):
// the layout and agreement across processes, the executor run with the
// timeline recorded, and the memory watch. Which calls run from CUDA graphs
// is the graph policy's (cuda/graph_policy-inl.h). The call
// prologue itself (lock, memory watch, rollback) is State::guarded, and a
// call across processes State::across (pipeline_state.h).

#include "mpipe/detail/pipeline/pipeline_state.h"

#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/cuda/device_probe.h"
#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/programs.h"
#include "mpipe/detail/runtime/rng.h"
#include "mpipe/detail/runtime/scatter.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/simulate.h"
#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

namespace mpipe {


MPIPE_FUNC ModelPipelineImpl::State::State(ModelPipelineImpl& owner)
    : self(owner),
      stages(owner.register_module("stages", torch::nn::ModuleList())),
      graphs(detail::make_graph_cache()) {}

// Note [Plan, then run]
// ~~~~~~~~~~~~~~~~~~~~~
// Every call kind is data (CallKind): how to check and describe a call from
// its inputs and options (describe: a CallInfo, the same on every rank
// across processes), what every rank checks given that description (check),
// and a plan (plan: the executor's CallSpec, with the items, the programs,
// where inputs come from and outputs go, and how to hand results back). One
// session, run_call, runs any kind: the call prologue (guarded), across
// processes the first rank's description told to every rank, else a CUDA
// graph's replay where the call allows one, and the plan through the
// executor (run_plan: the timeline recorded around it). So a public method
// checks its arguments and names its kind; the kinds, with their describe,
// check and plan steps, are in calls-inl.h (the forward-type calls) and
// train_steps-inl.h (the training steps).

namespace detail {

/// The key of a graphed call: what its capture depends on.
MPIPE_FUNC detail::GraphKey key_of(const char* method, const CallInfo& info, const at::Tensor& x,
                           const at::Tensor& target, bool training) {
  detail::GraphKey key;
  key.method = method;
  key.items = info.n_items;
  key.rows = info.rows;
  key.reduce = info.reduce != 0;
  key.chunk = info.chunk;
  if (std::string(method) == "train_step") {
    key.schedule = static_cast<int>(info.schedule);
    key.reduction = static_cast<int>(info.reduction);
  }
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
}  // namespace detail

MPIPE_FUNC Tensors ModelPipelineImpl::State::run_call(const CallKind& kind,
                                                      const std::vector<Input>& inputs,
                                                      const at::Tensor& target) {
  RECORD_USER_SCOPE(std::string("mpipe::") + kind.method);  // the call, for profilers
  const bool threaded = self.options.worker_threads();
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
  if (distributed()) {
    return guarded(kind.method, [&] {
      FreshState fresh(self, kind.reset_first, kind.fresh_state);
      return across(kind.method, [&](detail::RemoteCall& call) {
        const detail::CallInfo info = agree(call, kind.method, kind.describe);
        if (kind.check) kind.check(info, &call);
        const std::vector<Input> none;
        return run_plan(kind.plan(info, call.first() ? inputs : none,
                                  call.last() ? target : at::Tensor(), &call),
                        threaded);
      });
    });
  }
  const detail::CallInfo info = kind.describe();
  return guarded(kind.method, [&]() -> Tensors {
    FreshState fresh(self, kind.reset_first, kind.fresh_state);
    if (kind.check) kind.check(info, nullptr);
    if (kind.graphable && inputs.size() == 1) {
      const at::Tensor& x = inputs[0].tensor;
      const detail::GraphKey key = detail::key_of(kind.method, info, x, target, self.is_training());
      auto eager = [&](const at::Tensor& xg, const at::Tensor& yg, bool th) {
        return detail::one_output(kind.method, run_plan(kind.plan(info, {Input(xg)}, yg, nullptr), th));
      };
      if (kind.step) return {run_step(key, x, target, eager)};
      auto no_target = [&](const at::Tensor& xg, bool th) { return eager(xg, at::Tensor(), th); };
      if (graphable(x)) {
        at::Tensor out = graphed_or_eager(graph_key(key), watched_tensors(), x, no_target);
        if (out.defined()) return {out};
      } else if (auto_graphable(x)) {
        return {auto_graphed(key, x, no_target)};
      }
    }
    return run_plan(kind.plan(info, inputs, target, nullptr), threaded);
  });
}

MPIPE_FUNC Tensors ModelPipelineImpl::State::run_plan(Plan plan, bool threaded) {
  {
    RECORD_USER_SCOPE("mpipe::execute");
    execute(plan.spec, threaded);
  }
  RECORD_USER_SCOPE("mpipe::results");
  return plan.results(plan.spec);
}

MPIPE_FUNC std::string ModelPipelineImpl::State::connect(const char* method) {
  const auto& group = self.options.process_group();
  const auto n_local = static_cast<int64_t>(devices.size());
  if (connected_stages == n_local) return {};
  if (connected_stages >= 0) {  // told to every rank through the call (across())
    return c10::str("mpipe::ModelPipeline::", method, ": rank ", group.rank(), " appended ",
                    n_local - connected_stages, " stage(s) after the pipeline's first call across "
                    "processes (it held ", connected_stages, ", now ", n_local,
                    "); append every stage before the first call");
  }
  // Every rank takes part, one with no stage too, so that all of them hear
  // which rank is wrong instead of waiting for it.
  if (pipeline_id < 0) pipeline_id = detail::next_pipeline_id(group);
  const auto counts = detail::exchange_stage_counts(group, pipeline_id, n_local);
  detail::Layout l;
  int64_t first = 0;
  std::string empty;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] <= 0) {
      empty += c10::str(empty.empty() ? "" : ", ", "rank ",
                        detail::group_impl(group)->world_rank(static_cast<int64_t>(p)),
                        " (pipeline rank ", p, ")");
    }
    l.first.push_back(first);
    first += counts[p];
  }
  TORCH_CHECK(empty.empty(), "mpipe::ModelPipeline::", method, ": ", empty,
              " holds no stage; every rank appends its stages (ProcessGroup::stage_range) "
              "before the first call");
  l.n_stages = first;
  layout = l;
  executor.set_layout(l.first[static_cast<size_t>(group.pipeline_rank())], l.n_stages,
                      c10::str(", rank ", group.rank()));
  connected_stages = n_local;
  return {};
}

MPIPE_FUNC detail::CallInfo ModelPipelineImpl::State::agree(
    detail::RemoteCall& call, const char* method, const std::function<detail::CallInfo()>& make) {
  if (!call.first()) return call.await_call(method);
  detail::CallInfo info = make();
  info.method = detail::method_code(method);
  call.announce(info);
  return info;
}

MPIPE_FUNC void ModelPipelineImpl::State::execute(detail::CallSpec& spec, bool threaded) {
  std::shared_ptr<detail::Recorder> recorder;
  if (self.options.record_timeline() && !spec.remote) {  // one process's stages only (docs/distributed.md)
    // The schedule's idle fraction with unit costs, training or not (forward
    // programs give the fill-drain (n - 1) / (m + n - 1)).
    recorder = start_recording(spec.method, spec.item_name, spec.n_items,
                               schedules::bubble(spec.programs));
    if (spec.training) recorder->describe_schedule(spec.schedule, detail::stage_ranks(spec.programs));
  }
  spec.recorder = recorder.get();
  executor.run(spec, forwards, threaded);
  if (recorder) pending_timeline = recorder;
}

MPIPE_FUNC std::shared_ptr<detail::Recorder> ModelPipelineImpl::State::start_recording(
    const char* method, const char* item_name, int64_t n_items, double bubble) const {
  return std::make_shared<detail::Recorder>(method, item_name, n_items, devices, bubble);
}

MPIPE_FUNC void ModelPipelineImpl::State::begin_memory_watch() {
  if (!self.options.track_memory()) return;
  memory_counters.clear();
  for (const auto& d : devices) {
    bool seen = false;
    for (const auto& c : memory_counters) seen |= c.device == d;
    if (!d.is_cuda() || seen) continue;
    detail::reset_allocator_peak(d);
    memory_counters.push_back({d, detail::allocator_counters(d).allocated, -1});
  }
}

MPIPE_FUNC void ModelPipelineImpl::State::end_memory_watch(const char* method) {
  if (!self.options.track_memory()) return;
  for (auto& c : memory_counters) c.peak = detail::allocator_counters(c.device).peak;
  memory_call = method;
}

}  // namespace mpipe
