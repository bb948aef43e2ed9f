#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_TIMELINE_H_
#define MPIPE_TIMELINE_H_

// What a pipeline did, task by task: recorded when
// ModelPipelineOptions::record_timeline is on, read with
// ModelPipelineImpl::timeline(), exported as a Chrome trace (Perfetto,
// chrome://tracing) or a self-contained SVG Gantt chart.

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

namespace mpipe {

/// What a timeline task did.
enum class TaskKind {
  Forward,    ///< a stage's forward of one micro-batch or time step
  Backward,   ///< a stage's backward of one micro-batch (train_step)
  BackwardInput,   ///< zero-bubble schedules: the gradient of a stage's inputs (I)
  BackwardWeight,  ///< zero-bubble schedules: the gradient of a stage's weights (W)
  Recompute,  ///< a checkpointed forward run again before its backward
  Copy,       ///< an activation or gradient copied between devices
};

/// "forward", "backward", "input gradient", "weight gradient", "recompute" or "copy".
const char* to_string(TaskKind kind);

/// What one pipeline call did, task by task (ModelPipelineImpl::timeline()).
struct Timeline {
  /// One task. Times are milliseconds since the call began: on CUDA devices
  /// taken from timing events on the stage's stream (when the GPU ran the
  /// task), elsewhere from the host's steady clock (when the host ran it).
  struct Task {
    int64_t stage = 0;  ///< the stage it ran (a copy: the receiving stage)
    int64_t item = 0;  ///< micro-batch or time step
    TaskKind kind = TaskKind::Forward;  ///< what it did
    c10::Device device = c10::kCPU;     ///< where it ran
    double start_ms = 0;  ///< when it started
    double end_ms = 0;    ///< when it ended
    /// Run as one action with another task of its worker: DualPipeV's
    /// forward and backward, issued together (Note [DualPipeV]). On a GPU
    /// the two may overlap in time (bubble_fraction then counts the overlap
    /// twice); the SVG draws each in half its row.
    bool paired = false;
  };

  std::string method;     ///< "forward", "train_step", ...
  std::string item_name;  ///< "micro-batch" or "time step"
  int64_t n_stages = 0;   ///< the pipeline's stages
  int64_t n_items = 0;    ///< the call's micro-batches or time steps
  std::vector<c10::Device> stage_devices;  ///< each stage's device
  /// The schedule that ran ("1F1B", ...; empty for forward-type calls).
  std::string schedule;
  /// The worker that ran each stage (interleaved schedules run several stages
  /// on one worker); empty: stage s on worker s.
  std::vector<int64_t> stage_ranks;
  std::vector<Task> tasks;  ///< every task, copies included
  /// The schedule's idle fraction with unit costs (schedules::bubble).
  double schedule_bubble = 0;

  /// Whether no task was recorded.
  bool empty() const { return tasks.empty(); }
  /// The worker of `stage` (stage_ranks[stage], or stage).
  int64_t rank_of(int64_t stage) const;
  /// How many workers ran the stages.
  int64_t n_ranks() const;
  /// From the first task's start to the last task's end.
  double makespan_ms() const;
  /// Measured idle fraction: 1 - (time spent in forward, backward, input or
  /// weight gradient and recompute tasks) / (n_ranks() * makespan). Copies do
  /// not count as work.
  double bubble_fraction() const;
  /// Chrome trace event format (JSON): a track per stage, one complete event
  /// per task, the bubble fractions under "otherData".
  std::string to_chrome_trace() const;
  /// A self-contained SVG Gantt chart: a row per worker, a colour per item,
  /// backward darker than forward, a time axis, and both bubble fractions.
  std::string to_svg() const;
  /// Writes to_chrome_trace() to `path`; throws c10::Error if the file
  /// cannot be written.
  void save_chrome_trace(const std::string& path) const;
  /// Writes to_svg() to `path`; throws c10::Error if the file cannot be written.
  void save_svg(const std::string& path) const;
};

}  // namespace mpipe

#endif  // MPIPE_TIMELINE_H_
