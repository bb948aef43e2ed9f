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
//
// The additions cost k kernels, each a launch of host time: for a chunk of 64
// steps more than the stages' own work (issue 33). On CUDA, ATen's cumsum
// along dim 0 of a tensor with more than one dim runs one thread per element
// that adds the steps in order, in the tensor's own dtype for float and
// double: the same additions as the loop, in one kernel. So float and double
// chunks on CUDA are summed with it (the running sum prepended as step 0);
// other dtypes (half and bfloat16 may accumulate wider) and the CPU (whose
// cumsum accumulates float in double) keep the loop. The GPU tests of time
// chunks compare every k with single steps bit for bit.
/// The steps of `chunk` from step `from` summed one at a time onto `sum`.
MPIPE_FUNC at::Tensor add_steps(at::Tensor sum, const at::Tensor& chunk, int64_t from) {
  const int64_t k = chunk.size(0);
  const auto dtype = chunk.scalar_type();
  if (chunk.is_cuda() && chunk.dim() >= 2 && k - from > 1 &&
      (dtype == at::kFloat || dtype == at::kDouble) && sum.scalar_type() == dtype &&
      sum.device() == chunk.device() && sum.sizes() == chunk.sizes().slice(1)) {
    at::Tensor steps = at::cat({sum.unsqueeze(0), chunk.narrow(0, from, k - from)});
    return steps.cumsum(0).select(0, k - from).clone();
  }
  for (int64_t t = from; t < k; ++t) sum = sum + chunk[t];
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
