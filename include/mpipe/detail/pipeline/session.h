#pragma once

// Private: what a ModelPipelineImpl holds besides its options, one part per
// concern (ModelPipelineImpl::Parts), and the session that runs every call
// on it (Note [Plan, then run] in session-inl.h). Where things are
// (include/mpipe/detail/):
//   pipeline/micro_batch_calls-inl.h  forward, train_step: the public
//                             methods, their description, checks, plan, results
//   pipeline/time_step_calls-inl.h    constant_forward, sequence_forward,
//                             constant_train_step: the same
//   pipeline/session-inl.h    Parts::call: any call's prologue, agreement
//                             across processes, graph or executor, timeline
//   pipeline/model_pipeline-inl.h  append, devices, moves, loads, reports
//   runtime/                  the executor of per-stage programs and its parts
//   distributed/, cuda/, precision/, snn/  the rest, by layer

#include "mpipe/model_pipeline.h"

#include "mpipe/detail/cuda/device_probe.h"
#include "mpipe/detail/cuda/graph_policy.h"
#include "mpipe/detail/distributed/pipeline_group.h"
#include "mpipe/detail/distributed/remote.h"
#include "mpipe/detail/pipeline/stages.h"
#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/executor.h"
#include "mpipe/detail/runtime/recorder.h"
#include "mpipe/detail/runtime/state_snapshot.h"

#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace mpipe {
namespace detail {

/// What a call's steps read of the pipeline. They only read: what they
/// build goes into the call's Plan.
struct PipelineView {
  const ModelPipelineImpl& module;
  const Stages& stages;
  const Executor& executor;
  const GraphPolicy& graphs;
  const PipelineGroup& group;

  const ModelPipelineOptions& options() const { return module.options; }
  bool distributed() const { return module.options.process_group().defined(); }
  bool training() const { return module.is_training(); }
  /// Stages in the whole pipeline (across processes: on every rank).
  int64_t n_stages() const { return executor.n_total(); }
  /// The devices the pipeline spans: distinct stage devices (the CPU
  /// counts once), or its ranks across processes.
  int64_t devices() const { return distributed() ? group.ranks() : stages.distinct_devices(); }
};

/// This rank's part of one call: the executor's spec and, after its run,
/// what the caller gets (nothing on a rank that has no result).
struct Plan {
  CallSpec spec;
  std::function<Tensors(const CallSpec&)> results;
};

/// A kind of call with its arguments (Note [Plan, then run]).
class CallKind {
 public:
  CallKind(const char* method_, const std::vector<Input>& inputs_, at::Tensor target_ = {})
      : method(method_), inputs(inputs_), target(std::move(target_)) {}
  virtual ~CallKind() = default;

  /// Checks the arguments against the pipeline and describes the call;
  /// under the call lock. Across processes it runs on the first rank, whose
  /// description every rank uses.
  virtual CallInfo describe(const PipelineView& p) const = 0;
  /// The checks every rank makes inside the call, given the description.
  virtual void check(const PipelineView&, const CallInfo&, RemoteCall*) const {}
  /// This rank's plan; `in` and `y` where this rank needs them (across
  /// processes: the inputs on the first rank, the target on the last).
  virtual Plan plan(const PipelineView& p, const CallInfo& info, const std::vector<Input>& in,
                    const at::Tensor& y, RemoteCall* remote) const = 0;

  const char* method;
  const std::vector<Input>& inputs;
  at::Tensor target;
  bool step = false;         // a training step: graphed as a step
  bool fresh_state = false;  // state reset before and after (constant_train_step)
  bool reset_first = false;  // state reset before (ModelPipelineOptions::reset_state_each_call)
  bool one_tensor = false;   // the Tensor overload: its input is checked as it is
  bool graphable = false;    // may run as a CUDA graph (a Tensor overload)
};

/// A call's life: one call at a time (stages' state must see calls in
/// order), the memory watch, and the rollback of stateful modules when a
/// call fails (Note [State snapshots]).
class CallLife {
 public:
  /// `body()` under the call lock, the memory watch and the rollback.
  template <typename F>
  auto guarded(const char* method, bool track_memory, const Stages& stages, F&& body)
      -> decltype(body());
  std::mutex& mutex() const { return mutex_; }

  /// The last watched call's figures per CUDA stage device (memory_report).
  struct Counters {
    c10::Device device;
    int64_t before, peak;
  };
  const std::vector<Counters>& counters() const { return counters_; }
  const std::string& watched_call() const { return watched_call_; }

 private:
  void begin_watch(const Stages& stages);
  void end_watch(const char* method);

  mutable std::mutex mutex_;
  std::string watched_call_;
  std::vector<Counters> counters_;
};

template <typename F>
auto CallLife::guarded(const char* method, bool track_memory, const Stages& stages, F&& body)
    -> decltype(body()) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (track_memory) begin_watch(stages);
  struct EndWatch {
    CallLife& life;
    const char* method;  // null: not watched
    ~EndWatch() {
      if (method) life.end_watch(method);
    }
  } end_watch{*this, track_memory ? method : nullptr};
  RollbackOnFailure rollback(stages.stateful);  // Note [State snapshots]
  start_with_fresh_casts();                     // Note [Autocast in the pipeline]
  return body();
}

}  // namespace detail

struct ModelPipelineImpl::Parts {
  explicit Parts(ModelPipelineImpl& owner);

  ModelPipelineImpl& self;
  detail::Stages stages;
  detail::Executor executor;
  detail::CallLife life;
  detail::GraphPolicy graphs;
  detail::PipelineGroup group;  // across processes
  detail::TimelineSlot timeline;

  detail::PipelineView view() const { return {self, stages, executor, graphs, group}; }
  /// The session: runs `kind` in one process or across processes, eagerly
  /// or from a CUDA graph, under the call's life (guarded).
  Tensors call(const detail::CallKind& kind);

 private:
  /// `plan` through the executor, its tasks recorded when
  /// options.record_timeline; its results.
  Tensors execute(detail::Plan plan, bool threaded);
};

}  // namespace mpipe
