#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/executor.h"

#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/backward_scope.h"
#include "mpipe/detail/precision/cast_grads.h"
#include "mpipe/detail/runtime/chunk_chain.h"
#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/recorder.h"
#include "mpipe/detail/distributed/remote.h"
#include "mpipe/detail/runtime/skips.h"
#include "mpipe/detail/runtime/split_backward.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <atomic>
#include <map>
#include <set>
#include <string>
#include <utility>

namespace mpipe {
namespace detail {

// Note [Training runtime]
// ~~~~~~~~~~~~~~~~~~~~~~~
// train_step cuts the autograd graph at every stage boundary: stage j's
// forward of micro-batch i runs on detached copies of its inputs that require
// grad (floating-point ones; stage 0's only where the caller's do), and keeps
// (inputs, outputs) until its backward. The last stage's forward also computes
// the micro-batch's weighted loss. B(j, i) calls autograd on stage j's piece
// alone: backward(loss_i) on the last stage, backward(outputs, grads)
// elsewhere, where grads are the gradients of stage j's outputs that B(j + 1,
// i) sent back (the .grad of its detached inputs). So each stage's backward is
// an action the schedule can place, which is what lets 1F1B free a
// micro-batch's activations as soon as its backward ran. Autograd runs each
// backward op on its forward op's stream, and the backward call's own thread
// has stage j's stream current, so the engine's final sync makes the input
// gradients safe to hand on from that stream.
//
// Checkpointing: a checkpointed forward runs under NoGradGuard and keeps only
// its inputs (and what it popped) and the state of the stage's Stateful
// modules (Note [State snapshots]); its backward runs the stage again (under
// RecomputeGuard) from that module state, with the random draws of the same
// (stage, micro-batch) (Note [Random draws]), puts the module state back where
// it was, then backpropagates. Dropout therefore draws the same mask and a
// neuron advances once per micro-batch. On the last stage a checkpointed
// forward skips the loss: the recompute computes it, so loss_fn runs once per
// micro-batch in every mode. Losses are summed in micro-batch order after the
// step, so the returned loss does not depend on the schedule. Nothing is
// checkpointed in eval mode.

// Note [Call ownership]
// ~~~~~~~~~~~~~~~~~~~~~
// The state of a threaded call (its error included) is shared by the caller
// and the workers, by shared_ptr. A worker drops its reference *before* it
// tells the caller that it is done; the caller holds its own until it has seen
// every worker done. So the call's state, and the c10::Error in it, always die
// on the caller's thread, never on a worker after the caller has moved on
// (ThreadSanitizer could not order such a destruction: the exception's
// reference count lives in uninstrumented libstdc++).

// Note [Shared streams and workers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Stage streams and worker threads belong to the process, not to a pipeline:
// the k-th stage on a device computes on that device's k-th shared compute
// stream, copies use shared copy streams, and stage k's program runs on shared
// worker k. Per-pipeline streams and threads leaked GPU memory: LibTorch keeps
// a cuBLAS workspace per (handle, stream) pair for the life of the process,
// and handles are per thread, so every pipeline with fresh streams and fresh
// threads added workspaces (about 260 MiB per 4-stage pipeline on an H200)
// until the 32 pool streams per device were used up. With shared streams and
// workers the pairs repeat and memory stays flat however many pipelines a
// program builds.
//
// Pipelines called at the same time from different threads share the
// workers. A call queues all its stage programs under one process-wide lock,
// so every worker sees calls in the same order and a call's programs never
// wait behind a later call's (which could deadlock: A's stage 0 waiting for
// A's stage 1, queued behind B's stage 1, waiting for B's stage 0, queued
// behind A's). Such calls therefore run one after the other on the workers,
// as their GPU work would on shared streams. A call made from inside a stage
// (on a worker thread) runs inline, so it never waits for its own worker.

MPIPE_INLINE_VAR thread_local bool t_on_worker = false;

MPIPE_FUNC std::mutex& queue_mutex() {
  static std::mutex m;
  return m;
}

/// Shared worker k, started at first use and never destroyed.
MPIPE_FUNC Worker& shared_worker(size_t k) {
  static std::mutex mutex;
  static auto* workers = new std::vector<std::unique_ptr<Worker>>();
  std::lock_guard<std::mutex> lock(mutex);
  while (workers->size() <= k) workers->push_back(std::make_unique<Worker>());
  return *(*workers)[k];
}

MPIPE_FUNC Worker::Worker() : thread_([this] { loop(); }) {}

MPIPE_FUNC Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

MPIPE_FUNC void Worker::push(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

MPIPE_FUNC void Worker::loop() {
  t_on_worker = true;
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();          // tasks catch their own errors (Executor::run_program)
    fn = nullptr;  // release what the task captured (tensors) before waiting
  }
}


MPIPE_FUNC bool can_require_grad(const at::Tensor& t) {
  return t.defined() && (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()));
}

/// A detached copy of `t` that requires grad when `grad` and it can.
MPIPE_FUNC at::Tensor leaf(const at::Tensor& t, bool grad) {
  if (!t.defined()) return t;
  at::Tensor out = t.detach();
  if (grad && can_require_grad(out)) out.requires_grad_(true);
  return out;
}

/// The gradient a leaf got in backward; undefined when it got none.
MPIPE_FUNC at::Tensor grad_of(const at::Tensor& leaf) {
  return leaf.defined() && leaf.requires_grad() ? leaf.grad() : at::Tensor();
}

/// An error that already says what happened and where: run_action reports it
/// as it is instead of as a failure of the action that found it.
struct DescribedFailure {
  std::exception_ptr error;
};


struct Executor::Run {
  struct Saved {
    Tensors inputs;   // detached leaves
    Tensors outputs;  // backward roots: the outputs, or {loss} on the last stage
    Tensors targets;  // last stage, checkpointed: for the recomputed loss
    std::map<std::string, at::Tensor> stashed;  // roots, with gradients from the poppers
    std::map<std::string, at::Tensor> popped;   // leaves, their gradients go to...
    std::map<std::string, int64_t> popped_from;  // ...the stasher
    StateSnapshot state_before;  // checkpointed: the stage's module state before forward
    bool checkpointed = false;
    WeightPass weights;  // split backward: prepared by I(i), run by W(i)
    ChunkNodes nodes;    // chained: the nodes the forward made (Note [Chained backward])
  };

