#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_CONV_BLOCK_H_
#define MPIPE_SNN_CONV_BLOCK_H_

// SpikingConvBlock: the conv -> BatchNorm -> neuron (-> max-pool) block of
// SpikingJelly's convolutional SNN examples, in either step mode.

#include <mpipe/snn/containers.h>
#include <mpipe/snn/neuron.h>

#include <c10/util/Exception.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <variant>
#include <vector>

namespace mpipe {
namespace snn {

/// Options of SpikingConvBlock: the convolution, BatchNorm, neuron and pooling.
struct SpikingConvBlockOptions {
  /// IF, LIF or ParametricLIF neuron options.
  using Neuron = std::variant<IFNodeOptions, LIFNodeOptions, ParametricLIFNodeOptions>;

  /// A kernel_size x kernel_size convolution with "same" padding and no bias
  /// (the BatchNorm after it has one); change any of that through conv().
  SpikingConvBlockOptions(int64_t in_channels, int64_t out_channels, int64_t kernel_size = 3)
      : conv_(torch::nn::Conv2dOptions(in_channels, out_channels, kernel_size)
                  .padding(kernel_size / 2)
                  .bias(false)) {}
  /// The convolution's options.
  TORCH_ARG(torch::nn::Conv2dOptions, conv);
  /// BatchNorm2d(out_channels) after the convolution.
  TORCH_ARG(bool, batch_norm) = true;
  /// The neuron, IF, LIF or ParametricLIF; its step_mode() is the block's
  /// (set_step_mode changes both).
  TORCH_ARG(Neuron, neuron) = IFNodeOptions();
  /// MaxPool2d(pool) after the neuron (kernel and stride); 0: no pooling.
  TORCH_ARG(int64_t, pool) = 0;
  /// Multi-step input in training mode: BatchNorm takes its batch statistics
  /// (and updates its running statistics) step by step, as T single-step calls
  /// do, so results do not depend on how many steps one call gets (what
  /// ModelPipeline's time chunks need). false: one BatchNorm call over all
  /// T*N rows (SpikingJelly's multi-step BatchNorm): one launch instead of T,
  /// statistics over the whole sequence.
  TORCH_ARG(bool, step_batch_stats) = true;
};

/// Conv2d -> BatchNorm2d -> IF, LIF or ParametricLIF neuron (-> MaxPool2d), in either step
/// mode (the neuron's).
class SpikingConvBlockImpl : public torch::nn::Module {
 public:
  /// Builds and registers "conv", "bn" (if options.batch_norm()), "neuron" and
  /// "pool" (if options.pool() > 0); throws c10::Error if pool < 0.
  explicit SpikingConvBlockImpl(SpikingConvBlockOptions options_) : options(std::move(options_)) {
    TORCH_CHECK(options.pool() >= 0, "mpipe::snn::SpikingConvBlock: pool must be >= 0 (0: no "
                "pooling), got ", options.pool());
    conv = register_module("conv", torch::nn::Conv2d(options.conv()));
    if (options.batch_norm()) {
      bn = register_module("bn", torch::nn::BatchNorm2d(options.conv().out_channels()));
    }
    neuron = std::visit(
        [](const auto& o) -> std::shared_ptr<NeuronBase> {
          using O = std::decay_t<decltype(o)>;
          if constexpr (std::is_same<O, IFNodeOptions>::value) {
            return std::make_shared<IFNodeImpl>(o);
          } else if constexpr (std::is_same<O, LIFNodeOptions>::value) {
            return std::make_shared<LIFNodeImpl>(o);
          } else {
            return std::make_shared<ParametricLIFNodeImpl>(o);
          }
        },
        options.neuron());
    register_module("neuron", neuron);
    if (options.pool() > 0) pool = register_module("pool", torch::nn::MaxPool2d(options.pool()));
  }

  /// Single step: x [N, C, H, W] -> spikes [N, C', H', W']. Multi-step:
  /// x [T, N, C, H, W] -> [T, N, C', H', W'], the convolution and pooling on
  /// all T*N images at once, the neuron's T steps fused.
  at::Tensor forward(const at::Tensor& x) {
    if (neuron->step_mode() == StepMode::Single) {
      at::Tensor y = conv(x);
      if (bn) y = bn(y);
      y = neuron->single_step(y);
      return pool ? pool(y) : y;
    }
    detail::check_sequence("SpikingConvBlock", x);
    const int64_t T = x.size(0), N = x.size(1);
    at::Tensor y = conv(x.flatten(0, 1));
    if (bn) {
      if (is_training() && options.step_batch_stats() && T > 1) {
        std::vector<at::Tensor> steps;
        const at::Tensor per_step = y.view(unflat(y, T, N));
        for (int64_t t = 0; t < T; ++t) steps.push_back(bn(per_step[t]));
        y = at::stack(steps).flatten(0, 1);
      } else {
        y = bn(y);
      }
    }
    y = neuron->multi_step(y.view(unflat(y, T, N)));
    if (!pool) return y;
    y = pool(y.flatten(0, 1));
    return y.view(unflat(y, T, N));
  }

  /// Prints `mpipe::snn::SpikingConvBlock` (its layers follow as submodules).
  void pretty_print(std::ostream& stream) const override {
    stream << "mpipe::snn::SpikingConvBlock";
  }

  /// The options it was built with.
  const SpikingConvBlockOptions options;
  /// The convolution.
  torch::nn::Conv2d conv{nullptr};
  /// The BatchNorm, or empty without options.batch_norm().
  torch::nn::BatchNorm2d bn{nullptr};
  /// The neuron (an IFNodeImpl, LIFNodeImpl or ParametricLIFNodeImpl); its
  /// step mode is the block's.
  std::shared_ptr<NeuronBase> neuron;
  /// The max-pooling, or empty when options.pool() is 0.
  torch::nn::MaxPool2d pool{nullptr};

 private:
  static std::vector<int64_t> unflat(const at::Tensor& y, int64_t T, int64_t N) {
    std::vector<int64_t> shape{T, N};
    shape.insert(shape.end(), y.sizes().begin() + 1, y.sizes().end());
    return shape;
  }
};
/// A holder for SpikingConvBlockImpl, as torch::nn's modules have.
TORCH_MODULE(SpikingConvBlock);

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_CONV_BLOCK_H_
