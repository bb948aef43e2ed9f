#pragma once

// Private: the part of ModelPipeline that runs tasks on devices, streams and
// worker threads.

#include "mpipe/model_pipeline.h"
#include "mpipe/schedule.h"

#include "rng.h"
#include "state_snapshot.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mpipe {
namespace detail {

class Recorder;           // recorder.h
class BackwardPositions;  // backward_positions.h

// Note [Pipeline runtime]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Streams. Every stage on a CUDA device owns a compute stream taken from that
// device's stream pool when the stage is appended, so stages that share a GPU
// still get separate streams and can run concurrently. All of a stage's
// kernels are launched with that stream current. CPU stages have no stream:
// their work runs synchronously in the thread that runs the task.
//
// Hand-offs. A task's output travels to the next stage as a Handoff: the
// tensor plus an event recorded on the producer's stream right after the
// stage's forward. The consumer never synchronises a device or the host on it:
//  - same device: the consumer's stream waits on the event, and the tensor's
//    memory is recorded on the consumer's stream (record_stream) so the
//    caching allocator cannot reuse it while the consumer still reads it;
//  - CUDA -> other CUDA: the copy runs on a copy stream of the source device
//    (one per stage boundary), which first waits on the event; the copy is
//    made with the copy stream current on the source device and the
//    consumer's stream current on the destination, so ATen's cross-device
//    copy orders the consumer after the copy; the source tensor is recorded on
//    the copy stream. The destination is allocated on the consumer's stream;
//  - CPU -> CUDA: a non-blocking copy on the consumer's stream (pageable
//    memory is staged before cudaMemcpyAsync returns; pinned memory is
//    guarded by the host allocator's own events);
//  - CUDA -> CPU: a blocking copy on a copy stream that first waits on the
//    event: a CPU stage needs the values on the host before it can start.
// The caller's input is handed to stage 0 the same way, with an event
// recorded on the caller's current stream; at the end the caller's current
// stream on the output device waits on the last stage's stream and the
// outputs are recorded on it, so the caller can use them with no sync.
//
// Backward. Autograd runs each backward op on the stream its forward op ran
// on and makes streams wait on each other where gradients cross them, so the
// forward stream plan orders the backward pass too; mpipe adds nothing there.
//
// Threads. With worker_threads (the default) each stage has one worker
// thread, owned by the pipeline and joined when it is destroyed. The caller
// queues every item for stage 0; when a worker finishes (stage j, item i) it
// queues (j + 1, i) for the next worker. Each worker runs its items in order,
// so a stage sees micro-batches / time steps in order and the run follows the
// fill-drain schedule (schedule::fill_drain) as a data flow, while the host
// work of different stages (kernel launches, CPU compute) overlaps. Workers
// run under the caller's thread-local state (grad mode, inference mode,
// dispatch keys). The caller blocks on a condition variable only until every
// task has been *issued* (never on the device). Without worker threads the
// caller runs the tasks itself in fill_drain's clock order.
//
// Errors. A task that throws is caught in its worker; later tasks of the call
// are skipped but still passed along, so every task finishes and no worker is
// left waiting; the caller then rethrows a c10::Error that names the stage,
// its device and the micro-batch or time step. The next call starts clean.

struct Stage {
  c10::Device device;
  c10::optional<c10::Stream> compute;  // none for CPU stages
  // Copies from the previous stage's device, when that is another accelerator.
  c10::optional<c10::Stream> copy_in;
};

/// A thread that runs queued tasks in order.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void push(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();  // tasks catch their own errors (Runtime::task)
      fn = nullptr;  // release what the task captured (tensors) before waiting
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

/// A stage's output on its way to the next stage.
struct Handoff {
  at::Tensor value;
  /// Recorded on the producing stream once `value` is computed; null when
  /// `value` is ready on the host.
  std::shared_ptr<c10::Event> ready;
};

/// One call's work.
struct Job {
  const char* method = "";     // "forward", "constant_forward": for messages
  const char* item_name = "";  // "micro-batch", "time step"
  int64_t n_items = 0;
  /// Stage 0's input for item i, on the caller's device.
  std::function<at::Tensor(int64_t)> source;
  /// Items are micro-batches of one batch (forward): each stage call runs under
  /// MicroBatchGuard{item, n_items}. Otherwise items are time steps of one
  /// batch and run as micro-batch 0 of 1 (Note [Per-micro-batch state]).
  bool micro_batched = false;
  /// Every item has the same input: stage 0 receives it once.
  bool same_input = false;
  /// Sum the last stage's outputs into outputs[0] instead of keeping each.
  bool reduce_sum = false;
  /// How the kept outputs become one tensor: concatenated along dim 0
  /// (forward, constant_forward) or stacked into [T, ...] (sequence_forward).
  bool stack_outputs = false;
  /// The last stage's outputs (one per item, or one sum), usable on the
  /// caller's current stream once execute() returns.
  std::vector<at::Tensor> outputs;
  /// Stage 0's input when same_input, once received.
  at::Tensor received_input;
  /// Records every task when the timeline is on (Note [Timeline]); else null.
  Recorder* recorder = nullptr;
  /// Tags each stage call's autograd nodes (Note [Backward positions]); else null.
  BackwardPositions* backward_positions = nullptr;
  /// The call's random seed (Note [Random draws]); set by execute().
  CallRng rng;
};

/// One training step's work (ModelPipelineImpl::train_step).
struct TrainJob {
  int64_t n_items = 0;
  /// Micro-batch i of the input and of the target, on the caller's devices.
  std::function<at::Tensor(int64_t)> input;
  std::function<at::Tensor(int64_t)> target;
  /// The weighted loss of micro-batch i from the last stage's output and the
  /// target rows (runs on the last stage with its stream current).
  std::function<at::Tensor(int64_t, const at::Tensor&, const at::Tensor&)> loss;
  std::vector<schedule::Program> programs;
  Checkpoint checkpoint = Checkpoint::Never;
  /// Each stage's Stateful modules: saved before a checkpointed forward and
  /// loaded around its recompute (Note [State snapshots]).
  const std::vector<std::vector<StatefulModule>>* stateful = nullptr;
  bool input_requires_grad = false;
  /// Results: the gradient of each micro-batch's input (when the input
  /// requires grad) and the summed weighted loss (summed in micro-batch
  /// order), detached.
  std::vector<at::Tensor> input_grads;
  at::Tensor loss_sum;
  /// Records every task when the timeline is on (Note [Timeline]); else null.
  Recorder* recorder = nullptr;
  /// The call's random seed (Note [Random draws]); set by train().
  CallRng rng;
};

class Runtime {
 public:
  Runtime();
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// Prepares streams for a stage appended on `device`.
  void add_stage(c10::Device device);

