#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_LINEAR_H_
#define MPIPE_LINEAR_H_

// mpipe::Linear: torch::nn::Linear whose weight autocast casts once per scope.
//
//   torch::nn::Sequential stage(mpipe::Linear(4096, 4096), torch::nn::ReLU());
//
// Note [Linear under autocast]
// LibTorch's torch::nn::Linear computes addmm(bias, x, weight.t()) (for input
// of other ranks, matmul(x, weight.t()) + bias). Under autocast the cast is of
// the transposed view, and autocast's cache keeps casts of leaf tensors only,
// so the weight is cast again at every call: a pipeline with m micro-batches
// casts every weight m times per step (wide-mlp in bf16: 64 casts of 256 MiB
// weights per forward, 7 of its 18 ms; bench/RESULTS.md). Python's nn.Linear
// calls aten::linear, whose weight autocast casts once per scope and re-uses.
// mpipe::Linear is the same module with that forward: the same options,
// initialisation (the same values from the same seed), parameter names and
// state dicts as torch::nn::Linear. Without autocast, 2-D input computes the
// same addmm; input of other ranks goes through aten::linear's fused bias
// instead of a separate addition (rounding may differ in the last bit).
// In a pipeline's train_step under autocast it also sums its weight's
// gradients over the micro-batches before converting them (Note [Cast
// gradients per step] in mpipe/detail/precision/cast_grads-inl.h).

#include <ATen/ATen.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/init.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <ostream>
#include <utility>

namespace mpipe {

/// torch::nn::Linear (same options, initialisation, parameter names and state
/// dicts) whose weight autocast casts once per scope (Note [Linear under autocast]).
class LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  /// y = x W^T + b with W [out_features, in_features] and a bias.
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features)) {}
  /// torch::nn::Linear's options (in_features, out_features, bias).
  explicit LinearImpl(torch::nn::LinearOptions options) : options(std::move(options)) {
    reset();  // NOLINT(clang-analyzer-optin.cplusplus.VirtualCall): as torch::nn::Linear
  }

  /// Registers `weight` and `bias` (undefined without options.bias()) and
  /// initialises them (reset_parameters()).
  void reset() override {
    weight = register_parameter(
        "weight", torch::empty({options.out_features(), options.in_features()}));
    bias = options.bias() ? register_parameter("bias", torch::empty(options.out_features()))
                          : register_parameter("bias", {}, /*requires_grad=*/false);
    reset_parameters();
  }

  /// torch::nn::Linear's initialisation: Kaiming-uniform weight (a = sqrt(5)),
  /// bias uniform in +-1/sqrt(in_features).
  void reset_parameters() {
    torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (bias.defined()) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
      torch::nn::init::uniform_(bias, -bound, bound);
    }
  }

  /// Prints `mpipe::Linear(in_features=..., out_features=..., bias=...)`.
  void pretty_print(std::ostream& stream) const override {
    stream << "mpipe::Linear(in_features=" << options.in_features()
           << ", out_features=" << options.out_features() << ", bias=" << std::boolalpha
           << options.bias() << ")";
  }

  /// aten::linear(input, weight, bias), with step_weight() for `weight` where it is defined.
  torch::Tensor forward(const torch::Tensor& input) {
    const at::Tensor step = step_weight();
    return at::linear(input, step.defined() ? step : weight, bias);
  }

  /// Inside ModelPipeline::train_step under autocast: the low-precision copy
  /// of `weight` that the step's micro-batches share, so that their gradients
  /// are summed in that dtype and added to weight.grad once per step (Note
  /// [Cast gradients per step], ModelPipelineOptions::accumulate_cast_grads).
  /// Elsewhere undefined: forward uses `weight`.
  at::Tensor step_weight() const;

  /// The options it was built with.
  torch::nn::LinearOptions options;
  /// [out_features, in_features].
  torch::Tensor weight;
  /// [out_features], or undefined without options.bias().
  torch::Tensor bias;
};

/// A holder for LinearImpl, as torch::nn's modules have.
TORCH_MODULE(Linear);

}  // namespace mpipe

#endif  // MPIPE_LINEAR_H_
