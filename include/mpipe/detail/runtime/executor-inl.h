#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/executor_run.h"

#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/precision/cast_grads.h"
#include "mpipe/detail/runtime/time_chunks.h"
#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/recorder.h"
#include "mpipe/detail/runtime/skips.h"
#include "mpipe/detail/runtime/split_backward.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/simulate.h"
#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <ATen/record_function.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <string>
#include <utility>

namespace mpipe {
namespace detail {

// Note [Call ownership]
// ~~~~~~~~~~~~~~~~~~~~~
// The state of a threaded call (its error included) is shared by the caller
// and the workers, by shared_ptr. A worker drops its reference *before* it
// tells the caller that it is done; the caller holds its own until it has seen
// every worker done. So the call's state, and the c10::Error in it, always die
// on the caller's thread, never on a worker after the caller has moved on
// (ThreadSanitizer could not order such a destruction: the exception's
// reference count lives in uninstrumented libstdc++).

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
  if (!distributed_) {  // in one process, stage j is stage j
    std::vector<int64_t> global = map_.global;
    global.push_back(map_.n_total());
    map_ = StageMap::of(global, map_.n_total() + 1);
  }
}

// Note [Lanes]
// ~~~~~~~~~~~~
// On one GPU a small stage's kernels fill a fraction of it (narrow-mlp: a GEMM
// of 64 x 1024 x 1024 runs on 16 of the H200's 132 SMs), and one stream per
// stage lets at most one micro-batch per stage run at a time. With lanes(k), a
// forward call computes micro-batch i on lane i % k, a stream of the device
// that every stage on it uses: a micro-batch goes from stage to stage of one
// device on one lane, ordered by the order of the launches (the consumer
// launches after the producer's send), so those hand-offs need no event
// (Note [Hand-offs]); up to k micro-batches run at once on the device. A
// value crossing lanes or devices waits for its event as usual; fork() and
// join() cover the streams the call uses (its lanes, the other stages' own
// streams), so a CUDA graph captures them too and a call spends no driver
// calls on streams it leaves idle. Per-stage lanes
// (k streams per stage, an event per hand-off) measured 13-20 % slower on
// narrow-mlp's replay than per-device ones with 8 lanes (bench/RESULTS.md).
// Micro-batches of one stage are independent only when the stage keeps no
// state, so stages with buffers or stateful modules, training steps (whose
// backward follows each forward's stream) and time-step calls keep their
// compute stream. The values are the same: each micro-batch runs the same
// kernels, only their order on the GPU changes. lanes(0) chooses one lane per
// micro-batch, up to 8: a replay pays nothing on the host per lane, and an
// eager call pays two driver calls per lane (fork and join) instead of an
// event recorded and waited for at every hand-off between stages of one GPU
// (the overhead workload's threaded forward on H100s: 4.8, 11.0 and 18.7 µs
// added per task, medians of three calls, against 8.3, 13.5 and 28.6 with lanes(1);
// narrow-mlp's eager forward no slower, bench/RESULTS.md).

MPIPE_FUNC void Executor::ensure_lanes(int64_t k) {
  for (StagePlace& stage : stages_) {
    if (!stage.compute) continue;
    // The device's lanes: slots past the stages' own (Note [Shared streams and workers]).
    while (static_cast<int64_t>(stage.lanes.size()) < k) {
      stage.lanes.push_back(
          shared_stream(stage.device, StreamRole::Compute, 64 + stage.lanes.size()));
    }
  }
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
  // Named scopes for profilers (Kineto, torch.profiler): each action, its kind.
  RECORD_USER_SCOPE(op.kind == OpKind::Forward          ? "mpipe::forward"
                    : op.kind == OpKind::BackwardInput  ? "mpipe::input_gradient"
                    : op.kind == OpKind::BackwardWeight ? "mpipe::weight_gradient"
                                                        : "mpipe::backward");
  const int64_t j = op.stage, i = op.micro_batch;
  const TimeChunks& chunks = run.call->time_chunks;
  const char* phase = !run.call->training || (run.call->chained && op.kind == OpKind::Forward)
                          ? run.call->item_name
                      : run.call->chained ? chunks.pick("backward of item", "backward of time chunk",
                                                        "backward of time step")
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
  for (size_t k = 0; k < program.size(); ++k) {
    const bool pair = program[k].with_next && k + 1 < program.size();
    if (!(pair ? run_pair(run, program[k], program[k + 1]) : run_action(run, program[k]))) return;
    k += pair;
  }
}

MPIPE_FUNC bool Executor::run_pair(Run& run, const schedules::Op& a, const schedules::Op& b) {
  // Note [DualPipeV]: both operations' work issued, then their hand-offs.
  std::vector<HeldHandOff> held;
  t_held = &held;
  const bool ran = run_action(run, a) && run_action(run, b);
  t_held = nullptr;
  if (!ran) return false;
  size_t k = 0;
  try {
    for (; k < held.size(); ++k) {
      HeldHandOff& h = held[k];
      c10::OptionalStreamGuard on(place(h.from).compute);  // the sender's stream is current
      run.transport->send(h.from, h.to, h.key, std::move(h.values));
    }
    return true;
  } catch (const Aborted&) {
    return false;
  } catch (...) {
    run.fail(describe_failure(*run.call, "handing on the result of micro-batch", held[k].from,
                              held[k].key.item));
    return false;
  }
}

MPIPE_FUNC void Executor::set_layout(const std::vector<int64_t>& global, int64_t n_total,
                                     std::string rank_note) {
  map_ = StageMap::of(global, n_total);
  distributed_ = true;
  rank_ = std::move(rank_note);
}

MPIPE_FUNC void Executor::run(CallSpec& call, const std::vector<StageForward>& forwards,
                              bool threaded) {
  const int64_t n_stages = n_total();
  const auto n_local = static_cast<int64_t>(stages_.size());
  TORCH_INTERNAL_ASSERT(n_local > 0 && forwards.size() == stages_.size() && call.n_items > 0);
  TORCH_INTERNAL_ASSERT(call.remote || n_local == n_stages);
  struct OwnHandOffs {  // a call from inside a pair's stage holds none of them back
    std::vector<HeldHandOff>* outer = t_held;
    OwnHandOffs() { t_held = nullptr; }
    ~OwnHandOffs() { t_held = outer; }
  } own_hand_offs;
  const auto n_ranks = static_cast<int64_t>(call.programs.size());
  TORCH_INTERNAL_ASSERT(n_ranks > 0 && n_ranks <= n_stages);
  schedules::validate(call.programs, n_stages, call.n_items, call.training);
  if (call.training) {
    call.input_grads.assign(static_cast<size_t>(call.n_items), Tensors());
    call.losses.assign(static_cast<size_t>(call.n_items), at::Tensor());
  }
  // Across processes, each program keeps the operations of this process's
  // stages (Note [Cross-process calls]).
  // A pair whose second operation is another process's is no pair here.
  auto mine = [&](const schedules::Op& op) { return map_.holds(op.stage); };
  std::vector<schedules::Program> programs;
  for (const auto& program : call.programs) {
    schedules::Program kept;
    for (size_t k = 0; k < program.size(); ++k) {
      if (!mine(program[k])) continue;
      kept.push_back(program[k]);
      kept.back().with_next &= k + 1 < program.size() && mine(program[k + 1]);
    }
    programs.push_back(std::move(kept));
  }

  auto run = std::make_shared<Run>();
  run->call = &call;
  run->forwards = &forwards;
  if (on_shared_worker()) threaded = false;  // a call from inside a stage (Note [Shared streams and workers])
  // One item (one micro-batch, or all time steps in one chunk) leaves nothing
  // to overlap: every action waits for the one before it, and worker threads
  // would only add hand-offs between them.
  if (call.n_items == 1 && !call.remote) threaded = false;
  run->local = std::make_unique<LocalTransport>(
      stages_, map_, threaded || call.remote != nullptr, call.recorder,
      call.remote ? call.remote->timeout() : std::chrono::milliseconds(0));
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
  const std::vector<c10::Stream> streams = call_streams(call);
  fork(streams);
  struct Detach {  // no message reaches the transport once this call is over
    CallLink* remote;
    ~Detach() {
      if (remote) remote->detach();
    }
  } detach{call.remote};
  if (call.remote) {
    run->remote = call.remote->attach(
        *run->local, map_, &run->skips,
        [r = run.get()](std::exception_ptr e) { r->fail(std::move(e)); });
    run->transport = run->remote.get();
  }

  if (threaded) {
    // Set before any program runs: only the last one to finish wakes the caller.
    for (const auto& program : programs) run->expected += !program.empty();
    std::lock_guard<std::mutex> queue_lock(queue_mutex());  // Note [Shared streams and workers]
    for (size_t k = 0; k < programs.size(); ++k) {
      if (programs[k].empty()) continue;
      shared_worker(k).push([this, r = run, k, program = programs[k]]() mutable {
        run_program(*r, program);
        Run& done = *r;
        r.reset();  // before the caller can move on (Note [Call ownership])
        std::lock_guard<std::mutex> lock(done.mutex);
        if (++done.finished == done.expected) done.done.notify_all();
      });
    }
  }
  if (threaded) {
    std::unique_lock<std::mutex> lock(run->mutex);
    auto all_done = [&] { return run->finished == run->expected; };
    run->done.wait(lock, all_done);
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
                                    map_.global[j], call.n_items - 1);
    }
  }
  // The step's loss, on the last stage's stream, in item order: the join
  // below makes it the caller's too.
  call.loss_sum = at::Tensor();
  if (call.training && !run->error && map_.holds(n_stages - 1)) {
    try {
      c10::OptionalStreamGuard last_stage(stages_.back().compute);
      for (const auto& l : call.losses) {
        if (l.defined()) call.loss_sum = call.loss_sum.defined() ? call.loss_sum + l : l;
      }
    } catch (...) {
      run->error = describe_failure(call, "summing the losses after micro-batch", n_stages - 1,
                                    call.n_items - 1);
    }
  }
  join(streams);  // also after a failure: the caller may free what the stages used
  run->saved.clear();  // a failed step leaves activations behind: drop them
  run->stage0_input.clear();
  if (run->error) std::rethrow_exception(run->error);
}

