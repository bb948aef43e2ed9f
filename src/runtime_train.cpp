// The training step's runtime: per-stage programs of forwards and backwards.

#include "runtime.h"

#include "recorder.h"
#include "streams.h"

#include "mpipe/checkpoint.h"
#include "mpipe/state.h"

#include <ATen/Context.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Generator.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <utility>

namespace mpipe {
namespace detail {

// Note [Training runtime]
// ~~~~~~~~~~~~~~~~~~~~~~~
// train_step cuts the autograd graph at every stage boundary: stage j's
// forward of micro-batch i runs on a detached copy of its input that requires
// grad, and keeps (input, output) until its backward. The last stage's
// forward also computes the micro-batch's weighted loss. Backward B(j, i) calls
// autograd on stage j's piece alone: backward(loss_i) on the last stage,
// backward(output, grad) elsewhere, where grad is the gradient of stage j's
// output that B(j + 1, i) produced (the .grad of its detached input). So each
// stage's backward is an operation the schedule can place, which is what lets
// 1F1B free a micro-batch's activations as soon as its backward ran.
//
// Each stage runs its program (schedule::gpipe or one_f_one_b) in order. With
// worker threads, stage j's program runs on worker j; an operation waits in
// stage j's mailbox for its activation or gradient. Without them, the caller
// runs the operations in schedule::simulate's tick order, where every input
// already exists. Activations and gradients travel as Handoffs, with the
// stream rules of Note [Pipeline runtime]; autograd runs each backward op on
// its forward op's stream, and the backward call's own thread has stage j's
// stream current, so the engine's final sync makes the input gradient safe to
// hand on from that stream.
//
// Checkpointing: a checkpointed forward runs under NoGradGuard and keeps only
// its input and the state of the stage's Stateful modules (Note [State
// snapshots]); its backward runs the stage again (under RecomputeGuard) from
// that module state, with the random draws of the same (stage, micro-batch)
// (Note [Random draws]), puts the module state back where it was, then
// backpropagates. Dropout therefore draws the same mask and a neuron advances
// once per micro-batch. On the last stage a checkpointed forward skips the
// loss: the recompute computes it, so loss_fn runs once per micro-batch in
// every mode. Losses are summed in micro-batch order at the end,
// so the returned loss does not depend on the schedule. Nothing is
// checkpointed in eval mode.
//
// After the step, the caller's streams wait for every stage stream (join) and
// parameter gradients are recorded on the caller's streams, so an optimizer
// step there is ordered after the backward, and the caching allocator does not
// hand a gradient's memory to a stage stream while the optimizer reads it.

namespace {

struct Aborted {};  // another stage failed: stop quietly

}  // namespace

struct Runtime::TrainCall {
  struct Saved {
    at::Tensor input;      // detached, requires grad (stage 0: if the input does)
    at::Tensor output;     // the backward root: output, or the loss on the last stage
    at::Tensor target;     // last stage, checkpointed: for the recomputed loss
    StateSnapshot state_before;  // checkpointed: the stage's module state before forward
    bool checkpointed = false;
  };
  struct Mailbox {
    std::map<std::pair<int, int64_t>, Handoff> items;
    std::condition_variable cv;
  };

  TrainJob* job = nullptr;
  const std::vector<StageForward>* forwards = nullptr;
  std::shared_ptr<c10::Event> input_entry, target_entry;
  at::ThreadLocalState tls;
  bool threaded = false;
  std::vector<std::vector<Saved>> saved;  // [stage][micro-batch]
  std::vector<at::Tensor> losses;         // [micro-batch], written by the last stage

  std::mutex mutex;  // guards everything below
  std::vector<Mailbox> mailboxes;
  bool failed = false;
  std::exception_ptr error;
  int64_t finished = 0;
  std::condition_variable done;

  void put(int64_t stage, schedule::OpKind kind, int64_t item, Handoff h) {
    std::lock_guard<std::mutex> lock(mutex);
    auto& box = mailboxes[static_cast<size_t>(stage)];
    box.items[{static_cast<int>(kind), item}] = std::move(h);
    box.cv.notify_one();
  }

  Handoff take(int64_t stage, schedule::OpKind kind, int64_t item) {
    std::unique_lock<std::mutex> lock(mutex);
    auto& box = mailboxes[static_cast<size_t>(stage)];
    const std::pair<int, int64_t> key{static_cast<int>(kind), item};
    if (threaded) {
      box.cv.wait(lock, [&] { return failed || box.items.count(key) > 0; });
    }
    if (failed) throw Aborted{};
    auto it = box.items.find(key);
    TORCH_INTERNAL_ASSERT(it != box.items.end(), "mpipe: schedule delivered no input");
    Handoff h = std::move(it->second);
    box.items.erase(it);
    return h;
  }

  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!error) error = std::move(e);
    failed = true;
    for (auto& box : mailboxes) box.cv.notify_all();
  }
};