  CallSpec* call = nullptr;
  const std::vector<StageForward>* forwards = nullptr;
  std::unique_ptr<LocalTransport> local;
  std::unique_ptr<RemoteTransport> remote;  // a call across processes
  Transport* transport = nullptr;           // remote, else local
  std::map<std::string, std::shared_ptr<c10::Event>> entries;  // by device: the caller's work
  at::ThreadLocalState tls;
  AutocastState autocast = AutocastState::current();  // Note [Autocast in the pipeline]
  CallRng rng;
  SkipTable skips;
  Tensors stage0_input;                   // same_input: received once
  std::vector<std::vector<Saved>> saved;  // [stage][item], training only
  std::vector<std::unique_ptr<CastGrads>> cast_grads;  // [stage]: Note [Cast gradients per step]
  std::vector<ChunkChain> chains;                      // [stage], chained calls
  std::set<const torch::autograd::Node*> stops;        // chained: the caller's inputs' nodes

  std::mutex mutex;  // guards what follows
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  int64_t finished = 0;
  int64_t expected = 0;  // worker programs queued
  std::condition_variable done;

  void fail(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::move(e);
    }
    failed.store(true, std::memory_order_release);
    transport->abort();
  }

  /// The caller's tensors made usable by stage `to`.
  Tensors from_caller(int64_t to, int64_t item, Tensors values) const {
    for (auto& v : values) {
      if (!v.defined()) continue;
      auto it = entries.find(v.device().str());
      v = local->accept(to, item, {v}, it == entries.end() ? nullptr : it->second)[0];
    }
    return values;
  }
};

MPIPE_FUNC Executor::Executor() = default;
MPIPE_FUNC Executor::~Executor() = default;

