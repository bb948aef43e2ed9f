#pragma once

#include "mpipe/detail/config.h"

// The sum of a time chunk's outputs over its steps (Note [Time chunks]).

#include "mpipe/detail/runtime/items.h"

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
// The additions cost k kernels, each a launch of host time: on an H200 a
// chunk of 64 steps of snn-256 spent 1.3 ms on them, six times the stages' own
// work (bench/RESULTS.md, issue 33). On CUDA, ATen's cumsum along dim 0 of a
// tensor with more than one dim runs one thread per element that adds the
// steps in order, from 0, in the tensor's own dtype for float and double
// (tensor_kernel_scan_outer_dim): the same additions as the loop, in one
// kernel. So float and double chunks on CUDA are summed with it (a running
// sum from earlier chunks goes in as step 0); other dtypes (half and bfloat16
// may accumulate wider) and the CPU (whose cumsum accumulates float in
// double) keep the loop. Starting from 0 changes one thing: a sum of -0.0
// steps is +0.0, which compares equal. The test
// TimeChunks.SumsOverStepsAddInStepOrderAndGraphedCallsReplay_CUDA holds the
// scan to the loop, bit for bit, for several chunk sizes.
/// Whether `chunk`'s steps may be summed by one cumsum (see above).
MPIPE_FUNC bool scan_sums(const at::Tensor& chunk) {
  const auto dtype = chunk.scalar_type();
  return chunk.is_cuda() && chunk.dim() >= 2 && chunk.size(0) > 1 &&
         (dtype == at::kFloat || dtype == at::kDouble);
}

/// The last row of `steps`' running sum, as a tensor of its own.
MPIPE_FUNC at::Tensor scanned_sum(const at::Tensor& steps) {
  return steps.cumsum(0).select(0, steps.size(0) - 1).clone();
}

/// The steps of `chunk` summed one at a time onto `sum`.
MPIPE_FUNC at::Tensor add_steps(at::Tensor sum, const at::Tensor& chunk) {
  if (scan_sums(chunk) && sum.scalar_type() == chunk.scalar_type() &&
      sum.device() == chunk.device() && sum.sizes() == chunk.sizes().slice(1)) {
    return scanned_sum(at::cat({sum.unsqueeze(0), chunk}));  // the scan starts from 0: 0 + sum is sum (a -0 becomes +0)
  }
  for (int64_t t = 0; t < chunk.size(0); ++t) sum = sum + chunk[t];
  return sum;
}

/// chunk[0] + chunk[1] + ..., one at a time.
MPIPE_FUNC at::Tensor sum_steps(const at::Tensor& chunk) {
  if (chunk.size(0) == 1) return chunk[0].clone();
  if (scan_sums(chunk)) return scanned_sum(chunk);  // likewise, 0 + chunk[0] is chunk[0]
  return add_steps(chunk[0], chunk.narrow(0, 1, chunk.size(0) - 1));  // the loop, as above
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
    return add_steps(acc, chunk);
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
    return sum_steps(chunk);
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
