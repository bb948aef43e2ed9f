#pragma once

// Private: launchers of the fused neuron CUDA kernels (fused_neuron.cu). No
// LibTorch types here: the .cu file compiles with nvcc and the CUDA runtime
// alone. Each returns nullptr, or the CUDA error's text.

#include "mpipe/detail/snn/neuron_math.h"

#include <cstdint>

namespace mpipe {
namespace detail {

enum KernelDtype : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

/// spike, v_next and h (the charged potential, saved for backward) from x, v.
const char* launch_neuron_forward(int dtype, const void* x, const void* v, void* spike,
                                  void* v_next, void* h, int64_t n, const NeuronSpec& spec,
                                  void* stream);

/// grad_x and grad_v_prev from the outputs' gradients (either may be null: no
/// gradient) and the saved h.
const char* launch_neuron_backward(int dtype, const void* grad_spike, const void* grad_v_next,
                                   const void* h, void* grad_x, void* grad_v_prev, int64_t n,
                                   const NeuronSpec& spec, void* stream);

/// T steps in one kernel (Note [Multi-step neurons]): x, spike and h are
/// [T, n] (time-major), v0 and v_last are [n].
const char* launch_neuron_forward_steps(int dtype, const void* x, const void* v0, void* spike,
                                        void* v_last, void* h, int64_t T, int64_t n,
                                        const NeuronSpec& spec, void* stream);

/// The T steps' backward, t = T-1 down to 0: grad_x [T, n] and grad_v0 [n]
/// from grad_spike [T, n] and grad_v_last [n] (either may be null) and h.
const char* launch_neuron_backward_steps(int dtype, const void* grad_spike,
                                         const void* grad_v_last, const void* h, void* grad_x,
                                         void* grad_v0, int64_t T, int64_t n,
                                         const NeuronSpec& spec, void* stream);

}  // namespace detail
}  // namespace mpipe
