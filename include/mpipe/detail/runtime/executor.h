#pragma once

// Private: the one executor of per-stage programs that runs every pipeline
// call (Note [One runtime]).

#include "mpipe/checkpoint.h"
#include "mpipe/schedule.h"
#include "mpipe/state.h"
#include "mpipe/tensors.h"

#include "mpipe/detail/runtime/recompute.h"
#include "mpipe/detail/runtime/rng.h"
#include "mpipe/detail/runtime/state_snapshot.h"
#include "mpipe/detail/runtime/time_chunks.h"
#include "mpipe/detail/runtime/transport.h"

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace mpipe {
namespace detail {

class Recorder;           // recorder.h

// Note [One runtime]
// ~~~~~~~~~~~~~~~~~~
// Every call compiles to a CallSpec: a program per worker (schedule.h) of
// actions F(i, s) (forward of item i on stage s), B(i, s) (its backward) or,
// for zero-bubble schedules, I(i, s) and W(i, s) (the backward's input and
// weight halves, Note [Split backward] in split_backward-inl.h), where items
// are micro-batches or time steps (or chunks of them). Forward-type calls
// (forward, constant_forward, sequence_forward) are programs of forwards only
// (schedules::forward_only) over one autograd graph; training steps cut the
// graph at stage boundaries (Note [Training runtime]): train_step's programs
// come from its schedule, constant_train_step's from detail::chained
// (runtime/programs.h), whose B(t, s) runs chunk t's part of stage s's graph
// (Note [Chained backward]).
//
// The executor runs the programs, threaded (program k on shared worker k) or
// inline (the caller runs the actions in schedules::simulate's start order,
// in which every input exists before it is needed). An action's inputs come
// from the Transport (Note [Transport]): activations from the previous stage,
// gradients from the next, skip tensors from their stasher (Note [Skip
// connections]); the call's inputs enter stage 0 from the caller. So the
// executor (executor-inl.h, actions-inl.h, backward_actions-inl.h,
// executor_run.h) has the one failure path (the first error is kept, the
// transport is aborted so no stage waits, the caller rethrows it naming the
// stage, its device, the item and the phase), the one place that records
// timeline tasks (forward, recompute, backward and its halves here, copies in
// the transport), and moves no data itself.
//
// Around every stage call the executor sets: the stage's compute stream, the
// item's MicroBatch (micro_batch_of: the item itself in micro-batched calls;
// in time-step calls its micro-batch of the split, or 0 of 1 without one),
// the random draws of (stage, item) (Note [Random draws]) and the
// call's skip scope.

struct CallSpec {
  const char* method = "";     // for messages: "forward", "train_step", ...
  const char* item_name = "";  // "micro-batch", "time step"
  int64_t n_items = 0;
  /// Time chunks (Note [Time chunks]): how items map to time steps, for messages.
  TimeChunks time_chunks;
  /// One per worker ("rank"); each operation names its stage. Forwards only
  /// unless `training`.
  std::vector<schedules::Program> programs;
  /// Micro-batches of one batch: stage calls run under MicroBatchGuard{i, n}.
  bool micro_batched = false;
  /// The micro-batch a stage call of item i serves: item i of a micro-batched
  /// call, its micro-batch's in a time-step call (Note [Micro-batches over
  /// time]), else micro-batch 0 of 1.
  MicroBatch micro_batch_of(int64_t i) const {
    if (micro_batched) return {i, n_items};
    if (!time_chunks.split()) return {};
    return {time_chunks.micro_batch(i), time_chunks.micro_batches()};
  }
  /// Stage 0's inputs for item i, on the caller's devices. `same_input`: the
  /// same tensors for every item, so stage 0 receives them once.
  std::function<Tensors(int64_t)> source;
  bool same_input = false;
  /// The caller's tensors (inputs, targets): the call starts after the
  /// caller's work on their devices.
  Tensors caller_tensors;

  // Forward-type calls.
  /// Takes the last stage's outputs of item i, on its stream, in item order.
  std::function<void(int64_t, Tensors)> sink;

  // Training steps (Note [Training runtime]).
  bool training = false;
  const char* schedule = "";  // its name, for the timeline
  /// Time chunks chained by state (constant_train_step): stage 0 takes the
  /// caller's tensors as they are, the last stage gives its outputs to `sink`
  /// and, after the last item, backpropagates `chain_loss()`; each B(i, s)
  /// runs its chunk's nodes only (Note [Chained backward] in time_chunks.h).
  bool chained = false;
  std::function<at::Tensor()> chain_loss;
  /// Item i's targets, on the caller's devices.
  std::function<Tensors(int64_t)> target;
  /// The weighted loss of item i from the last stage's outputs and the targets
  /// (runs on the last stage, its stream current).
  std::function<at::Tensor(int64_t, const Tensors&, const Tensors&)> loss;
  /// Backward starts from each loss times this (GradScaler's scale); the
  /// losses reported are not scaled.
  double loss_scale = 1.0;
  Checkpoint checkpoint = Checkpoint::Never;
  /// Each stage's Stateful modules (Note [State snapshots]).
  const std::vector<std::vector<StatefulModule>>* stateful = nullptr;
  /// Which of stage 0's inputs need gradients (by position).
  std::vector<bool> input_requires_grad;
  /// mpipe::Linear sums its cast weight's gradients per stage and step (Note
  /// [Cast gradients per step]).
  bool accumulate_cast_grads = false;
  /// Results: the gradients of stage 0's inputs per item ([item][input]),
  /// each item's loss, detached, and on the rank of the last stage the
  /// step's loss: theirs summed in item order on the last stage's stream,
  /// before the caller's streams join the stages'.
  std::vector<Tensors> input_grads;
  std::vector<at::Tensor> losses;
  at::Tensor loss_sum;

  /// Forward calls: stage j (local index) computes item i on its device's
  /// lane i % `lanes` when `lane_stages[j]` (Note [Lanes]).
  int64_t lanes = 1;
  std::vector<bool> lane_stages;
  /// Records every task when the timeline is on (Note [Timeline]); else null.
  Recorder* recorder = nullptr;

  /// A call across processes (Note [Cross-process calls]): programs name
  /// global stages, and this process runs the operations of its own.
  CallLink* remote = nullptr;
};

/// A thread that runs queued tasks in order. Workers are shared by every
/// pipeline of the process (Note [Shared streams and workers]).
class Worker {
 public:
  Worker();
  ~Worker();
  void push(std::function<void()> fn);

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

/// Shared worker k (started at first use, never destroyed), the lock under
/// which a call queues its programs, and whether this thread is a worker
/// (Note [Shared streams and workers] in workers-inl.h).
Worker& shared_worker(size_t k);
std::mutex& queue_mutex();
bool on_shared_worker();

class Executor {
 public:
  Executor();
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  /// Prepares streams for a stage appended on `device`.
  void add_stage(c10::Device device);
  /// Across processes: this process's stages are global stages `global`
  /// (ascending) of `n_total`; `rank_note` (", rank 1") goes into error messages.
  void set_layout(const std::vector<int64_t>& global, int64_t n_total, std::string rank_note);
  /// Which stages this process holds, by global number.
  const StageMap& stage_map() const { return map_; }
  int64_t n_total() const { return map_.n_total(); }
  const std::vector<StagePlace>& stages() const { return stages_; }
  /// Stage `stage`'s compute stream (none for CPU stages).
  c10::optional<c10::Stream> compute_stream(size_t stage) const { return stages_[stage].compute; }

  /// Runs `call` through `forwards` (one per stage). Throws c10::Error naming
  /// the stage, its device, the item and the phase.
  void run(CallSpec& call, const std::vector<StageForward>& forwards, bool threaded);

 private:
  struct Run;

  /// The streams `call` computes on: a laned stage's first `call.lanes` lanes,
  /// another stage's own stream (Note [Lanes]).
  std::vector<c10::Stream> call_streams(const CallSpec& call) const;
  /// Each of `streams` waits for the caller's current stream on its device.
  static void fork(const std::vector<c10::Stream>& streams);
  /// The caller's current stream on each of `streams`' devices waits for it,
  /// so the caller sees all of the call's work.
  static void join(const std::vector<c10::Stream>& streams);
  void forward_action(Run& run, int64_t stage, int64_t item, const char*& phase);
  /// B(item) (full backward) or, with `split`, I(item): the gradients of the
  /// stage's inputs only, keeping the graph for weight_action.
  void backward_action(Run& run, int64_t stage, int64_t item, const char*& phase, bool split);
  /// Chained calls: runs again every chunk of item `item`'s micro-batch that
  /// the stage checkpointed (Note [Checkpointed time steps] in backward_actions-inl.h).
  void recompute(Run& run, int64_t stage, int64_t item, const char*& phase, bool split);
  /// W(item): the gradients of the stage's weights from the graph I kept.
  void weight_action(Run& run, int64_t stage, int64_t item);
  /// Runs one action, catching its failure; false when the call has failed
  /// (here or elsewhere) and the stage must stop.
  bool run_action(Run& run, const schedules::Op& op);
  void run_program(Run& run, const schedules::Program& program);
  /// A pair (Op::with_next): `a`, then `b`, then both's hand-offs (Note
  /// [DualPipeV]); false as run_action.
  bool run_pair(Run& run, const schedules::Op& a, const schedules::Op& b);
  /// Inside a catch block: the current exception as a c10::Error naming the
  /// call, the stage, its device, the phase and the item.
  std::exception_ptr describe_failure(const CallSpec& call, const char* phase, int64_t stage,
                                      int64_t item) const;

  const StagePlace& place(int64_t stage) const { return stages_[local(stage)]; }
  /// The stream stage `stage` computes item `item` of `call` on: a lane, or
  /// its compute stream (Note [Lanes]).
  c10::optional<c10::Stream> stream_for(const CallSpec& call, int64_t stage, int64_t item) const;
  /// Makes `k` lane streams for every CUDA device (Note [Lanes]).
  void ensure_lanes(int64_t k);
  size_t local(int64_t stage) const { return map_.at(stage); }

  std::vector<StagePlace> stages_;
  StageMap map_;            // every stage, until set_layout
  bool distributed_ = false;  // set_layout was called
  std::string rank_;
};

}  // namespace detail
}  // namespace mpipe
