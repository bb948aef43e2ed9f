#pragma once

// Options of mpipe::ModelPipeline, in the style of torch::nn's options structs.

#include <torch/arg.h>

namespace mpipe {

struct ModelPipelineOptions {
  /// Run each stage's host work (kernel launches, CPU compute) on a worker
  /// thread of its own, so stages issue work concurrently. When false, the
  /// caller's thread runs every task in the schedule's clock order; results are
  /// the same either way (see Note [Pipeline runtime]).
  TORCH_ARG(bool, worker_threads) = true;
};

}  // namespace mpipe
