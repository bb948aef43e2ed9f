#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/snn/fused_neuron.h"

#include "mpipe/snn/neuron.h"

#include <ATen/Dispatch.h>
#include <ATen/Functions.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#ifdef MPIPE_CUDA_KERNELS
#include "mpipe/detail/snn/fused_neuron_kernels.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <atomic>
#include <vector>

namespace mpipe {
namespace detail {
/// The fused-step CUDA kernels launched so far (fused_cuda_kernel_launches).
MPIPE_INLINE_VAR std::atomic<int64_t> cuda_launches{0};
}  // namespace detail

namespace snn {

MPIPE_FUNC bool fused_cuda_kernels_built() noexcept {
#ifdef MPIPE_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

}  // namespace snn

namespace detail {

MPIPE_FUNC int64_t fused_cuda_kernel_launches() noexcept {
  return cuda_launches.load(std::memory_order_relaxed);
}

// Note [Fused neurons]
// ~~~~~~~~~~~~~~~~~~~~
// The ATen path of a neuron step (neuron-inl.h) is about ten elementwise ops
// forward and twenty backward, each a kernel launch and an autograd node; on
// the small tensors of SNN time steps the host's per-op cost, not the GPU,
// sets the time. The fused step is one autograd node with one kernel each way:
// forward computes (spike, v_next) and saves the charged potential h; backward
// computes the surrogate gradient from h and returns the gradients of x and v
// (neuron_math.h holds the arithmetic, shared by the CPU loop and the CUDA
// kernel). It is the default (IFNodeOptions / LIFNodeOptions::fused); the ATen
// path remains the fallback (fused(false), or CUDA tensors in a build without
// the kernels) and the reference the tests compare the fused step with.

MPIPE_FUNC bool fused_neuron_supported(const at::Tensor& x) {
  if (x.device().is_cpu()) return true;
#ifdef MPIPE_CUDA_KERNELS
  return x.is_cuda();
#else
  return false;
#endif
}


#ifdef MPIPE_CUDA_KERNELS
MPIPE_FUNC int kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kFloat32;
    case at::kDouble: return kFloat64;
    case at::kHalf: return kFloat16;
    case at::kBFloat16: return kBFloat16;
    default: TORCH_CHECK(false, "mpipe::snn: the fused neuron step does not support ", t);
  }
}

/// One fused kernel on `device`'s current stream: `launch(stream)` starts it
/// and returns CUDA's error text, or nullptr.
template <typename Launch>
void run_kernel(c10::Device device, const char* what, Launch launch) {
  c10::cuda::CUDAGuard guard(device);
  const char* err = launch(c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "mpipe::snn: fused ", what, " kernel: ", err);
  cuda_launches.fetch_add(1, std::memory_order_relaxed);
}
#endif

MPIPE_FUNC std::vector<at::Tensor> steps_forward(const at::Tensor& x_in, const at::Tensor& v_in,
                                                 const NeuronSpec& spec);
MPIPE_FUNC std::vector<at::Tensor> steps_backward(const at::Tensor& gs_in, const at::Tensor& gv_in,
                                                  const at::Tensor& h, const NeuronSpec& spec);

/// (spike, v_next, h).
MPIPE_FUNC std::vector<at::Tensor> step_forward(const at::Tensor& x_in, const at::Tensor& v_in,
                                                const NeuronSpec& spec) {
  const at::Tensor x = x_in.contiguous(), v = v_in.contiguous();
#ifdef MPIPE_CUDA_KERNELS
  if (x.is_cuda()) {
    at::Tensor spike = at::empty_like(x), v_next = at::empty_like(x), h = at::empty_like(x);
    const int64_t n = x.numel();
    run_kernel(x.device(), "neuron forward", [&](void* stream) {
      return launch_neuron_forward(kernel_dtype(x.scalar_type()), x.data_ptr(), v.data_ptr(),
                                   spike.data_ptr(), v_next.data_ptr(), h.data_ptr(), n, spec,
                                   stream);
    });
    return {spike, v_next, h};
  }
#endif
  // On the CPU a step is the multi-step loop with T = 1: the same arithmetic.
  std::vector<at::Tensor> out = steps_forward(x.unsqueeze(0), v, spec);
  return {out[0].squeeze(0), out[1], out[2].squeeze(0)};
}

/// (grad_x, grad_v_prev); an undefined output gradient counts as zero.
MPIPE_FUNC std::vector<at::Tensor> step_backward(const at::Tensor& gs_in, const at::Tensor& gv_in,
                                                 const at::Tensor& h, const NeuronSpec& spec) {
  const at::Tensor gs = gs_in.defined() ? gs_in.contiguous() : gs_in;
  const at::Tensor gv = gv_in.defined() ? gv_in.contiguous() : gv_in;
#ifdef MPIPE_CUDA_KERNELS
  if (h.is_cuda()) {
    at::Tensor gx = at::empty_like(h), gvp = at::empty_like(h);
    const int64_t n = h.numel();
    run_kernel(h.device(), "neuron backward", [&](void* stream) {
      return launch_neuron_backward(kernel_dtype(h.scalar_type()),
                                    gs.defined() ? gs.data_ptr() : nullptr,
                                    gv.defined() ? gv.data_ptr() : nullptr, h.data_ptr(),
                                    gx.data_ptr(), gvp.data_ptr(), n, spec, stream);
    });
    return {gx, gvp};
  }
#endif
  std::vector<at::Tensor> g =
      steps_backward(gs.defined() ? gs.unsqueeze(0) : gs, gv, h.unsqueeze(0), spec);
  return {g[0].squeeze(0), g[1]};
}

// Note [Multi-step neurons]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A multi-step call (StepMode::Multi, SpikingJelly's step_mode 'm') runs the
// T steps of a [T, N, ...] input as one autograd node: forward walks t = 0..T-1
// per element with v in a register, backward walks t = T-1..0 carrying v's
// gradient, each one kernel on CUDA and one parallel loop on the CPU. The
// carried v (forward) and its gradient (backward) are rounded to the storage
// type after every step, as a single step stores v_next and autograd hands
// its gradient on, so the values and the BPTT gradients equal those of T
// single fused steps bit for bit (tests compare with tolerance 0). h, the
// charged potential of every step, is saved for backward as [T, N, ...]:
// the same memory as T single steps.

/// Elements per tile of the CPU loops over T steps.
constexpr int64_t kTile = 256;

/// (spikes [T, ...], v_last, h [T, ...]) from x [T, ...] and v0.
MPIPE_FUNC std::vector<at::Tensor> steps_forward(const at::Tensor& x_in, const at::Tensor& v_in,
                                                 const NeuronSpec& spec) {
  const at::Tensor x = x_in.contiguous(), v0 = v_in.contiguous();
  at::Tensor spike = at::empty_like(x), h = at::empty_like(x), v_last = at::empty_like(v0);
  const int64_t T = x.size(0), n = v0.numel();
#ifdef MPIPE_CUDA_KERNELS
  if (x.is_cuda()) {
    run_kernel(x.device(), "multi-step neuron forward", [&](void* stream) {
      return launch_neuron_forward_steps(kernel_dtype(x.scalar_type()), x.data_ptr(),
                                         v0.data_ptr(), spike.data_ptr(), v_last.data_ptr(),
                                         h.data_ptr(), T, n, spec, stream);
    });
    return {spike, v_last, h};
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "mpipe_neuron_fwd_steps", [&] {
    using A = at::opmath_type<scalar_t>;
    const NeuronConsts<A> c(spec);
    const scalar_t* px = x.data_ptr<scalar_t>();
    const scalar_t* pv = v0.data_ptr<scalar_t>();
    scalar_t* ps = spike.data_ptr<scalar_t>();
    scalar_t* pl = v_last.data_ptr<scalar_t>();
    scalar_t* ph = h.data_ptr<scalar_t>();
    // Tiles of elements, t outer and elements inner: the inner loop has no
    // dependence between iterations, so it vectorises like the single step's.
    at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
      scalar_t v[kTile];
      for (int64_t b = begin; b < end; b += kTile) {
        const int64_t m = std::min<int64_t>(kTile, end - b);
        for (int64_t i = 0; i < m; ++i) v[i] = pv[b + i];
        for (int64_t t = 0; t < T; ++t) {
          const int64_t o = t * n + b;
          for (int64_t i = 0; i < m; ++i) {
            ph[o + i] = static_cast<scalar_t>(
                neuron_charge<A>(c, static_cast<A>(px[o + i]), static_cast<A>(v[i])));
            A s, vn;
            neuron_fire<A>(c, static_cast<A>(ph[o + i]), s, vn);
            ps[o + i] = static_cast<scalar_t>(s);
            v[i] = static_cast<scalar_t>(vn);
          }
        }
        for (int64_t i = 0; i < m; ++i) pl[b + i] = v[i];
      }
    });
  });
  return {spike, v_last, h};
}