MPIPE_FUNC std::vector<c10::Stream> Executor::call_streams(const CallSpec& call) const {
  std::vector<c10::Stream> out;
  auto add = [&out](const c10::Stream& s) {
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  };
  for (size_t j = 0; j < stages_.size(); ++j) {
    const StagePlace& stage = stages_[j];
    if (!stage.compute) continue;
    if (call.lanes <= 1 || !call.lane_stages[j]) {
      add(*stage.compute);
      continue;
    }
    for (int64_t k = 0; k < call.lanes; ++k) add(stage.lanes.at(static_cast<size_t>(k)));
  }
  return out;
}

MPIPE_FUNC void Executor::fork(const std::vector<c10::Stream>& streams) {
  std::vector<std::pair<c10::Device, std::shared_ptr<c10::Event>>> entry;  // one per device
  for (const c10::Stream& s : streams) {
    auto it = std::find_if(entry.begin(), entry.end(),
                           [&s](const auto& e) { return e.first == s.device(); });
    if (it == entry.end()) {
      entry.emplace_back(s.device(), record_event(current_stream(s.device())));
      it = entry.end() - 1;
    }
    it->second->block(s);
  }
}

MPIPE_FUNC void Executor::join(const std::vector<c10::Stream>& streams) {
  for (const c10::Stream& s : streams) record_event(s)->block(current_stream(s.device()));
}

}  // namespace detail
}  // namespace mpipe