  /// Stage `stage`'s compute stream (none for CPU stages).
  c10::optional<c10::Stream> compute_stream(size_t stage) const { return stages_[stage].compute; }

  /// Runs `job` through `forwards` (one per stage). `input` is the caller's
  /// tensor (for the entry event). Throws c10::Error naming stage and item.
  void execute(Job& job, const std::vector<StageForward>& forwards, bool threaded,
               const at::Tensor& input);

  /// Runs a training step: each stage runs its program of forwards and
  /// backwards (Note [Training runtime]). `params[j]` are stage j's
  /// parameters, whose gradients are recorded on the caller's streams.
  void train(TrainJob& job, const std::vector<StageForward>& forwards, bool threaded,
             const at::Tensor& input, const at::Tensor& target,
             const std::vector<std::vector<at::Tensor>>& params);

  /// The caller's current stream on every stage device waits for every stage
  /// stream there, so the caller sees all of the call's work (also that of a
  /// backward pass the caller ran through the stages).
  void join() const;

 private:
  struct Call;
  struct TrainCall;

  /// Every stage stream waits for the caller's current stream on its device,
  /// so a call sees all the caller's earlier work (e.g. an optimizer step).
  void fork() const;
  void train_forward(TrainCall& call, int64_t stage, int64_t item, const char*& phase);
  /// `phase` names what is running, for the error message of a failure.
  void train_backward(TrainCall& call, int64_t stage, int64_t item, const char*& phase);
  void run_program(TrainCall& call, int64_t stage);

  Handoff run_task(Job& job, const std::vector<StageForward>& forwards, int64_t stage,
                   int64_t item, Handoff in, const std::shared_ptr<c10::Event>& entry);
  /// `in` made usable by `stage`; a copy between devices is recorded as a
  /// Copy task of `item` when `recorder` is set.
  at::Tensor receive(Handoff in, int64_t stage, Recorder* recorder = nullptr, int64_t item = 0);
  void task(std::shared_ptr<Call> call, int64_t stage, int64_t item, Handoff in);
  /// Called inside a catch block: the current exception as a c10::Error that
  /// names the method, stage, device and item ("micro-batch 3 of 8").
  std::exception_ptr describe_failure(const char* method, const std::string& item_name,
                                      int64_t n_items, int64_t stage, int64_t item) const;
  void ensure_workers();
  std::vector<c10::Device> devices() const;

  std::vector<Stage> stages_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace detail
}  // namespace mpipe