void Runtime::train_forward(TrainCall& call, int64_t j, int64_t i, const char*& phase) {
  TrainJob& job = *call.job;
  const Stage& stage = stages_[static_cast<size_t>(j)];
  const bool last = j + 1 == static_cast<int64_t>(stages_.size());
  at::Tensor in = j == 0 ? receive(Handoff{job.input(i), call.input_entry}, 0, job.recorder, i)
                         : receive(call.take(j, schedule::OpKind::Forward, i), j, job.recorder, i);
  auto& sv = call.saved[static_cast<size_t>(j)][static_cast<size_t>(i)];
  sv.checkpointed = checkpointed(job.checkpoint, i, job.n_items);
  sv.input = in.detach().requires_grad_(j > 0 || job.input_requires_grad);

  c10::OptionalStreamGuard stream_guard(stage.compute);
  MicroBatchGuard micro_batch({i, job.n_items});
  // Ends before the hand-off, so the next stage's task starts after it.
  c10::optional<TaskSpan> span;
  span.emplace(job.recorder, j, i, TaskKind::Forward, stage.device, stage.compute);
  at::Tensor out;
  {
    RngScope draws(job.rng, j, i);  // the recompute draws the same (Note [Random draws])
    if (sv.checkpointed) {
      if (job.stateful) sv.state_before = StateSnapshot((*job.stateful)[static_cast<size_t>(j)]);
      c10::NoGradGuard no_grad;
      out = (*call.forwards)[static_cast<size_t>(j)](sv.input);
    } else {
      out = (*call.forwards)[static_cast<size_t>(j)](sv.input);
    }
  }
  TORCH_CHECK(out.defined(), "the stage returned an undefined tensor");
  if (last) {
    const at::Tensor target = receive(Handoff{job.target(i), call.target_entry}, j, job.recorder, i);
    if (sv.checkpointed) {
      sv.target = target;  // the recompute computes the loss
    } else {
      phase = "loss of micro-batch";
      sv.output = job.loss(i, out, target);
      call.losses[static_cast<size_t>(i)] = sv.output.detach();
    }
    return;
  }
  if (!sv.checkpointed) sv.output = out;
  span.reset();
  call.put(j + 1, schedule::OpKind::Forward, i,
           Handoff{out.detach(), stage.compute ? record_event(*stage.compute) : nullptr});
}

void Runtime::train_backward(TrainCall& call, int64_t j, int64_t i, const char*& phase) {
  TrainJob& job = *call.job;
  const Stage& stage = stages_[static_cast<size_t>(j)];
  const bool last = j + 1 == static_cast<int64_t>(stages_.size());
  auto& sv = call.saved[static_cast<size_t>(j)][static_cast<size_t>(i)];
  at::Tensor grad;
  if (!last) grad = receive(call.take(j, schedule::OpKind::Backward, i), j, job.recorder, i);

  c10::OptionalStreamGuard stream_guard(stage.compute);
  MicroBatchGuard micro_batch({i, job.n_items});
  at::Tensor root = sv.output;
  if (sv.checkpointed) {
    phase = "recompute of micro-batch";
    TaskSpan span(job.recorder, j, i, TaskKind::Recompute, stage.device, stage.compute);
    RngScope draws(job.rng, j, i);  // the forward's draws again (Note [Random draws])
    // Run from the module state the forward started from, then put back the
    // state of now (Note [State snapshots]).
    struct Reload {
      StateSnapshot now;
      ~Reload() {
        try {
          now.load();
        } catch (...) {  // an error already on its way is the one to report
        }
      }
    } reload{sv.state_before.empty() ? StateSnapshot()
                                     : StateSnapshot((*job.stateful)[static_cast<size_t>(j)])};
    sv.state_before.load();
    RecomputeGuard recompute;
    at::Tensor out = (*call.forwards)[static_cast<size_t>(j)](sv.input);
    if (last) {
      phase = "loss of micro-batch";
      root = job.loss(i, out, sv.target);
      call.losses[static_cast<size_t>(i)] = root.detach();
    } else {
      root = out;
    }
  }
  phase = "backward of micro-batch";
  c10::optional<TaskSpan> span;  // ends before the hand-off, as in train_forward
  span.emplace(job.recorder, j, i, TaskKind::Backward, stage.device, stage.compute);
  if (root.requires_grad()) {
    if (last) {
      torch::autograd::backward({root});
    } else {
      torch::autograd::backward({root}, {grad});
    }
  }
  at::Tensor input_grad = sv.input.grad();
  if (!input_grad.defined() && sv.input.requires_grad()) input_grad = at::zeros_like(sv.input);
  span.reset();
  if (j > 0) {
    call.put(j - 1, schedule::OpKind::Backward, i,
             Handoff{input_grad, stage.compute ? record_event(*stage.compute) : nullptr});
  } else if (job.input_requires_grad) {
    job.input_grads[static_cast<size_t>(i)] = input_grad;
  }
  sv = TrainCall::Saved{};  // this micro-batch's activations are free now
}

