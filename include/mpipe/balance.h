#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_BALANCE_H_
#define MPIPE_BALANCE_H_

// Balancing: split a list of layers into contiguous stages. partition() is
// exact (a dynamic programme over prefix sums), unlike the greedy heuristic
// of the best-known Python library; from_sequential() builds the pipeline.

#include <mpipe/model_pipeline.h>
#include <mpipe/schedule.h>
#include <mpipe/simulate.h>

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace mpipe {
namespace balance {

/// Splits `costs` (one per layer, each finite and >= 0) into `n_blocks`
/// contiguous non-empty blocks whose largest sum is as small as possible.
/// Returns the block sizes (layer counts, summing to costs.size()). Among
/// optimal splits it returns the one whose earlier blocks are longest.
std::vector<int64_t> partition(const std::vector<double>& costs, int64_t n_blocks);

/// A pipeline whose stage i holds the next sizes[i] layers of `layers`, on
/// devices[i]. Throws c10::Error when sizes do not add up to the layer count,
/// a size is not positive, or there are not as many sizes as devices. The
/// stages hold the very modules of `layers`, not copies (moved to their
/// devices): training the pipeline trains `layers`.
ModelPipeline from_sequential(const torch::nn::Sequential& layers,
                              const std::vector<DeviceArg>& devices,
                              const std::vector<int64_t>& sizes,
                              ModelPipelineOptions options = {});
/// from_sequential cut before each layer named in `cut_before` (the names
/// of `layers`' entries, e.g. script_layers' children), in order: one name
/// fewer than devices. Throws c10::Error naming the layers when a name is
/// not one of them or the names are out of order.
ModelPipeline from_sequential(const torch::nn::Sequential& layers,
                              const std::vector<DeviceArg>& devices,
                              const std::vector<std::string>& cut_before,
                              ModelPipelineOptions options = {});
/// from_sequential(layers, devices, {3, 0}) and (layers, devices, {"fc2",
/// "head"}): braced lists, which could spell either vector otherwise ({N, 0}
/// a std::vector<std::string>, as 0 is a null const char*; two names a
/// std::vector<int64_t>, as two pointers are an iterator range).
inline ModelPipeline from_sequential(const torch::nn::Sequential& layers,
                                     const std::vector<DeviceArg>& devices,
                                     std::initializer_list<int64_t> sizes,
                                     ModelPipelineOptions options = {}) {
  return from_sequential(layers, devices, std::vector<int64_t>(sizes), std::move(options));
}
/// from_sequential cut before the named layers, the names as a braced list.
inline ModelPipeline from_sequential(const torch::nn::Sequential& layers,
                                     const std::vector<DeviceArg>& devices,
                                     std::initializer_list<std::string> cut_before,
                                     ModelPipelineOptions options = {}) {
  return from_sequential(layers, devices, std::vector<std::string>(cut_before),
                         std::move(options));
}

/// Forward + backward time of each layer of `layers` in ms (median of `reps`
/// after one warm-up), on a sample batch, where the layers are (the sample is
/// moved to the first parameter's device; CPU without parameters). Each layer
/// runs on the previous layer's output. Stateful layers are profiled from
/// their reset state; parameters' gradients, buffers (e.g. BatchNorm's running
/// statistics) and neuron state are as they were afterwards.
std::vector<double> profile_time(torch::nn::Sequential layers, const at::Tensor& sample,
                                 int64_t reps = 3);

/// An estimate of each layer's memory in bytes: its parameters times
/// (1 + optimizer_state_scale) (Adam keeps 2 more tensors per parameter:
/// scale 2), plus the activation it passes on for `sample` (its output).
std::vector<double> profile_memory(torch::nn::Sequential layers, const at::Tensor& sample,
                                   double optimizer_state_scale = 0);

/// The activation each layer passes on for `sample` (its output), in bytes:
/// profile_memory without the parameters. What a micro-batch of that size
/// keeps alive at the layer until its backward, about.
std::vector<double> profile_activations(torch::nn::Sequential layers, const at::Tensor& sample);

/// Schedule::Auto's stage costs (TrainStepOptions::stage_costs) from
/// per-layer forward + backward times (profile_time) and the stage sizes
/// (layer counts): each stage's sum times `scale` (e.g. micro-batch rows /
/// sample rows), split forward : input gradient : weight gradient = 1 : 1 : 1
/// (a backward costs about two forwards), no hand-off cost.
schedules::Costs stage_costs(const std::vector<double>& layer_times,
                             const std::vector<int64_t>& sizes, double scale = 1);

/// Each stage's sum of per-layer values (e.g. profile_activations, for
/// TrainStepOptions::activation_bytes) times `scale`.
std::vector<double> stage_sums(const std::vector<double>& layer_values,
                               const std::vector<int64_t>& sizes, double scale = 1);

/// from_sequential with the split that minimises the largest stage's cost.
ModelPipeline balanced(const torch::nn::Sequential& layers, const std::vector<DeviceArg>& devices,
                       const std::vector<double>& costs, ModelPipelineOptions options = {});

}  // namespace balance
}  // namespace mpipe

#endif  // MPIPE_BALANCE_H_
