#include "runtime.h"

#include "backward_positions.h"
#include "recorder.h"

#include "streams.h"

#include "mpipe/schedule.h"
#include "mpipe/state.h"

#include <ATen/ThreadLocalState.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace mpipe {
namespace detail {


// Note [Call ownership]
// ~~~~~~~~~~~~~~~~~~~~~
// The state of a threaded call (its error included) is shared by the caller
// and the tasks in flight, by shared_ptr. Each item holds one reference, which
// moves from task to task, and a worker drops its reference *before* it tells
// the caller that it is done; the caller holds its own until it has seen every
// item done. So the call's state, and the c10::Error in it, always die on the
// caller's thread, never on a worker after the caller has moved on (ThreadSanitizer
// could not order such a destruction: the exception's reference count lives in
// uninstrumented libstdc++). The training runtime does the same.

/// State shared by one threaded call's tasks (Note [Call ownership]).
struct Runtime::Call {
  Job* job;
  const std::vector<StageForward>* forwards;
  std::shared_ptr<c10::Event> entry;
  at::ThreadLocalState tls;
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable cv;
  int64_t finished = 0;
  std::exception_ptr error;
};

Runtime::Runtime() = default;
Runtime::~Runtime() = default;

void Runtime::add_stage(c10::Device device) {
  Stage stage{device, c10::nullopt, c10::nullopt};
  if (!device.is_cpu()) stage.compute = pool_stream(device);
  if (!stages_.empty()) {
    const c10::Device prev = stages_.back().device;
    if (!prev.is_cpu() && prev != device) stage.copy_in = pool_stream(prev);
  }
  stages_.push_back(stage);
}

at::Tensor Runtime::receive(Handoff in, int64_t stage_index, Recorder* recorder, int64_t item) {
  const Stage& stage = stages_[stage_index];
  at::Tensor value = std::move(in.value);
  const c10::Device src = value.device();
  if (src == stage.device) {
    if (stage.compute) {
      if (in.ready) in.ready->block(*stage.compute);
      record_on(value, *stage.compute);
    }
    return value;
  }
  if (src.is_cpu()) {
    c10::StreamGuard guard(*stage.compute);
    TaskSpan span(recorder, stage_index, item, TaskKind::Copy, stage.device, stage.compute);
    return value.to(stage.device, /*non_blocking=*/true);
  }
  const c10::Stream copy =
      stage.copy_in && stage.copy_in->device() == src ? *stage.copy_in : pool_stream(src);
  if (in.ready) in.ready->block(copy);
  if (stage.device.is_cpu()) {
    c10::StreamGuard guard(copy);
    TaskSpan span(recorder, stage_index, item, TaskKind::Copy, stage.device, c10::nullopt);
    return value.to(stage.device, /*non_blocking=*/false);
  }
  const c10::Stream streams[] = {copy, *stage.compute};
  c10::MultiStreamGuard guard(streams);
  TaskSpan span(recorder, stage_index, item, TaskKind::Copy, stage.device, copy);
  at::Tensor out = value.to(stage.device, /*non_blocking=*/true);
  record_on(value, copy);
  return out;
}

Handoff Runtime::run_task(Job& job, const std::vector<StageForward>& forwards,
                          int64_t stage_index, int64_t item, Handoff in,
                          const std::shared_ptr<c10::Event>& entry) {
  const Stage& stage = stages_[stage_index];
  const bool last = stage_index + 1 == static_cast<int64_t>(stages_.size());
  at::Tensor input;
  if (stage_index == 0) {
    if (job.same_input && item > 0) {
      input = job.received_input;
    } else {
      input = receive(Handoff{job.source(item), entry}, 0, job.recorder, item);
      if (job.same_input) job.received_input = input;
    }
  } else {
    input = receive(std::move(in), stage_index, job.recorder, item);
  }

  c10::OptionalStreamGuard guard(stage.compute);
  MicroBatchGuard micro_batch(job.micro_batched ? MicroBatch{item, job.n_items} : MicroBatch{});
  // Ends before the hand-off event, so the next stage's task starts after it.
  c10::optional<TaskSpan> span;
  span.emplace(job.recorder, stage_index, item, TaskKind::Forward, stage.device, stage.compute);
  at::Tensor output;
  {
    RngScope draws(job.rng, stage_index, item);  // Note [Random draws]
    output = forwards[stage_index](input);
  }
  TORCH_CHECK(output.defined(), "the stage returned an undefined tensor");
  if (job.backward_positions) job.backward_positions->tag(stage_index, item, output);
  if (last) {
    if (!job.reduce_sum) {
      job.outputs[item] = output;
    } else {
      job.outputs[0] = item == 0 ? output : job.outputs[0] + output;
    }
    return Handoff{};
  }
  span.reset();
  Handoff out{std::move(output), nullptr};
  if (stage.compute) out.ready = record_event(*stage.compute);
  return out;
}

void Runtime::fork() const {
  for (size_t j = 0; j < stages_.size(); ++j) {
    if (!stages_[j].compute) continue;
    bool first_on_device = true;
    for (size_t k = 0; k < j; ++k) first_on_device &= stages_[k].device != stages_[j].device;
    if (!first_on_device) continue;
    const auto event = record_event(current_stream(stages_[j].device));
    for (const Stage& s : stages_) {
      if (s.device == stages_[j].device) event->block(*s.compute);
    }
  }
}

void Runtime::join() const {
  for (const Stage& s : stages_) {
    if (s.compute) record_event(*s.compute)->block(current_stream(s.device));
  }
}

std::exception_ptr Runtime::describe_failure(const char* method, const std::string& item_name,
                                             int64_t n_items, int64_t stage_index,
                                             int64_t item) const {
  std::string what;
  try {
    throw;
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown exception";
  }
  try {
    TORCH_CHECK(false, "mpipe::ModelPipeline::", method, ": stage ", stage_index, " (on ",
                stages_[stage_index].device, ") failed at ", item_name, " ", item, " of ",
                n_items, ": ", what);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;  // unreachable
}

void Runtime::task(std::shared_ptr<Call> call, int64_t stage_index, int64_t item, Handoff in) {
  Handoff out;
  if (!call->failed.load(std::memory_order_acquire)) {
    try {
      at::ThreadLocalStateGuard tls_guard(call->tls);
      out = run_task(*call->job, *call->forwards, stage_index, item, std::move(in), call->entry);
    } catch (...) {
      std::exception_ptr error =
          describe_failure(call->job->method, call->job->item_name, call->job->n_items,
                           stage_index, item);
      std::lock_guard<std::mutex> lock(call->mutex);
      if (!call->error) call->error = error;
      call->failed.store(true, std::memory_order_release);
    }
  }
  if (stage_index + 1 < static_cast<int64_t>(stages_.size())) {
    // The item's one reference to the call moves on with it (Note [Call
    // ownership]).
    workers_[stage_index + 1]->push(
        [this, c = std::move(call), stage_index, item, h = std::move(out)]() mutable {
          task(std::move(c), stage_index + 1, item, std::move(h));
        });
  } else {
    Call& done = *call;
    call.reset();  // the caller's reference keeps it alive until it has seen this
    std::lock_guard<std::mutex> lock(done.mutex);
    if (++done.finished == done.job->n_items) done.cv.notify_all();
  }
}

void Runtime::execute(Job& job, const std::vector<StageForward>& forwards, bool threaded,
                      const at::Tensor& input) {
  TORCH_INTERNAL_ASSERT(forwards.size() == stages_.size());
  TORCH_INTERNAL_ASSERT(job.n_items > 0 && !stages_.empty());
  const int64_t n_stages = static_cast<int64_t>(stages_.size());
  job.outputs.assign(job.reduce_sum ? 1 : static_cast<size_t>(job.n_items), at::Tensor());
  job.received_input = at::Tensor();
  job.rng = CallRng::begin(devices());

  std::shared_ptr<c10::Event> entry;
  if (!input.device().is_cpu()) entry = record_event(current_stream(input.device()));
  fork();

  std::exception_ptr error;
  if (threaded) {
    ensure_workers();
    auto call = std::make_shared<Call>();
    call->job = &job;
    call->forwards = &forwards;
    call->entry = entry;
    for (int64_t i = 0; i < job.n_items; ++i) {
      workers_[0]->push([this, c = call, i]() mutable { task(std::move(c), 0, i, Handoff{}); });
    }
    std::unique_lock<std::mutex> lock(call->mutex);
    call->cv.wait(lock, [&] { return call->finished == job.n_items; });
    error = call->error;
  } else {
    std::vector<Handoff> in_flight(static_cast<size_t>(job.n_items));
    for (const auto& clock : schedule::fill_drain(job.n_items, n_stages)) {
      for (const auto& t : clock) {
        try {
          in_flight[t.index] =
              run_task(job, forwards, t.stage, t.index, std::move(in_flight[t.index]), entry);
        } catch (...) {
          error = describe_failure(job.method, job.item_name, job.n_items, t.stage, t.index);
          break;
        }
      }
      if (error) break;
    }
  }

  join();  // also after a failure: the caller may free what the stages used
  job.received_input = at::Tensor();
  if (error) std::rethrow_exception(error);
  const Stage& last = stages_.back();
  if (last.compute) {
    const c10::Stream caller = current_stream(last.device);
    for (const auto& t : job.outputs) record_on(t, caller);
  }
}

std::vector<c10::Device> Runtime::devices() const {
  std::vector<c10::Device> out;
  for (const Stage& s : stages_) out.push_back(s.device);
  return out;
}

void Runtime::ensure_workers() {
  while (workers_.size() < stages_.size()) workers_.push_back(std::make_unique<Worker>());
}

}  // namespace detail
}  // namespace mpipe
