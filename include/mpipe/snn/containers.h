#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_CONTAINERS_H_
#define MPIPE_SNN_CONTAINERS_H_

// Containers that let layers take multi-step input [T, N, ...] (StepMode::
// Multi; SpikingJelly's SeqToANNContainer and MultiStepContainer):
//   SeqToANN   runs stateless layers once on all T steps, as [T*N, ...]: one
//              call instead of T, so convolutions and matrix products see a
//              T-times larger batch.
//   MultiStep  runs single-step layers (stateful ones included) once per step
//              and stacks the outputs.
// Both take [T, N, ...] and return [T, N, ...]. Batch-statistics layers
// (BatchNorm in training mode) inside SeqToANN normalise over all T*N rows;
// put them in MultiStep to normalise each step on its own, as single-step
// calls do (SpikingConvBlock, mpipe/snn/conv_block.h, does that for you).

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <type_traits>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {
/// True for a parameter pack of layers: not a single Impl (a copy) and not a
/// single Sequential (the constructor that takes it).
template <typename Impl, typename... Ms>
constexpr bool is_layer_list() {
  if constexpr (sizeof...(Ms) != 1) {
    return sizeof...(Ms) > 0;
  } else {
    return !(std::is_same<std::decay_t<Ms>, Impl>::value || ...) &&
           !(std::is_same<std::decay_t<Ms>, torch::nn::Sequential>::value || ...);
  }
}

inline void check_sequence(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.defined(), "mpipe::snn::", name, ": the input is undefined");
  TORCH_CHECK(x.dim() >= 2, "mpipe::snn::", name, ": the input is a multi-step [T, N, ...] "
              "sequence, got shape ", x.sizes());
}
}  // namespace detail

namespace snn {

/// Stateless layers applied to every step of a [T, N, ...] sequence in one
/// call on [T*N, ...].
class SeqToANNImpl : public torch::nn::Module {
 public:
  /// The layers of `layers`, in order.
  explicit SeqToANNImpl(torch::nn::Sequential layers)
      : layers_(register_module("layers", std::move(layers))) {}
  /// The layers, in order: SeqToANN(torch::nn::Conv2d(...), torch::nn::BatchNorm2d(...)).
  template <typename... Ms,
            typename = std::enable_if_t<detail::is_layer_list<SeqToANNImpl, Ms...>()>>
  explicit SeqToANNImpl(Ms&&... layers)
      : SeqToANNImpl(torch::nn::Sequential(std::forward<Ms>(layers)...)) {}

  /// x [T, N, ...] -> the layers on [T*N, ...] -> [T, N, ...].
  at::Tensor forward(const at::Tensor& x) {
    detail::check_sequence("SeqToANN", x);
    const int64_t T = x.size(0), N = x.size(1);
    at::Tensor y = layers_->forward(x.flatten(0, 1));
    TORCH_CHECK(y.dim() >= 1 && y.size(0) == T * N, "mpipe::snn::SeqToANN: the layers turned ",
                T, " x ", N, " = ", T * N, " rows into shape ", y.sizes(),
                "; they must keep dim 0 (one row per step and sample)");
    std::vector<int64_t> shape{T, N};
    shape.insert(shape.end(), y.sizes().begin() + 1, y.sizes().end());
    return y.reshape(shape);
  }
  /// The layers (registered as submodule "layers").
  torch::nn::Sequential layers() const { return layers_; }

  /// Prints `mpipe::snn::SeqToANN` (its layers follow as submodules).
  void pretty_print(std::ostream& stream) const override { stream << "mpipe::snn::SeqToANN"; }

 private:
  torch::nn::Sequential layers_;
};
/// A holder for SeqToANNImpl, as torch::nn's modules have.
TORCH_MODULE(SeqToANN);

/// Single-step layers applied step by step to a [T, N, ...] sequence.
class MultiStepImpl : public torch::nn::Module {
 public:
  /// The layers of `layers`, in order.
  explicit MultiStepImpl(torch::nn::Sequential layers)
      : layers_(register_module("layers", std::move(layers))) {}
  /// The layers, in order: MultiStep(torch::nn::BatchNorm2d(c), snn::IFNode()).
  template <typename... Ms,
            typename = std::enable_if_t<detail::is_layer_list<MultiStepImpl, Ms...>()>>
  explicit MultiStepImpl(Ms&&... layers)
      : MultiStepImpl(torch::nn::Sequential(std::forward<Ms>(layers)...)) {}

  /// x [T, N, ...] -> the layers on x[t] for t = 0..T-1, stacked. With
  /// T = 0 the layers never run, and x itself comes back (there is no output
  /// shape to give).
  at::Tensor forward(const at::Tensor& x) {
    detail::check_sequence("MultiStep", x);
    std::vector<at::Tensor> out;
    out.reserve(static_cast<size_t>(x.size(0)));
    for (int64_t t = 0; t < x.size(0); ++t) out.push_back(layers_->forward(x[t]));
    if (out.empty()) return x;
    return at::stack(out);
  }
  /// The layers (registered as submodule "layers").
  torch::nn::Sequential layers() const { return layers_; }

  /// Prints `mpipe::snn::MultiStep` (its layers follow as submodules).
  void pretty_print(std::ostream& stream) const override { stream << "mpipe::snn::MultiStep"; }

 private:
  torch::nn::Sequential layers_;
};
/// A holder for MultiStepImpl, as torch::nn's modules have.
TORCH_MODULE(MultiStep);

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_CONTAINERS_H_