/// (grad_x [T, ...], grad_v0); an undefined output gradient counts as zero.
MPIPE_FUNC std::vector<at::Tensor> steps_backward(const at::Tensor& gs_in, const at::Tensor& gv_in,
                                                  const at::Tensor& h, const NeuronSpec& spec) {
  const at::Tensor gs = gs_in.defined() ? gs_in.contiguous() : gs_in;
  const at::Tensor gv = gv_in.defined() ? gv_in.contiguous() : gv_in;
  const int64_t T = h.size(0);
  at::Tensor gx = at::empty_like(h), gv0 = at::empty(h.sizes().slice(1), h.options());
  const int64_t n = gv0.numel();
#ifdef MPIPE_CUDA_KERNELS
  if (h.is_cuda()) {
    run_kernel(h.device(), "multi-step neuron backward", [&](void* stream) {
      return launch_neuron_backward_steps(kernel_dtype(h.scalar_type()),
                                          gs.defined() ? gs.data_ptr() : nullptr,
                                          gv.defined() ? gv.data_ptr() : nullptr, h.data_ptr(),
                                          gx.data_ptr(), gv0.data_ptr(), T, n, spec, stream);
    });
    return {gx, gv0};
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "mpipe_neuron_bwd_steps", [&] {
    using A = at::opmath_type<scalar_t>;
    const NeuronConsts<A> c(spec);
    const scalar_t* pgs = gs.defined() ? gs.data_ptr<scalar_t>() : nullptr;
    const scalar_t* pgv = gv.defined() ? gv.data_ptr<scalar_t>() : nullptr;
    const scalar_t* ph = h.data_ptr<scalar_t>();
    scalar_t* pgx = gx.data_ptr<scalar_t>();
    scalar_t* pg0 = gv0.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
      scalar_t g[kTile];
      for (int64_t b = begin; b < end; b += kTile) {
        const int64_t m = std::min<int64_t>(kTile, end - b);
        for (int64_t i = 0; i < m; ++i) g[i] = pgv ? pgv[b + i] : scalar_t(0);
        for (int64_t t = T - 1; t >= 0; --t) {
          const int64_t o = t * n + b;
          for (int64_t i = 0; i < m; ++i) {
            A a, r;
            neuron_backward<A>(c, pgs ? static_cast<A>(pgs[o + i]) : A(0), static_cast<A>(g[i]),
                               static_cast<A>(ph[o + i]), a, r);
            pgx[o + i] = static_cast<scalar_t>(a);
            g[i] = static_cast<scalar_t>(r);
          }
        }
        for (int64_t i = 0; i < m; ++i) pg0[b + i] = g[i];
      }
    });
  });
  return {gx, gv0};
}