void Runtime::run_program(TrainCall& call, int64_t j) {
  for (const schedule::Op& op : call.job->programs[static_cast<size_t>(j)]) {
    const bool forward = op.kind == schedule::OpKind::Forward;
    const char* phase = forward ? "forward of micro-batch" : "backward of micro-batch";
    try {
      at::ThreadLocalStateGuard tls_guard(call.tls);
      if (forward) {
        train_forward(call, j, op.micro_batch, phase);
      } else {
        train_backward(call, j, op.micro_batch, phase);
      }
    } catch (const Aborted&) {
      return;
    } catch (...) {
      call.fail(describe_failure("train_step", phase, call.job->n_items, j, op.micro_batch));
      return;
    }
  }
}

void Runtime::train(TrainJob& job, const std::vector<StageForward>& forwards, bool threaded,
                    const at::Tensor& input, const at::Tensor& target,
                    const std::vector<std::vector<at::Tensor>>& params) {
  const auto n_stages = static_cast<int64_t>(stages_.size());
  TORCH_INTERNAL_ASSERT(forwards.size() == stages_.size() && params.size() == stages_.size());
  schedule::validate(job.programs, job.n_items);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(job.programs.size()) == n_stages);
  job.input_grads.assign(static_cast<size_t>(job.n_items), at::Tensor());
  job.loss_sum = at::Tensor();
  job.rng = CallRng::begin(devices());

  auto call = std::make_shared<TrainCall>();
  call->job = &job;
  call->forwards = &forwards;
  call->threaded = threaded;
  call->saved.assign(static_cast<size_t>(n_stages),
                     std::vector<TrainCall::Saved>(static_cast<size_t>(job.n_items)));
  call->mailboxes = std::vector<TrainCall::Mailbox>(static_cast<size_t>(n_stages));
  call->losses.assign(static_cast<size_t>(job.n_items), at::Tensor());
  if (!input.device().is_cpu()) call->input_entry = record_event(current_stream(input.device()));
  if (!target.device().is_cpu()) call->target_entry = record_event(current_stream(target.device()));
  fork();

  if (threaded) {
    ensure_workers();
    for (int64_t j = 0; j < n_stages; ++j) {
      workers_[static_cast<size_t>(j)]->push([this, c = call, j]() mutable {
        run_program(*c, j);
        TrainCall& done = *c;
        c.reset();  // before the caller can move on (Note [Call ownership])
        std::lock_guard<std::mutex> lock(done.mutex);
        ++done.finished;
        done.done.notify_all();
      });
    }
    std::unique_lock<std::mutex> lock(call->mutex);
    call->done.wait(lock, [&] { return call->finished == n_stages; });
  } else {
    for (const auto& tick : schedule::simulate(job.programs)) {
      for (const auto& t : tick) {
        at::ThreadLocalStateGuard tls_guard(call->tls);
        const bool forward = t.op.kind == schedule::OpKind::Forward;
        const char* phase = forward ? "forward of micro-batch" : "backward of micro-batch";
        try {
          if (forward) {
            train_forward(*call, t.stage, t.op.micro_batch, phase);
          } else {
            train_backward(*call, t.stage, t.op.micro_batch, phase);
          }
        } catch (...) {
          call->fail(describe_failure("train_step", phase, job.n_items, t.stage, t.op.micro_batch));
          break;
        }
      }
      if (call->failed) break;
    }
  }

  if (!call->error) {  // the step's loss, on the last stage's stream
    c10::OptionalStreamGuard last_stage(stages_.back().compute);
    for (const auto& loss : call->losses) {
      job.loss_sum = job.loss_sum.defined() ? job.loss_sum + loss : loss;
    }
  }
  join();
  call->saved.clear();  // a failed step leaves activations behind: drop them
  if (call->error) std::rethrow_exception(call->error);
  for (size_t j = 0; j < stages_.size(); ++j) {
    if (!stages_[j].compute) continue;
    const c10::Stream caller = current_stream(stages_[j].device);
    for (const auto& p : params[j]) record_on(p.grad(), caller);
  }
  if (stages_.back().compute) record_on(job.loss_sum, current_stream(stages_.back().device));
  if (stages_.front().compute) {
    for (const auto& g : job.input_grads) record_on(g, current_stream(stages_.front().device));
  }
}

}  // namespace detail
}  // namespace mpipe
