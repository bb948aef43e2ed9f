#pragma once

// Private: what a ModelPipelineImpl holds besides its options, and the call
// kinds written on it (Note [Plan, then run] in session-inl.h). Where things
// are (include/mpipe/detail/):
//   pipeline/model_pipeline-inl.h  the facade: append, devices, to/load, reports
//   pipeline/session-inl.h    run_call: any call's checks, agreement across
//                             processes, graph or executor, timeline, memory
//   pipeline/calls-inl.h      forward, constant_forward, sequence_forward: their
//                             kinds and plans
//   pipeline/train_steps-inl.h  train_step, constant_train_step: the same
//   runtime/                  the executor of per-stage programs and its parts
//   distributed/, cuda/, precision/, snn/  the rest, by layer

#include "mpipe/model_pipeline.h"

#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/executor.h"
#include "mpipe/detail/cuda/graphs.h"
#include "mpipe/detail/runtime/recorder.h"
#include "mpipe/detail/distributed/remote.h"
#include "mpipe/detail/runtime/state_snapshot.h"

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace mpipe {

struct ModelPipelineImpl::State {
  explicit State(ModelPipelineImpl& owner);

  ModelPipelineImpl& self;
  torch::nn::ModuleList stages;
  std::vector<detail::StageForward> forwards;
  std::vector<c10::Device> devices;
  std::vector<std::vector<detail::StatefulModule>> stateful;  // per stage
  detail::Executor executor;
  std::shared_ptr<detail::GraphCache> graphs;  // null without CUDA
  bool in_graphed_step = false;  // run_step is capturing or warming up a graph
  bool in_graph_run = false;     // a no-grad call is being captured (lanes(0): 2 lanes)
  /// Note [Automatic CUDA graphs]: what auto_graphed knows of each call key.
  struct AutoGraph {
    int eager_runs = 0;    // eager runs of this key so far
    int moved = 0;         // graphs dropped because parameters moved
    bool refused = false;  // it drew random numbers, or its capture failed
  };
  std::map<std::string, AutoGraph> auto_graphs;
  bool cast_linears = false;     // a stage holds an mpipe::Linear (Note [Graphs or summed casts])
  mutable std::mutex call_mutex;  // one call at a time: stages' state must see calls in order
  std::shared_ptr<detail::Recorder> pending_timeline;  // the last recorded call
  Timeline timeline;                                   // ...once resolved
  struct MemoryCounters {
    c10::Device device;
    int64_t before, peak;
  };
  std::string memory_call;
  std::vector<MemoryCounters> memory_counters;  // per CUDA stage device, last call

  // Note [Plan, then run] (session-inl.h) -----------------------------------
  /// This rank's part of one call: the executor's spec and, after its run,
  /// what the caller gets (nothing on a rank that has no result).
  struct Plan {
    detail::CallSpec spec;
    std::function<Tensors(const detail::CallSpec&)> results;
  };
  /// A kind of call, as data: how to check and describe it, and its plan.
  struct CallKind {
    const char* method = "";
    /// Checks the inputs and options and describes the call (across
    /// processes: on the first rank, whose description every rank uses).
    std::function<detail::CallInfo()> describe;
    /// Checks every rank makes inside the call, given the description.
    std::function<void(const detail::CallInfo&, detail::RemoteCall*)> check;
    /// This rank's plan; `inputs` and `target` where this rank needs them
    /// (across processes: the inputs on the first rank, the target on the last).
    std::function<Plan(const detail::CallInfo&, const std::vector<Input>& inputs,
                       const at::Tensor& target, detail::RemoteCall* remote)>
        plan;
    bool step = false;         // a training step: graphed through run_step
    bool fresh_state = false;  // state reset before and after (constant_train_step)
    bool reset_first = false;  // state reset before (ModelPipelineOptions::reset_state_each_call)
    bool graphable = false;    // may run as a CUDA graph (a single-tensor call)
  };
  /// The session: runs a call of `kind` in one process or across processes,
  /// eagerly or from a CUDA graph, under the call prologue (guarded).
  Tensors run_call(const CallKind& kind, const std::vector<Input>& inputs,
                   const at::Tensor& target = {});
  /// `plan` through the executor, its tasks recorded when
  /// options.record_timeline; its results.
  Tensors run_plan(Plan plan, bool threaded);
  void execute(detail::CallSpec& spec, bool threaded);
  /// The shared prologue of every call: the call lock, the memory watch and
  /// the rollback of stateful modules on failure (Note [State snapshots]).
  template <typename F>
  auto guarded(const char* method, F&& body) -> decltype(body());
  /// Whether a no-grad call on `x` could run as a CUDA graph: a CUDA build,
  /// one device, no timeline, no state held.
  bool could_graph(const at::Tensor& x) const;
  /// Whether a no-grad call on `x` may be replayed from a CUDA graph
  /// (options.cuda_graphs).
  bool graphable(const at::Tensor& x) const;
  /// Whether it may be captured automatically (options.auto_cuda_graphs).
  bool auto_graphable(const at::Tensor& x) const;
  /// The call `eager(x, threaded)`, or its CUDA-graph replay when allowed.
  /// `key` is graph_key's, `watched` watched_tensors().
  at::Tensor graphed_or_eager(const std::string& key, const std::vector<at::Tensor>& watched,
                              const at::Tensor& x,
                              const std::function<at::Tensor(const at::Tensor&, bool)>& eager);
  /// The call run eagerly or replayed, as Note [Automatic CUDA graphs] decides.
  at::Tensor auto_graphed(const detail::GraphKey& key, const at::Tensor& x,
                          const std::function<at::Tensor(const at::Tensor&, bool)>& eager);
  /// The cache's key of a graphed call: `key` and every module's training flag.
  std::string graph_key(const detail::GraphKey& key) const;
  /// The parameters and buffers a graph reads in place.
  std::vector<at::Tensor> watched_tensors() const;
  /// A training step: replayed from a CUDA graph when step_graphable, else
  /// `eager(x, target, worker_threads)`.
  at::Tensor run_step(const detail::GraphKey& key, const at::Tensor& x, const at::Tensor& target,
                      const std::function<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                     bool)>& eager);
  bool casts_beat_graphs(const at::Tensor& x) const;
  bool step_graphable(const at::Tensor& x, const at::Tensor& target) const;
  void drop_graphs();
  std::shared_ptr<detail::Recorder> start_recording(const char* method, const char* item_name,
                                                    int64_t n_items, double bubble) const;
  void begin_memory_watch();
  void end_memory_watch(const char* method);

  // The call kinds: calls-inl.h, train_steps-inl.h ---------------------------
  Tensors forward(const std::vector<Input>& inputs, Split split, bool graphable_call);
  Tensors constant_forward(const std::vector<Input>& inputs, int64_t T, bool reduce,
                           int64_t chunk, const std::optional<Split>& split, bool graphable_call);
  Tensors sequence_forward(const std::vector<Input>& inputs, bool reduce, int64_t chunk,
                           const std::optional<Split>& split, bool graphable_call);
  at::Tensor train_step(const std::vector<Input>& inputs, const at::Tensor& target,
                        const LossFunction& loss_fn, const TrainStepOptions& step,
                        bool graphable_call);
  at::Tensor constant_train_step(const std::vector<Input>& inputs, int64_t T,
                                 const at::Tensor& target, const LossFunction& loss_fn,
                                 int64_t chunk, const std::optional<Split>& split,
                                 bool graphable_call);
  /// Their plans: they read the pipeline's state and build the executor's
  /// CallSpec; nothing runs.
  Plan plan_forward(const detail::CallInfo& info, const std::vector<Input>& inputs,
                    detail::RemoteCall* remote);
  /// constant_forward's, or with `loss_fn` constant_train_step's (the loss of
  /// the summed outputs backpropagated chunk by chunk, Note [Chained backward]).
  Plan plan_constant(const char* method, const detail::CallInfo& info,
                     const std::vector<Input>& inputs, detail::RemoteCall* remote,
                     const LossFunction& loss_fn = {}, const at::Tensor& target = {});
  Plan plan_sequence(const detail::CallInfo& info, const std::vector<Input>& inputs,
                     detail::RemoteCall* remote);
  Plan plan_train_step(const detail::CallInfo& info, const std::vector<Input>& inputs,
                       const at::Tensor& target, const LossFunction& loss_fn,
                       const TrainStepOptions& step, detail::RemoteCall* remote);
  /// `chunk`: steps per stage call with multi-step stages, 0 for single
  /// steps, detail::kAutoChunk for resolve_chunk's choice (Note [Time chunks]).
  int64_t resolve_chunk(int64_t chunk, int64_t T) const;
  /// The devices the pipeline spans: distinct stage devices, or ranks across
  /// processes.
  int64_t pipeline_devices() const;
  /// Rows per micro-batch of a time-step call over a batch of `batch` rows
  /// (0: one micro-batch); `split` empty: the pipeline's choice (Note
  /// [Micro-batches over time]), which cuts only calls that start from reset
  /// state (`fresh`).
  int64_t resolve_rows(const char* method, const std::optional<Split>& split, int64_t batch,
                       int64_t T, int64_t chunk, bool fresh) const;
  /// The description of a call over T time steps of `inputs` (checked).
  detail::CallInfo constant_call_info(const char* method, const std::vector<Input>& inputs,
                                      int64_t T, int64_t chunk,
                                      const std::optional<Split>& split, bool fresh) const;
  /// check_checkpointable for constant_train_step: the stages it would
  /// checkpoint (none but the last, and only when a micro-batch is).
  void check_checkpointable_steps(const detail::CallInfo& info) const;
  /// Refuses checkpointing of a stage whose stateful modules cannot save
  /// their state (all stages, or all but the pipeline's last).
  void check_checkpointable(const char* method, bool except_last = false) const;

  // Across processes (Note [Cross-process calls]) ---------------------------
  int64_t pipeline_id = -1;  // on the group, in construction (or first-call) order
  int64_t call_seq = 0;
  int64_t connected_stages = -1;  // the local stage count the layout was made for
  detail::Layout layout;
  bool distributed() const { return self.options.process_group().defined(); }
  /// The stage ranges of every rank, exchanged at the first call (every
  /// rank gets the error when one holds no stage). Returns the error of a
  /// rank that appended stages since, which across() tells every rank.
  std::string connect(const char* method);
  /// Runs `body(call)` as one call across processes on every rank
  /// (Note [Cross-process calls]): its error ends the call on every rank.
  template <typename F>
  auto across(const char* method, F&& body)
      -> decltype(body(std::declval<detail::RemoteCall&>()));
  /// The first rank's `make()`, told to every rank.
  detail::CallInfo agree(detail::RemoteCall& call, const char* method,
                         const std::function<detail::CallInfo()>& make);
};