MPIPE_FUNC std::vector<double> pack(const NeuronSpec& s) {
  return {static_cast<double>(s.charge), s.tau, s.v_threshold, s.v_reset,
          s.hard_reset ? 1.0 : 0.0, s.detach_reset ? 1.0 : 0.0,
          static_cast<double>(s.surrogate), s.alpha};
}

MPIPE_FUNC NeuronSpec unpack(const std::vector<double>& p) {
  NeuronSpec s;
  s.charge = static_cast<int>(p[0]);
  s.tau = p[1];
  s.v_threshold = p[2];
  s.v_reset = p[3];
  s.hard_reset = p[4] != 0;
  s.detach_reset = p[5] != 0;
  s.surrogate = static_cast<int>(p[6]);
  s.alpha = p[7];
  return s;
}

// One autograd node per fused call, for one step (FusedNeuronStep) or for T
// steps (FusedNeuronSteps): Forward returns (spike, v_next, h), Backward the
// gradients of x and v; h is what backward needs.
template <typename Self, auto Forward, auto Backward>
struct FusedNeuronFunction : torch::autograd::Function<Self> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& v,
                                                const NeuronSpec& spec) {
    std::vector<at::Tensor> out = Forward(x, v, spec);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({out[2]});
    ctx->saved_data["spec"] = pack(spec);
    return {out[0], out[1]};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor h = ctx->get_saved_variables()[0];
    const NeuronSpec spec = unpack(ctx->saved_data["spec"].toDoubleVector());
    std::vector<at::Tensor> g = Backward(grads[0], grads[1], h, spec);
    return {g[0], g[1], at::Tensor()};
  }
};
struct FusedNeuronStep : FusedNeuronFunction<FusedNeuronStep, step_forward, step_backward> {};
struct FusedNeuronSteps : FusedNeuronFunction<FusedNeuronSteps, steps_forward, steps_backward> {};


MPIPE_FUNC std::pair<at::Tensor, at::Tensor> fused_neuron_step(const at::Tensor& x,
                                                               const at::Tensor& v,
                                                               const NeuronSpec& spec) {
  torch::autograd::variable_list out = FusedNeuronStep::apply(x, v, spec);
  return {out[0], out[1]};
}

MPIPE_FUNC std::pair<at::Tensor, at::Tensor> fused_neuron_steps(const at::Tensor& x,
                                                                const at::Tensor& v,
                                                                const NeuronSpec& spec) {
  torch::autograd::variable_list out = FusedNeuronSteps::apply(x, v, spec);
  return {out[0], out[1]};
}

}  // namespace detail
}  // namespace mpipe
