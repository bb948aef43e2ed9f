#pragma once

// Private: records a call's tasks for mpipe::Timeline (Note [Timeline]).

#include "mpipe/detail/cuda/device_probe.h"

#include "mpipe/schedule.h"
#include "mpipe/timeline.h"

#include <c10/core/Stream.h>
#include <c10/util/Optional.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace mpipe {
namespace detail {

class Recorder {
 public:
  /// Starts the call's clocks: the host's, and a timing event on the caller's
  /// current stream of every CUDA device in `devices`.
  Recorder(std::string method, std::string item_name, int64_t n_items,
           const std::vector<c10::Device>& devices, double schedule_bubble);

  /// A task starts now: on `stream` when it is a CUDA stream (a timing event),
  /// else on the host clock. Thread-safe. Returns the task's index for end().
  size_t begin(int64_t stage, int64_t item, TaskKind kind, c10::Device device,
               const c10::optional<c10::Stream>& stream);
  void end(size_t index, const c10::optional<c10::Stream>& stream);

  /// Names the schedule, the worker of each stage and the paired operations
  /// (Op::with_next) of its `programs` (before any task).
  void describe_schedule(std::string name, const std::vector<schedules::Program>& programs) {
    timeline_.schedule = std::move(name);
    timeline_.stage_ranks = schedules::stage_workers(programs);
    for (const auto& p : programs) {
      for (size_t k = 0; k + 1 < p.size(); ++k) {
        if (!p[k].with_next) continue;
        paired_.push_back(p[k]);
        paired_.push_back(p[k + 1]);
      }
    }
  }

  /// The recorded timeline; waits for the device events it needs.
  Timeline finish();

 private:
  struct Entry {
    Timeline::Task task;
    c10::Device clock = c10::kCPU;  // the device whose origin event times it
    std::shared_ptr<TimingEvent> start, end;
  };
  using Clock = std::chrono::steady_clock;
  double host_ms() const;

  std::mutex mutex_;
  Timeline timeline_;
  Clock::time_point t0_;
  std::map<std::string, std::shared_ptr<TimingEvent>> origins_;  // by device.str()
  std::vector<Entry> entries_;
  std::vector<schedules::Op> paired_;
};

/// The timeline of a pipeline's last recorded call: kept as its recorder
/// until asked for, so that a call waits for no timing event.
struct TimelineSlot {
  std::shared_ptr<Recorder> pending;
  Timeline resolved;
  const Timeline& get() {
    if (pending) {
      resolved = pending->finish();
      pending.reset();
    }
    return resolved;
  }
};

/// Records one task for its scope's duration; does nothing without a recorder.
class TaskSpan {
 public:
  TaskSpan(Recorder* recorder, int64_t stage, int64_t item, TaskKind kind, c10::Device device,
           const c10::optional<c10::Stream>& stream)
      : recorder_(recorder), stream_(stream) {
    if (recorder_) index_ = recorder_->begin(stage, item, kind, device, stream);
  }
  ~TaskSpan() {
    if (!recorder_) return;
    try {
      recorder_->end(index_, stream_);
    } catch (...) {  // unwinding from a stage's error: that error is the one to report
    }
  }
  TaskSpan(const TaskSpan&) = delete;
  TaskSpan& operator=(const TaskSpan&) = delete;

 private:
  Recorder* recorder_;
  c10::optional<c10::Stream> stream_;
  size_t index_ = 0;
};

}  // namespace detail
}  // namespace mpipe