MPIPE_FUNC void Executor::add_stage(c10::Device device) {
  StagePlace stage{device, c10::nullopt, c10::nullopt, {}};
  // Note [Shared streams and workers]: the k-th stage on a device, the k-th
  // boundary leaving a device.
  size_t on_device = 0;
  for (const auto& s : stages_) on_device += s.device == device;
  if (!device.is_cpu()) stage.compute = shared_stream(device, StreamRole::Compute, on_device);
  if (!stages_.empty()) {
    const c10::Device prev = stages_.back().device;
    size_t from_prev = 0;
    for (const auto& s : stages_) from_prev += s.copy_in && s.copy_in->device() == prev;
    if (!prev.is_cpu() && prev != device) {
      stage.copy_in = shared_stream(prev, StreamRole::Copy, from_prev);
    }
  }

  stages_.push_back(stage);
}

// Note [Lanes]
// ~~~~~~~~~~~~
// On one GPU a small stage's kernels fill a fraction of it (narrow-mlp: a GEMM
// of 64 x 1024 x 1024 runs on 16 of the H200's 132 SMs), and one stream per
// stage lets at most one micro-batch per stage run at a time. With lanes(k), a
// forward call computes micro-batch i of stage j on lane i % k of the stage:
// lane 0 is its compute stream, lanes 1..k-1 are shared streams of their own.
// A value's event is recorded on the lane that produced it and waited for on
// the lane that consumes it (Note [Hand-offs]); fork() and join() cover every
// lane, so a CUDA graph captures them too. Micro-batches of one stage are
// independent only when the stage keeps no state, so stages with buffers or
// stateful modules, training steps (whose backward follows each forward's
// stream) and time-step calls keep one stream. The values are the same: each
// micro-batch runs the same kernels, only their order on the GPU changes.

MPIPE_FUNC c10::optional<c10::Stream> Executor::stream_for(const CallSpec& call, int64_t j,
                                                           int64_t i) const {
  const StagePlace& stage = place(j);
  if (call.lanes <= 1 || !stage.compute || !call.lane_stages[local(j)]) return stage.compute;
  const auto lane = static_cast<size_t>(i % call.lanes);
  if (lane == 0 || lane > stage.lanes.size()) return stage.compute;
  return stage.lanes[lane - 1];
}

MPIPE_FUNC void Executor::ensure_lanes(int64_t k) {
  for (size_t j = 0; j < stages_.size(); ++j) {
    StagePlace& stage = stages_[j];
    if (!stage.compute) continue;
    size_t on_device = 0;
    for (size_t q = 0; q < j; ++q) on_device += stages_[q].device == stage.device;
    // Slots past the stages' own (Note [Shared streams and workers]).
    while (static_cast<int64_t>(stage.lanes.size()) + 1 < k) {
      stage.lanes.push_back(shared_stream(stage.device, StreamRole::Compute,
                                          64 + 16 * on_device + stage.lanes.size()));
    }
  }
}

