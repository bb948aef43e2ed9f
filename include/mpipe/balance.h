#pragma once

// Balancing: split a list of layers into contiguous stages. partition() is
// exact (a dynamic programme over prefix sums), unlike the greedy heuristic
// of the best-known Python library; from_sequential() builds the pipeline.

#include <mpipe/model_pipeline.h>

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace mpipe {
namespace balance {

/// Splits `costs` (one per layer, each finite and >= 0) into `n_blocks`
/// contiguous non-empty blocks whose largest sum is as small as possible.
/// Returns the block sizes (layer counts, summing to costs.size()). Among
/// optimal splits it returns the one whose earlier blocks are longest.
std::vector<int64_t> partition(const std::vector<double>& costs, int64_t n_blocks);

/// The largest block sum of the split `sizes` of `costs` (sizes checked).
double max_block_cost(const std::vector<double>& costs, const std::vector<int64_t>& sizes);

/// A pipeline whose stage i holds the next sizes[i] layers of `layers`, on
/// devices[i]. Throws c10::Error when sizes do not add up to the layer count,
/// a size is not positive, or there are not as many sizes as devices.
ModelPipeline from_sequential(const torch::nn::Sequential& layers,
                              const std::vector<DeviceArg>& devices,
                              const std::vector<int64_t>& sizes,
                              ModelPipelineOptions options = {});

}  // namespace balance
}  // namespace mpipe
