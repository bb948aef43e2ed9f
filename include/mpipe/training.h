#pragma once

// Options of ModelPipelineImpl::train_step: the schedule, the loss and how it
// is reduced over the batch.

#include <mpipe/schedule.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>

namespace mpipe {

enum class Schedule {
  /// Fill-drain: all forwards, then all backwards (schedules::gpipe).
  GPipe,
  /// One forward, one backward (schedules::one_f_one_b): the same time, with
  /// at most n_stages micro-batches' activations alive instead of all.
  OneFOneB,
};

enum class LossReduction {
  /// The loss function returns the mean over the rows it is given; the step's
  /// gradients are those of the mean over the whole batch.
  Mean,
  /// The loss function returns the sum over its rows; the step's gradients are
  /// those of the sum over the whole batch.
  Sum,
};

/// Loss of one micro-batch: (output of the last stage, matching rows of the
/// target) -> a scalar.
using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

struct TrainStepOptions {
  /* implicit */ TrainStepOptions(int64_t split_size) : split_size_(split_size) {}
  /// Rows per micro-batch (the last may be smaller).
  TORCH_ARG(int64_t, split_size);
  TORCH_ARG(Schedule, schedule) = Schedule::GPipe;
  TORCH_ARG(LossReduction, reduction) = LossReduction::Mean;
};

/// The programs `schedule` gives each stage.
inline std::vector<schedules::Program> programs_for(Schedule s, int64_t n_micro, int64_t n_stages) {
  return s == Schedule::GPipe ? schedules::gpipe(n_micro, n_stages)
                              : schedules::one_f_one_b(n_micro, n_stages);
}

}  // namespace mpipe