MPIPE_FUNC void Executor::forward_action(Run& run, int64_t j, int64_t i, const char*& phase) {
  CallSpec& call = *run.call;
  const StagePlace& stage = place(j);
  const c10::optional<c10::Stream> compute = stream_for(call, j, i);  // Note [Lanes]
  const bool last = j + 1 == n_total();
  const uint64_t first_node = ChunkNodes::now();
  Tensors in;
  if (j == 0 && call.same_input && i > 0) {
    in = run.stage0_input;
  } else if (j == 0) {
    in = run.from_caller(0, i, call.source(i));
    if (call.same_input) run.stage0_input = in;
  } else {
    in = run.transport->receive(j, Key{Key::Activation, i, {}});
  }
  Run::Saved* sv = call.training ? &run.saved[local(j)][static_cast<size_t>(i)]
                                 : nullptr;
  const bool ckpt = call.training && checkpointed(call.checkpoint, i, call.n_items);
  if (sv && !(call.chained && j == 0)) {  // chained: the caller's graph is the chain's
    sv->checkpointed = ckpt;
    for (size_t k = 0; k < in.size(); ++k) {
      in[k] = leaf(in[k], j > 0 || (k < call.input_requires_grad.size() &&
                                    call.input_requires_grad[k]));
    }
    sv->inputs = in;
  }

  c10::OptionalStreamGuard stream_guard(compute);
  MicroBatchGuard micro_batch(call.micro_batched ? MicroBatch{i, call.n_items} : MicroBatch{});
  // Ends before the hand-off, so the next stage's task starts after it.
  c10::optional<TaskSpan> span;
  span.emplace(call.recorder, j, i, TaskKind::Forward, stage.device, compute);
  Tensors out;
  {
    RngScope draws(run.rng, j, i);
    std::map<std::string, at::Tensor> own;  // training: this stage's stashes, as stashed
    SkipScope skips(
        [&](const std::string& name, at::Tensor t) {
          run.skips.stash(name, i, j);
          if (sv) {
            own[name] = t;
            if (!ckpt) sv->stashed[name] = t;
          }
          run.transport->send(j, -1, Key{Key::Skip, i, name}, {sv ? t.detach() : t});
        },
        [&](const std::string& name) {
          const int64_t from = run.skips.pop(name, i, j);
          at::Tensor t = run.transport->receive(j, Key{Key::Skip, i, name})[0];
          if (sv && from == j) {
            // Stashed and popped by this stage: no boundary for the gradient to cross.
            t = own.at(name);
            sv->stashed.erase(name);
          } else if (sv) {
            t = leaf(t, true);
            sv->popped[name] = t;
            sv->popped_from[name] = from;
          }
          return t;
        });
    CastGradsGuard casts(run.cast_grads.empty() ? nullptr : run.cast_grads[local(j)].get());
    if (ckpt) {
      if (call.stateful) sv->state_before = StateSnapshot((*call.stateful)[local(j)]);
      c10::NoGradGuard no_grad;
      // No cast made here may enter autocast's cache: made without grad, it
      // would serve the recompute, and no gradient would reach its weight.
      AutocastState uncached = AutocastState::current();
      uncached.cache = false;
      AutocastScope autocast(uncached);
      out = (*run.forwards)[local(j)](in);
    } else {
      out = (*run.forwards)[local(j)](in);
    }
  }
  TORCH_CHECK(!out.empty(), "the stage returned no tensor");
  for (size_t k = 0; k < out.size(); ++k) {
    TORCH_CHECK(out[k].defined(), "the stage returned an undefined tensor",
                out.size() > 1 ? c10::str(" (output ", k, " of ", out.size(), ")") : "");
  }
  if (last) {
    // Every stage ran item i: a stash no stage popped is an error of its
    // stasher, not of this stage's loss or output (Note [Skip connections]).
    const auto unpopped = run.skips.unpopped(i);
    if (unpopped.second >= 0) {
      const int64_t s = unpopped.second;
      const bool here = s >= first_ && local(s) < stages_.size();  // else on another rank
      try {
        TORCH_CHECK(false, "mpipe::ModelPipeline::", call.method, ": stage ", s,
                    here ? c10::str(" (on ", place(s).device, rank_, ")") : std::string(),
                    " stashed '", unpopped.first, "' for ", call.item_name, " ", i, " of ",
                    call.n_items, call.time_chunks.steps_of(i), ", but no stage popped it (",
                    s == j ? c10::str("stage ", s, " did not, and no stage follows it")
                           : c10::str("neither stage ", s, " itself nor a later stage did"),
                    "; each stash is popped once, by the stashing stage or a later one)");
      } catch (...) {
        throw DescribedFailure{std::current_exception()};
      }
    }
    if (call.chained) {
      call.sink(i, std::move(out));
      if (i + 1 == call.n_items) {
        phase = call.time_chunks.multi() ? "the loss, after time chunk"
                                         : "the loss, after time step";
        at::Tensor loss = call.chain_loss();
        call.losses[static_cast<size_t>(i)] = loss.detach();
        sv->outputs = {loss};
      }
      sv->nodes = ChunkNodes{first_node, ChunkNodes::now()};
    } else if (call.training) {
      Tensors targets = run.from_caller(j, i, call.target(i));
      if (ckpt) {
        sv->targets = std::move(targets);  // the recompute computes the loss
      } else {
        phase = "loss of micro-batch";
        at::Tensor loss = call.loss(i, out, targets);
        call.losses[static_cast<size_t>(i)] = loss.detach();
        sv->outputs = {loss};
      }
    } else {
      call.sink(i, std::move(out));
    }
    return;
  }
  if (sv && !ckpt) sv->outputs = out;
  if (sv) sv->nodes = ChunkNodes{first_node, ChunkNodes::now()};
  span.reset();
  if (sv) {
    for (auto& t : out) t = t.detach();
  }
  run.transport->send(j, j + 1, Key{Key::Activation, i, {}}, std::move(out));
}

