#pragma once

// Options of mpipe::ModelPipeline, in the style of torch::nn's options structs.

#include <mpipe/checkpoint.h>

#include <torch/arg.h>

namespace mpipe {

struct ModelPipelineOptions {
  /// Run each stage's host work (kernel launches, CPU compute) on a worker
  /// thread of its own, so stages issue work concurrently. When false, the
  /// caller's thread runs every task in the schedule's clock order; results are
  /// the same either way (see Note [Pipeline runtime]).
  TORCH_ARG(bool, worker_threads) = true;
  /// Activation checkpointing in train_step (only in training mode): a
  /// checkpointed stage keeps just its input in forward and runs again in
  /// backward, with the RNG state of its device restored so dropout draws the
  /// same mask. See Note [Training runtime].
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::Never;
  /// Capture no-grad forward / constant_forward / sequence_forward calls whose
  /// stages and input share one CUDA device as CUDA graphs, and replay them
  /// (one graph per method, arguments and input shape). Stateful modules then
  /// start every graphed call from their reset state and are reset after it.
  /// Needs a CUDA build of LibTorch; elsewhere, or when a call does not
  /// qualify, the call runs as usual. See Note [CUDA graphs].
  TORCH_ARG(bool, cuda_graphs) = false;
};

}  // namespace mpipe
