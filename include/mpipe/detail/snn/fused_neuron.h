#pragma once

// Private: the fused neuron step as an autograd function (Note [Fused neurons]).

#include "mpipe/detail/snn/neuron_math.h"

#include <ATen/core/Tensor.h>

#include <utility>

namespace mpipe {
namespace detail {

/// Whether the fused step can run on `x`'s device in this build: always on
/// the CPU; on CUDA only when the kernels were compiled (MPIPE_CUDA_KERNELS).
bool fused_neuron_supported(const at::Tensor& x);

/// One time step, differentiable: returns (spike, v_next). `v` has x's shape,
/// dtype and device.
std::pair<at::Tensor, at::Tensor> fused_neuron_step(const at::Tensor& x, const at::Tensor& v,
                                                    const NeuronSpec& spec);

/// T steps of x [T, ...] from v (x's shape without dim 0), differentiable
/// (Note [Multi-step neurons]): returns (spikes [T, ...], v after step T-1).
std::pair<at::Tensor, at::Tensor> fused_neuron_steps(const at::Tensor& x, const at::Tensor& v,
                                                     const NeuronSpec& spec);

/// How many fused-step CUDA kernels (forward and backward) this process has
/// launched so far (the tests count them).
int64_t fused_cuda_kernel_launches() noexcept;

}  // namespace detail
}  // namespace mpipe