template <typename F>
auto ModelPipelineImpl::State::guarded(const char* method, F&& body) -> decltype(body()) {
  std::lock_guard<std::mutex> lock(call_mutex);
  begin_memory_watch();
  struct EndWatch {
    State& s;
    const char* method;
    ~EndWatch() { s.end_memory_watch(method); }
  } end_watch{*this, method};
  detail::RollbackOnFailure rollback(stateful);  // Note [State snapshots]
  detail::start_with_fresh_casts();              // Note [Autocast in the pipeline]
  return body();
}

template <typename F>
auto ModelPipelineImpl::State::across(const char* method, F&& body)
    -> decltype(body(std::declval<detail::RemoteCall&>())) {
  const std::string late = connect(method);
  detail::RemoteCall call(self.options.process_group(), layout, pipeline_id, call_seq++,
                          [this](int64_t stage) {
                            return devices[static_cast<size_t>(stage - executor.first_stage())];
                          });
  decltype(body(call)) result;
  std::exception_ptr error;
  try {
    TORCH_CHECK(late.empty(), late);
    result = body(call);
  } catch (...) {
    error = std::current_exception();
  }
  if (error) {
    const std::string what = detail::message_of(error);
    const std::string others = call.finish(what, method);
    if (others.empty()) std::rethrow_exception(error);
    // What the other ranks reported may name the root cause (the rank that
    // stalled behind the one this rank waited for).
    TORCH_CHECK(false, what, "; other ranks: ", others);
  }
  call.finish("", method);  // throws another rank's failure
  return result;
}

}  // namespace mpipe
