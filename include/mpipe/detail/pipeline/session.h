#pragma once

// Private: what a ModelPipelineImpl holds besides its options, one part per
// concern (PipelineParts), the scope of one call on it (Call, Note [Plan,
// then run] in session-inl.h), and the checks every call shares. Where things are
// (include/mpipe/detail/):
//   pipeline/micro_batch_calls-inl.h  forward, train_step: the public
//                             methods, their description, checks, plan, results
//   pipeline/time_step_calls-inl.h    constant_forward, sequence_forward,
//                             constant_train_step: the same
//   pipeline/session-inl.h    Call: any call's life, agreement across
//                             processes, the executor run and its timeline;
//                             the checks the calls share
//   pipeline/model_pipeline-inl.h  append, devices, moves, loads, reports
//   runtime/                  the executor of per-stage programs and its parts
//   distributed/, cuda/, precision/, snn/  the rest, by layer

#include "mpipe/model_pipeline.h"
#include "mpipe/schedule.h"
#include "mpipe/split.h"
#include "mpipe/tensors.h"
#include "mpipe/training.h"

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
#include <memory>
#include <mutex>
#include <optional>
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

/// A call's life: one call at a time (stages' state must see calls in
/// order) and the memory watch of the last call.
class CallLife {
 public:
  std::mutex& mutex() const { return mutex_; }

  /// The last watched call's figures per CUDA stage device (memory_report).
  struct Counters {
    c10::Device device;
    int64_t before, peak;
  };
  const std::vector<Counters>& counters() const { return counters_; }
  const std::string& watched_call() const { return watched_call_; }

  void begin_watch(const Stages& stages);
  void end_watch(const char* method);

 private:
  mutable std::mutex mutex_;
  std::string watched_call_;
  std::vector<Counters> counters_;
};

/// What a ModelPipelineImpl holds besides its options, one part per concern.
struct PipelineParts {
  explicit PipelineParts(ModelPipelineImpl& owner);

  ModelPipelineImpl& self;
  Stages stages;
  Executor executor;
  CallLife life;
  GraphPolicy graphs;
  PipelineGroup group;  // across processes
  TimelineSlot timeline;

  PipelineView view() const { return {self, stages, executor, graphs, group}; }
};

/// One call of a pipeline, as a scope (Note [Plan, then run]). While it
/// lives it holds the call lock, the memory watch and the rollback of
/// stateful modules on failure (Note [State snapshots]); across processes
/// it is the call on every rank, whose error ends the call on every rank.
/// The call's own code runs in between, in this order: agree on the
/// description, check, reset state if the call asks, execute the plans,
/// finish; and on an error, fail() from a catch block.
class Call {
 public:
  Call(PipelineParts& parts, const char* method);
  ~Call();
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  const PipelineView& view() const { return view_; }
  /// The call across processes; null in one process.
  RemoteCall* remote() const { return remote_.get(); }
  /// Whether this rank describes the call: in one process, or the first
  /// rank. It first throws the error of a rank that appended stages after
  /// the first call, which the call tells every rank.
  bool describes() const;
  /// Whether this rank takes the inputs (one process, or the first rank)
  /// and the target (one process, or the last rank).
  bool first() const { return !remote_ || remote_->first(); }
  bool last() const { return !remote_ || remote_->last(); }
  /// The description every rank uses: `mine` where describes(), else the
  /// first rank's.
  CallInfo agree(const std::optional<CallInfo>& mine);
  /// Resets the modules' state now and, with `after`, when the call ends
  /// (constant_train_step; ModelPipelineOptions::reset_state_each_call).
  void reset_states_now(bool after);
  /// `spec` through the executor, its tasks recorded when
  /// options.record_timeline. The call hands back the plan's results.
  void execute(CallSpec& spec, bool threaded);
  /// A Tensor call's CUDA-graph replay in one process, where the graph
  /// policy allows one (`step`: a training step's loss function; null for a
  /// no-grad call); undefined when the call is to run eagerly. `eager` runs
  /// it eagerly on the graph's inputs (the policy's capture runs it).
  at::Tensor replay(const at::Tensor& x, const at::Tensor& y, const CallInfo& info,
                    const LossFunction* step, const GraphPolicy::EagerStep& eager);
  /// Ends the call; across processes, throws what another rank reported.
  void finish();
  /// From a catch block: ends the call on every rank and rethrows the
  /// error, with what the other ranks reported.
  [[noreturn]] void fail();

