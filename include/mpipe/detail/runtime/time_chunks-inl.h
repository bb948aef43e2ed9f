#pragma once

#include "mpipe/detail/config.h"

// The sum of a time chunk's outputs over its steps (Note [Time chunks]).

#include "mpipe/detail/runtime/scatter.h"

#include <ATen/TensorOperators.h>
#include <torch/csrc/autograd/custom_function.h>

namespace mpipe {
namespace detail {


// Note [Summing a chunk's steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Forward adds the chunk's steps to the running sum one at a time, the same
// additions in the same order as single-step items make, so the sum is the
// same for every k. Doing that with autograd's own select and add would cost
// O(k^2) in backward: each select's backward writes its gradient into a zero
// tensor of the whole chunk's size. The sum's gradient reaches every step
// unchanged, so backward hands the chunk one broadcast view of it instead.
/// The steps of `chunk` summed one at a time onto `acc`.
MPIPE_FUNC at::Tensor add_steps(at::Tensor sum, const at::Tensor& chunk, int64_t from) {
  for (int64_t t = from; t < chunk.size(0); ++t) sum = sum + chunk[t];
  return sum;
}

/// The chunk's gradient: the sum's, broadcast to every step.
MPIPE_FUNC at::Tensor broadcast_steps(const at::Tensor& g, int64_t k) {
  std::vector<int64_t> shape{k};
  shape.insert(shape.end(), g.sizes().begin(), g.sizes().end());
  return g.unsqueeze(0).expand(shape);
}

/// acc + chunk[0] + chunk[1] + ...
struct StepSum : torch::autograd::Function<StepSum> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& acc,
                            const at::Tensor& chunk) {
    ctx->saved_data["k"] = chunk.size(0);
    return add_steps(acc, chunk, 0);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], broadcast_steps(grads[0], ctx->saved_data["k"].toInt())};
  }
};

/// chunk[0] + chunk[1] + ... (the first chunk: no sum yet).
struct FirstStepSum : torch::autograd::Function<FirstStepSum> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& chunk) {
    ctx->saved_data["k"] = chunk.size(0);
    return chunk.size(0) == 1 ? chunk[0].clone() : add_steps(chunk[0], chunk, 1);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {broadcast_steps(grads[0], ctx->saved_data["k"].toInt())};
  }
};


MPIPE_FUNC at::Tensor step_sum(const at::Tensor& acc, const at::Tensor& chunk) {
  return acc.defined() ? StepSum::apply(acc, chunk) : FirstStepSum::apply(chunk);
}

}  // namespace detail
}  // namespace mpipe