MPIPE_FUNC void Executor::backward_action(Run& run, int64_t j, int64_t i, const char*& phase,
                                          bool split) {
  CallSpec& call = *run.call;
  const StagePlace& stage = place(j);
  const bool last = j + 1 == n_total();
  Run::Saved& sv = run.saved[local(j)][static_cast<size_t>(i)];
  Tensors grads;
  if (!last) grads = run.transport->receive(j, Key{Key::Gradient, i, {}});

  c10::OptionalStreamGuard stream_guard(stage.compute);
  MicroBatchGuard micro_batch(call.micro_batched ? MicroBatch{i, call.n_items} : MicroBatch{});
  Tensors roots = sv.outputs;
  std::map<std::string, at::Tensor> stashed = sv.stashed;
  if (sv.checkpointed) {
    phase = "recompute of micro-batch";
    TaskSpan span(call.recorder, j, i, TaskKind::Recompute, stage.device, stage.compute);
    RngScope draws(run.rng, j, i);  // the forward's draws again (Note [Random draws])
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
                                     : StateSnapshot((*call.stateful)[local(j)])};
    sv.state_before.load();
    RecomputeGuard recompute;
    CastGradsGuard casts(run.cast_grads.empty() ? nullptr : run.cast_grads[local(j)].get());
    SkipScope skips(
        [&](const std::string& name, at::Tensor t) { stashed[name] = std::move(t); },
        [&](const std::string& name) {
          auto it = sv.popped.find(name);
          if (it != sv.popped.end()) return it->second;
          auto own = stashed.find(name);  // stashed by this stage's recompute
          TORCH_CHECK(own != stashed.end(), "pop('", name,
                      "'): the recompute popped a name its forward did not");
          at::Tensor t = own->second;
          stashed.erase(own);
          return t;
        });
    Tensors out = (*run.forwards)[local(j)](sv.inputs);
    if (last) {
      phase = "loss of micro-batch";
      at::Tensor loss = call.loss(i, out, sv.targets);
      call.losses[static_cast<size_t>(i)] = loss.detach();
      roots = {loss};
    } else {
      roots = std::move(out);
    }
  }
  if (sv.checkpointed) phase = split ? "input gradient of micro-batch" : "backward of micro-batch";
  c10::optional<TaskSpan> span;  // ends before the hand-off, as in forward_action
  span.emplace(call.recorder, j, i, split ? TaskKind::BackwardInput : TaskKind::Backward,
               stage.device, stage.compute);
  std::vector<at::Tensor> r, g;
  for (size_t k = 0; k < roots.size(); ++k) {
    if (!roots[k].requires_grad()) continue;
    if (last) {
      r.push_back(roots[k]);
      g.emplace_back();  // the loss: implicitly 1
    } else if (k < grads.size() && grads[k].defined()) {
      r.push_back(roots[k]);
      g.push_back(grads[k]);
    }
  }
  for (const auto& s : stashed) {
    at::Tensor gs = run.transport->receive(j, Key{Key::SkipGradient, i, s.first})[0];
    if (s.second.requires_grad() && gs.defined()) {
      r.push_back(s.second);
      g.push_back(gs);
    }
  }
  Tensors input_grads(sv.inputs.size());
  std::map<std::string, at::Tensor> popped_grads;
  BackwardScope backward_scope;  // Note [Backward on the worker's thread]
  if (call.chained) {  // Note [Chained backward]: chunk i's nodes, from the last chunk down
    Tensors leaves = sv.inputs;
    for (const auto& p : sv.popped) leaves.push_back(p.second);
    const Tensors got = run.chains[local(j)].backward(r, g, sv.nodes, leaves,
                                                      /*final=*/i == 0, run.stops);
    for (size_t k = 0; k < sv.inputs.size(); ++k) input_grads[k] = got[k];
    size_t at = sv.inputs.size();
    for (const auto& p : sv.popped) popped_grads[p.first] = got[at++];
  } else if (!split) {
    if (!r.empty()) torch::autograd::backward(r, g);
    for (size_t k = 0; k < sv.inputs.size(); ++k) input_grads[k] = grad_of(sv.inputs[k]);
    for (const auto& p : sv.popped) popped_grads[p.first] = grad_of(p.second);
  } else {
    // Note [Split backward]: the gradients of the inputs now, keeping the
    // graph (and the gradients W needs) for W(i).
    std::vector<at::Tensor> xs;
    for (const auto& x : sv.inputs) {
      if (x.defined() && x.requires_grad()) xs.push_back(x);
    }
    for (const auto& p : sv.popped) xs.push_back(p.second);
    if (!r.empty()) {
      sv.weights = WeightPass(r, g, xs);
      if (!xs.empty()) {
        const auto gx = torch::autograd::grad(r, xs, g, /*retain_graph=*/true,
                                              /*create_graph=*/false, /*allow_unused=*/true);
        size_t at = 0;
        for (size_t k = 0; k < sv.inputs.size(); ++k) {
          if (sv.inputs[k].defined() && sv.inputs[k].requires_grad()) input_grads[k] = gx[at++];
        }
        for (const auto& p : sv.popped) popped_grads[p.first] = gx[at++];
      }
    }
  }
  for (const auto& p : popped_grads) {
    run.transport->send(j, sv.popped_from.at(p.first), Key{Key::SkipGradient, i, p.first},
                        {p.second});
  }
  span.reset();
  if (j > 0) {
    run.transport->send(j, j - 1, Key{Key::Gradient, i, {}}, std::move(input_grads));
  } else {
    call.input_grads[static_cast<size_t>(i)] = std::move(input_grads);
  }
  if (!split) sv = Run::Saved{};  // this micro-batch's activations are free now
}

