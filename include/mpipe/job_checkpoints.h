#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_JOB_CHECKPOINTS_H_
#define MPIPE_JOB_CHECKPOINTS_H_

// Checkpoints of a whole training job, to resume bit for bit after a crash or
// a restart: every rank saves its own part, and a checkpoint counts once
// every rank has written it whole.
//
//   mpipe::JobCheckpoints checkpoints("ckpt", *pipe, optimizer);  // every rank
//   int64_t step = 0;
//   if (auto resumed = checkpoints.resume()) step = resumed->step;
//   for (; step < steps; ++step) {
//     ... train_step, optimizer.step() ...
//     if ((step + 1) % 100 == 0) checkpoints.save(step + 1);
//   }
//
// Note [Job checkpoints] in mpipe/detail/pipeline/job_checkpoints-inl.h has
// the file layout and the rules.

#include <mpipe/grad_scaler.h>

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mpipe {

class ModelPipelineImpl;

/// Saves and resumes a pipeline job: the stages of this rank, its optimizer
/// (and GradScaler), the random generators (the CPU's, from which every
/// pipeline call draws its per-stage, per-item seeds, and each CUDA
/// device's), the step and an opaque data position of yours. Across
/// processes every rank of the pipeline's process group makes the same calls.
class JobCheckpoints {
 public:
  /// What resume() found.
  struct Resumed {
    int64_t step = 0;           ///< the step given to save()
    std::string data_position;  ///< the data position given to save()
    std::string directory;      ///< the checkpoint's folder
    /// Newer checkpoints that were refused: which rank's file, and why.
    std::vector<std::string> skipped;
  };

  /// Checkpoints in `directory` (created if missing) of `pipe`, `optimizer`
  /// and, if given, `scaler`; `keep` (at least 1): how many whole
  /// checkpoints to keep, the newest.
  JobCheckpoints(std::string directory, ModelPipelineImpl& pipe,
                 torch::optim::Optimizer& optimizer, GradScaler* scaler = nullptr,
                 int64_t keep = 2);

  /// Saves step `step` (and `data_position`, any bytes) into the folder
  /// step-N of `directory` (N = `step`): each rank writes its own file whole or not at
  /// all (a temporary file, a checksum, then a rename), then, once every rank
  /// has, rank 0 marks the checkpoint complete and removes the ones past
  /// `keep`. Returns the checkpoint's folder. Throws c10::Error if a file
  /// cannot be written (the other ranks then fail in save's barrier, within
  /// the group's timeout, and the checkpoint never counts).
  std::string save(int64_t step, const std::string& data_position = "");

  /// Loads the newest checkpoint that every rank holds whole and that
  /// matches this job (world size, this rank's stage numbers where it set
  /// ModelPipelineOptions::stage_numbers, its stages' parameters' and
  /// buffers' names, shapes and dtypes); nullopt when there is none. A
  /// checkpoint refused on any rank (a missing, torn, corrupted or
  /// mismatched file) is skipped on every rank, with a warning naming the
  /// rank's file and why, and the one before it is tried. Throws c10::Error
  /// if complete checkpoints exist but none can be loaded.
  std::optional<Resumed> resume();

 private:
  std::string directory_;
  ModelPipelineImpl& pipe_;
  torch::optim::Optimizer& optimizer_;
  GradScaler* scaler_;
  int64_t keep_;
};

}  // namespace mpipe

#endif  // MPIPE_JOB_CHECKPOINTS_H_
