#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/runtime/recorder.h"

#include "mpipe/detail/runtime/streams.h"

namespace mpipe {
namespace detail {

// Note [Timeline]
// ~~~~~~~~~~~~~~~
// With ModelPipelineOptions::record_timeline, every task of a call is timed
// where it runs. A task on a CUDA stream gets two timing events on that
// stream (before and after its work is issued), so its span is when the GPU
// ran it, queueing behind the stream's earlier work included; a CPU task gets
// two readings of the host's steady clock. Device times are measured from an
// event recorded on the caller's stream when the call began, host times from
// the host clock at that moment, so both start near 0. Events are only read
// when the timeline is asked for (ModelPipelineImpl::timeline()), which waits
// for them; a call that records adds two event records per task and no sync.
// Recording runs calls eagerly: a CUDA-graph replay has no tasks to time.
// constant_train_step records its forward tasks only, since its backward is
// one autograd pass through all stages.

MPIPE_FUNC Recorder::Recorder(std::string method, std::string item_name, int64_t n_items,
                              const std::vector<c10::Device>& devices, double schedule_bubble)
    : t0_(Clock::now()) {
  timeline_.method = std::move(method);
  timeline_.item_name = std::move(item_name);
  timeline_.n_stages = static_cast<int64_t>(devices.size());
  timeline_.n_items = n_items;
  timeline_.stage_devices = devices;
  timeline_.schedule_bubble = schedule_bubble;
  for (const auto& d : devices) {
    if (d.is_cuda() && !origins_.count(d.str())) {
      origins_[d.str()] = record_timing_event(current_stream(d));
    }
  }
}

MPIPE_FUNC double Recorder::host_ms() const {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0_).count();
}

MPIPE_FUNC size_t Recorder::begin(int64_t stage, int64_t item, TaskKind kind, c10::Device device,
                                  const c10::optional<c10::Stream>& stream) {
  Entry e;
  e.task.stage = stage;
  e.task.item = item;
  e.task.kind = kind;
  e.task.device = device;
  if (stream && origins_.count(stream->device().str()) && origins_.at(stream->device().str())) {
    e.clock = stream->device();
    e.start = record_timing_event(*stream);
  }
  if (!e.start) e.task.start_ms = host_ms();
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back(std::move(e));
  return entries_.size() - 1;
}

MPIPE_FUNC void Recorder::end(size_t index, const c10::optional<c10::Stream>& stream) {
  std::shared_ptr<TimingEvent> event;
  if (stream && origins_.count(stream->device().str())) event = record_timing_event(*stream);
  const double now = host_ms();
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = entries_[index];
  if (e.start && event) {
    e.end = std::move(event);
  } else {  // begin() used the host clock too
    e.task.end_ms = now;
  }
}

MPIPE_FUNC Timeline Recorder::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  Timeline out = timeline_;
  for (auto& e : entries_) {
    if (e.start && e.end) {
      const TimingEvent& origin = *origins_.at(e.clock.str());
      e.task.start_ms = elapsed_ms(origin, *e.start);
      e.task.end_ms = elapsed_ms(origin, *e.end);
    }
    for (const auto& op : paired_) {
      const auto kind = static_cast<int>(op.kind);  // F, B, I: the TaskKinds of the same number
      e.task.paired |= op.stage == e.task.stage && op.micro_batch == e.task.item &&
                       kind == static_cast<int>(e.task.kind);
    }
    out.tasks.push_back(e.task);
  }
  return out;
}

}  // namespace detail
}  // namespace mpipe
