#pragma once

// Private: what a ModelPipelineImpl holds besides its options, and the call
// kinds written on it. Where things are:
//   model_pipeline-inl.h  the facade: append, devices, to/load, reports
//   calls-inl.h           forward, constant_forward, sequence_forward; the call
//                       prologue (lock, memory watch, rollback) and the
//                       choice between a CUDA graph and the executor
//   train_steps-inl.h     train_step, constant_train_step
//   scatter.h           inputs split into micro-batches or time steps, and
//                       outputs gathered
//   executor.h          the one executor of per-stage programs
//   transport.h         how tensors move between stages
//   skips.h, rng.h      skip connections, reproducible random draws
//   graphs.h            CUDA-graph capture and replay

#include "mpipe/model_pipeline.h"

#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/executor.h"
#include "mpipe/detail/cuda/graphs.h"
#include "mpipe/detail/runtime/recorder.h"
#include "mpipe/detail/distributed/remote.h"
#include "mpipe/detail/runtime/state_snapshot.h"

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace mpipe {

struct ModelPipelineImpl::State {
  explicit State(ModelPipelineImpl& owner);

  ModelPipelineImpl& self;
  torch::nn::ModuleList stages;
  std::vector<detail::StageForward> forwards;
  std::vector<c10::Device> devices;
  /// Whether every stage of this process is on one device.
  bool one_device() const {
    for (const auto& d : devices) {
      if (d != devices.front()) return false;
    }
    return true;
  }
  std::vector<std::vector<detail::StatefulModule>> stateful;  // per stage
  detail::Executor executor;
  std::shared_ptr<detail::GraphCache> graphs;  // null without CUDA
  bool in_graphed_step = false;  // run_step is capturing or warming up a graph
  mutable std::mutex call_mutex;  // one call at a time: stages' state must see calls in order
  std::shared_ptr<detail::Recorder> pending_timeline;  // the last recorded call
  Timeline timeline;                                   // ...once resolved
  struct MemoryCounters {
    c10::Device device;
    int64_t before, peak;
  };
  std::string memory_call;
  std::vector<MemoryCounters> memory_counters;  // per CUDA stage device, last call

  // calls-inl.h ---------------------------------------------------------------
  /// The call prologue every call kind shares: the call lock, the memory
  /// watch and the rollback of stateful modules on failure (Note [State
  /// snapshots]). Runs `body` inside it.
  template <typename F>
  auto guarded(const char* method, F&& body) -> decltype(body());
  Tensors forward(const std::vector<Input>& inputs, int64_t split_size, bool graphable_call);
  /// `chunk`: steps per stage call with multi-step stages, 0 for single
  /// steps, detail::kAutoChunk for resolve_chunk's choice (Note [Time chunks]).
  int64_t resolve_chunk(int64_t chunk, int64_t T) const;
  /// The first rank's checks of a time-step call across processes, and the
  /// CallInfo it announces (T steps in chunks of resolve_chunk(chunk, T)).
  detail::CallInfo constant_call_info(const char* method, const std::vector<Input>& inputs,
                                      int64_t T, int64_t chunk) const;
  Tensors constant_forward(const std::vector<Input>& inputs, int64_t T, bool reduce,
                           int64_t chunk, bool graphable_call);
  Tensors sequence_forward(const std::vector<Input>& inputs, bool reduce, int64_t chunk,
                           bool graphable_call);
  /// `spec` through the executor, its tasks recorded when options.record_timeline.
  void execute(detail::CallSpec& spec, bool threaded);
  /// constant_forward's call: the outputs summed or concatenated time-major.
  /// With `loss` (of the outputs and `target`), constant_train_step's: the
  /// loss backpropagated chunk by chunk (Note [Chained backward]); returns
  /// the loss, detached (on the last rank; nothing on the others).
  /// `batched`: which inputs are repeated per step of a chunk (all if empty).
  Tensors run_constant(const char* method, const Tensors& in, int64_t T, bool reduce,
                       int64_t chunk, bool threaded, detail::RemoteCall* remote = nullptr,
                       const std::vector<bool>& batched = {},
                       const std::function<at::Tensor(const Tensors&)>& loss = {},
                       const at::Tensor& target = {});
  /// Whether a no-grad call on `x` may be replayed from a CUDA graph.
  bool graphable(const at::Tensor& x) const;
  /// The call `eager(x, threaded)`, or its CUDA-graph replay when allowed.
  at::Tensor graphed_or_eager(const detail::GraphKey& key, const at::Tensor& x,
                              const std::function<at::Tensor(const at::Tensor&, bool)>& eager);
  void drop_graphs();
  std::shared_ptr<detail::Recorder> start_recording(const char* method, const char* item_name,
                                                    int64_t n_items, double bubble) const;
  void begin_memory_watch();
  void end_memory_watch(const char* method);

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
  Tensors forward_items(const std::vector<Input>& in, int64_t rows, int64_t batch, bool threaded,
                        detail::RemoteCall* remote);
  Tensors sequence_items(const std::vector<Input>& in, int64_t T, bool reduce, int64_t chunk,
                         bool threaded, detail::RemoteCall* remote);

  // train_steps-inl.h ---------------------------------------------------------
  at::Tensor train_step(const std::vector<Input>& inputs, const at::Tensor& target,
                        const LossFunction& loss_fn, const TrainStepOptions& step,
                        bool graphable_call);
  at::Tensor constant_train_step(const std::vector<Input>& inputs, int64_t T,
                                 const at::Tensor& target, const LossFunction& loss_fn,
                                 int64_t chunk, bool graphable_call);
  bool step_graphable(const at::Tensor& x, const at::Tensor& target) const;
  /// One train_step through the executor: `inputs` are the caller's (their
  /// gradients are accumulated), `in` their detached copies, `y` the target
  /// (each only where this rank needs it, across processes).
  at::Tensor step_items(const std::vector<Input>& inputs, const std::vector<Input>& in,
                        const at::Tensor& y, const LossFunction& loss_fn,
                        const detail::CallInfo& info, bool threaded, detail::RemoteCall* remote,
                        double loss_scale = 1.0,
                        const std::vector<schedules::Program>* given = nullptr);
  /// A training step: replayed from a CUDA graph when step_graphable (and
  /// `graphable_call`), else `eager(x, target, worker_threads)`.
  at::Tensor run_step(const detail::GraphKey& key, bool graphable_call, const at::Tensor& x,
                      const at::Tensor& target,
                      const std::function<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                     bool)>& eager);
  void check_checkpointable(const char* method) const;
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