MPIPE_FUNC void Executor::weight_action(Run& run, int64_t j, int64_t i) {
  CallSpec& call = *run.call;
  const StagePlace& stage = place(j);
  Run::Saved& sv = run.saved[local(j)][static_cast<size_t>(i)];
  c10::OptionalStreamGuard stream_guard(stage.compute);
  MicroBatchGuard micro_batch({i, call.n_items});
  {
    TaskSpan span(call.recorder, j, i, TaskKind::BackwardWeight, stage.device, stage.compute);
    BackwardScope backward_scope;  // Note [Backward on the worker's thread]
    sv.weights.run();
  }
  sv = Run::Saved{};  // this micro-batch's activations are free now
}

MPIPE_FUNC std::exception_ptr Executor::describe_failure(const CallSpec& call, const char* phase,
                                                         int64_t j, int64_t i) const {
  const std::string what = message_of(std::current_exception());
  try {
    TORCH_CHECK(false, "mpipe::ModelPipeline::", call.method, ": stage ", j, " (on ",
                place(j).device, rank_, ") failed at ", phase, " ", i, " of ",
                call.n_items, call.time_chunks.steps_of(i), ": ", what);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;  // unreachable
}

MPIPE_FUNC bool Executor::run_action(Run& run, const schedules::Op& op) {
  using schedules::OpKind;
  const int64_t j = op.stage, i = op.micro_batch;
  const bool chunks = run.call->time_chunks.multi();
  const char* phase = !run.call->training || (run.call->chained && op.kind == OpKind::Forward)
                          ? run.call->item_name
                      : run.call->chained ? (chunks ? "backward of time chunk" : "backward of time step")
                      : op.kind == OpKind::Forward        ? "forward of micro-batch"
                      : op.kind == OpKind::BackwardWeight ? "weight gradient of micro-batch"
                      : op.kind == OpKind::BackwardInput  ? "input gradient of micro-batch"
                                                          : "backward of micro-batch";
  try {
    switch (op.kind) {
      case OpKind::Forward: forward_action(run, j, i, phase); break;
      case OpKind::Backward: backward_action(run, j, i, phase, /*split=*/false); break;
      case OpKind::BackwardInput: backward_action(run, j, i, phase, /*split=*/true); break;
      case OpKind::BackwardWeight: weight_action(run, j, i); break;
    }
    return true;
  } catch (const Aborted&) {  // the call failed elsewhere
    return false;
  } catch (const DescribedFailure& f) {
    run.fail(f.error);
    return false;
  } catch (...) {
    run.fail(describe_failure(*run.call, phase, j, i));
    return false;
  }
}

MPIPE_FUNC void Executor::run_program(Run& run, const schedules::Program& program) {
  at::ThreadLocalStateGuard tls_guard(run.tls);  // the caller's grad mode, dispatch keys, ...
  AutocastScope autocast(run.autocast);           // ... and autocast (Note [Autocast in the pipeline])
  struct ClearCasts {
    bool on;
    ~ClearCasts() {
      if (on) clear_autocast_cache();
    }
  } clear_casts{run.autocast.any() && autocast_cache_per_thread()};
  for (const schedules::Op& op : program) {
    if (!run_action(run, op)) return;
  }
}

MPIPE_FUNC void Executor::set_layout(int64_t first, int64_t n_total, std::string rank_note) {
  first_ = first;
  n_total_ = n_total;
  rank_ = std::move(rank_note);
}

MPIPE_FUNC void Executor::run(CallSpec& call, const std::vector<StageForward>& forwards,
                              bool threaded) {
  const int64_t n_stages = n_total();
  const auto n_local = static_cast<int64_t>(stages_.size());
  TORCH_INTERNAL_ASSERT(n_local > 0 && forwards.size() == stages_.size() && call.n_items > 0);
  TORCH_INTERNAL_ASSERT(call.remote || n_local == n_stages);
  const auto n_ranks = static_cast<int64_t>(call.programs.size());
  TORCH_INTERNAL_ASSERT(n_ranks > 0 && n_ranks <= n_stages);
  schedules::validate(call.programs, n_stages, call.n_items, call.training);
  if (call.training) {
    call.input_grads.assign(static_cast<size_t>(call.n_items), Tensors());
    call.losses.assign(static_cast<size_t>(call.n_items), at::Tensor());
  }
  // Across processes, each program keeps the operations of this process's
  // stages (Note [Cross-process calls]).
  auto mine = [&](const schedules::Op& op) {
    return op.stage >= first_ && op.stage < first_ + n_local;
  };
  std::vector<schedules::Program> programs;
  for (const auto& program : call.programs) {
    schedules::Program kept;
    for (const auto& op : program) {
      if (mine(op)) kept.push_back(op);
    }
    programs.push_back(std::move(kept));
  }

  auto run = std::make_shared<Run>();
  run->call = &call;
  run->forwards = &forwards;
  if (t_on_worker) threaded = false;  // a call from inside a stage (Note [Shared streams and workers])
  run->local = std::make_unique<LocalTransport>(
      stages_, first_, threaded || call.remote != nullptr, call.recorder,
      call.remote ? call.remote->group().timeout() : std::chrono::milliseconds(0));
  run->transport = run->local.get();
  const bool lanes = call.lanes > 1 && !call.training && !call.remote;
  if (lanes) {
    TORCH_INTERNAL_ASSERT(call.lane_stages.size() == stages_.size());
    ensure_lanes(call.lanes);
    run->local->stream_of = [this, &call](int64_t to, int64_t item) {
      return stream_for(call, to, item);
    };
  } else {
    call.lanes = 1;
  }
  if (call.remote) {
    run->remote = std::make_unique<RemoteTransport>(
        *run->local, *call.remote, first_, first_ + n_local, &run->skips,
        [r = run.get()](std::exception_ptr e) { r->fail(std::move(e)); });
    run->transport = run->remote.get();
  }
  for (const auto& t : call.caller_tensors) {
    if (!t.defined() || t.device().is_cpu() || run->entries.count(t.device().str())) continue;
    run->entries[t.device().str()] = record_event(current_stream(t.device()));
  }
  std::vector<c10::Device> devices;
  for (const auto& s : stages_) devices.push_back(s.device);
  run->rng = CallRng::begin(devices);
  if (call.training) {
    run->saved.assign(static_cast<size_t>(n_local),
                      std::vector<Run::Saved>(static_cast<size_t>(call.n_items)));
    if (call.accumulate_cast_grads) {
      for (int64_t j = 0; j < n_local; ++j) run->cast_grads.push_back(std::make_unique<CastGrads>());
    }
  }
  if (call.chained) {
    run->chains.resize(static_cast<size_t>(n_local));
    for (const auto& t : call.caller_tensors) {
      if (t.defined() && t.grad_fn()) run->stops.insert(t.grad_fn().get());
    }
  }
  fork();
  struct Detach {  // no message reaches the transport once this call is over
    RemoteCall* remote;
    ~Detach() {
      if (remote) remote->detach();
    }
  } detach{call.remote};
  if (call.remote) call.remote->attach(run->remote.get());

  if (threaded) {
    std::lock_guard<std::mutex> queue_lock(queue_mutex());  // Note [Shared streams and workers]
    for (size_t k = 0; k < programs.size(); ++k) {
      if (programs[k].empty()) continue;
      shared_worker(k).push([this, r = run, k, program = programs[k]]() mutable {
        run_program(*r, program);
        Run& done = *r;
        r.reset();  // before the caller can move on (Note [Call ownership])
        std::lock_guard<std::mutex> lock(done.mutex);
        ++done.finished;
        done.done.notify_all();
      });
      ++run->expected;
    }
  }
  if (threaded) {
    std::unique_lock<std::mutex> lock(run->mutex);
    run->done.wait(lock, [&] { return run->finished == run->expected; });
  } else {
    for (const auto& t : schedules::simulate(call.programs)) {
      if (!mine(t.op)) continue;
      if (!run_action(*run, t.op)) break;
    }
  }
  if (call.remote) call.remote->detach();

  // Each stage's summed cast gradients into .grad, after its last backward
  // (Note [Cast gradients per step]); a failed step adds none.
  for (size_t j = 0; j < run->cast_grads.size() && !run->error; ++j) {
    try {
      c10::OptionalStreamGuard stream_guard(stages_[j].compute);
      run->cast_grads[j]->flush();
    } catch (...) {
      run->error = describe_failure(call, "summing the cast weights' gradients after micro-batch",
                                    first_ + static_cast<int64_t>(j), call.n_items - 1);
    }
  }
  join();  // also after a failure: the caller may free what the stages used
  run->saved.clear();  // a failed step leaves activations behind: drop them
  run->stage0_input.clear();
  if (run->error) std::rethrow_exception(run->error);
}

MPIPE_FUNC void Executor::fork() const {
  for (size_t j = 0; j < stages_.size(); ++j) {
    if (!stages_[j].compute) continue;
    bool first_on_device = true;
    for (size_t k = 0; k < j; ++k) first_on_device &= stages_[k].device != stages_[j].device;
    if (!first_on_device) continue;
    const auto event = record_event(current_stream(stages_[j].device));
    for (const StagePlace& s : stages_) {
      if (s.device != stages_[j].device) continue;
      event->block(*s.compute);
      for (const auto& lane : s.lanes) event->block(lane);
    }
  }
}

MPIPE_FUNC void Executor::join() const {
  for (const StagePlace& s : stages_) {
    if (s.compute) record_event(*s.compute)->block(current_stream(s.device));
    for (const auto& lane : s.lanes) record_event(lane)->block(current_stream(s.device));
  }
}

}  // namespace detail
}  // namespace mpipe