 private:
  PipelineParts& parts_;
  const char* method_;
  std::lock_guard<std::mutex> lock_;
  struct Watch {  // the memory watch, ended when the call ends
    PipelineParts& parts;
    const char* method;  // null: not watched
    ~Watch() {
      if (method) parts.life.end_watch(method);
    }
  } watch_;
  RollbackOnFailure rollback_;
  bool reset_after_ = false;
  PipelineView view_;
  std::string late_;  // PipelineGroup::open's
  std::unique_ptr<RemoteCall> remote_;
  bool finished_ = false;
};

// What the calls share: the checks of their arguments and options, and a
// training step's loss.

/// Refuses a pipeline without stages and, given `x` (a Tensor overload's
/// input), an undefined or empty one; `time_major`: x is [T, N, ...].
/// Across processes every rank hears of a rank without stages at the first
/// call, and the first rank's inputs are checked as they are split.
void check_runnable(const PipelineView& p, const char* method, const at::Tensor* x = nullptr,
                    bool time_major = false);
/// The call's time chunk: 0 for single-step stages, kAutoChunk for the
/// pipeline's choice, else k >= 1 (Note [Time chunks]).
int64_t time_chunk_of(const ModelPipelineOptions& options, const char* method,
                 std::optional<int64_t> arg);
/// A time-step call's micro-batch split: the call's, else the options'
/// count, else empty for the pipeline's choice (Note [Micro-batches over
/// time]). The options' count leaves a call without a batched input whole
/// (a split given to the call is refused).
std::optional<Split> split_of(const ModelPipelineOptions& options, const char* method,
                              std::optional<Split> arg, const std::vector<Input>& inputs);

void check_grad_mode(const char* method);
/// A training step's loss function, checked where the loss is taken (the
/// last rank across processes).
void check_loss_fn(const char* method, const LossFunction& loss_fn);
/// The loss of the last stage's outputs `out`: one output in, one value out
/// (0-dim). `method` prefixes the messages when the caller does not name the
/// call itself (the executor does).
at::Tensor scalar_loss(const LossFunction& loss_fn, const Tensors& out, const at::Tensor& target,
                       const char* method = nullptr);
/// Refuses checkpointing of a stage whose stateful modules cannot save
/// their state (all stages, or all but the pipeline's last).
void check_checkpointable(const PipelineView& p, const char* method, bool except_last = false);

/// CallInfo::schedule of a step that runs TrainStepOptions::programs.
constexpr int64_t kGivenPrograms = -1;
/// A fingerprint of `programs`, so that ranks can check they were given the same.
int64_t fingerprint(const std::vector<schedules::Program>& programs);
/// TrainStepOptions::programs, refused unless they run this step: every
/// operation once, one worker per stage, no cycle (schedules::simulate).
void check_programs(const std::vector<schedules::Program>& programs, int64_t n_stages,
                    int64_t n_micro);
/// TrainStepOptions' values against this pipeline; bad ones throw
/// c10::ValueError, as check_programs does.
void check_schedule(const TrainStepOptions& step, int64_t n_stages);

/// Results handed to the caller: usable on its current streams.
Tensors for_caller(Tensors out);
/// How both training steps end: the gradients of the caller's inputs
/// (`grads[k]` for `inputs[k]`; undefined: none), after the executor's join,
/// sent on through the caller's own graph from the caller's thread and
/// streams, as one backward.
void backward_through_caller(const Tensors& inputs, const Tensors& grads);

}  // namespace detail
}  // namespace mpipe
