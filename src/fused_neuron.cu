// The fused neuron kernels (Note [Fused neurons] in fused_neuron.cpp): one
// kernel per time step forward, one backward, for every element type LibTorch
// uses for floating point. Half and bfloat16 compute in float.

#include "mpipe/detail/snn/fused_neuron_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace mpipe {
namespace detail {

namespace {

template <typename S>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ double load(const double* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(double* p, int64_t i, double v) { p[i] = v; }
__device__ __forceinline__ void store(__half* p, int64_t i, float v) { p[i] = __float2half(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16(v);
}

// A value as it is after a store and a load in S: what a single step hands
// the next one through its stored v_next.
__device__ __forceinline__ float as_stored(float v, const float*) { return v; }
__device__ __forceinline__ double as_stored(double v, const double*) { return v; }
__device__ __forceinline__ float as_stored(float v, const __half*) {
  return __half2float(__float2half(v));
}
__device__ __forceinline__ float as_stored(float v, const __nv_bfloat16*) {
  return __bfloat162float(__float2bfloat16(v));
}

template <typename S>
__global__ void forward_kernel(const S* __restrict__ x, const S* __restrict__ v,
                               S* __restrict__ spike, S* __restrict__ v_next, S* __restrict__ h,
                               int64_t n, NeuronConsts<typename Acc<S>::type> c) {
  using A = typename Acc<S>::type;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    store(h, i, neuron_charge<A>(c, load(x, i), load(v, i)));
    A s, vn;
    neuron_fire<A>(c, load(h, i), s, vn);  // from h as stored: backward reads the same
    store(spike, i, s);
    store(v_next, i, vn);
  }
}

template <typename S>
__global__ void backward_kernel(const S* __restrict__ grad_spike, const S* __restrict__ grad_v_next,
                                const S* __restrict__ h, S* __restrict__ grad_x,
                                S* __restrict__ grad_v_prev, int64_t n,
                                NeuronConsts<typename Acc<S>::type> c) {
  using A = typename Acc<S>::type;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const A gs = grad_spike ? load(grad_spike, i) : A(0);
    const A gv = grad_v_next ? load(grad_v_next, i) : A(0);
    A gx, gvp;
    neuron_backward<A>(c, gs, gv, load(h, i), gx, gvp);
    store(grad_x, i, gx);
    store(grad_v_prev, i, gvp);
  }
}

// Note [Multi-step neurons] in fused_neuron.cpp: one thread per element
// walks the T steps with v in a register, rounded as a stored v_next would
// be, so the results equal T single-step kernels bit for bit.
template <typename S>
__global__ void forward_steps_kernel(const S* __restrict__ x, const S* __restrict__ v0,
                                     S* __restrict__ spike, S* __restrict__ v_last,
                                     S* __restrict__ h, int64_t T, int64_t n,
                                     NeuronConsts<typename Acc<S>::type> c) {
  using A = typename Acc<S>::type;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    A v = load(v0, i);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t k = t * n + i;
      const A hv = as_stored(neuron_charge<A>(c, load(x, k), v), h);
      store(h, k, hv);
      A s, vn;
      neuron_fire<A>(c, hv, s, vn);
      store(spike, k, s);
      v = as_stored(vn, h);
    }
    store(v_last, i, v);
  }
}

template <typename S>
__global__ void backward_steps_kernel(const S* __restrict__ grad_spike,
                                      const S* __restrict__ grad_v_last, const S* __restrict__ h,
                                      S* __restrict__ grad_x, S* __restrict__ grad_v0, int64_t T,
                                      int64_t n, NeuronConsts<typename Acc<S>::type> c) {
  using A = typename Acc<S>::type;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    A gv = grad_v_last ? load(grad_v_last, i) : A(0);
    for (int64_t t = T - 1; t >= 0; --t) {
      const int64_t k = t * n + i;
      const A gs = grad_spike ? load(grad_spike, k) : A(0);
      A gx, gvp;
      neuron_backward<A>(c, gs, gv, load(h, k), gx, gvp);
      store(grad_x, k, gx);
      gv = as_stored(gvp, h);
    }
    store(grad_v0, i, gv);
  }
}

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 ? b : 65535);  // grid-stride loops cover the rest
}

template <typename S>
const char* forward_as(const void* x, const void* v, void* spike, void* v_next, void* h,
                       int64_t n, const NeuronSpec& spec, void* stream) {
  if (n == 0) return nullptr;
  forward_kernel<S><<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const S*>(x), static_cast<const S*>(v), static_cast<S*>(spike),
      static_cast<S*>(v_next), static_cast<S*>(h), n, NeuronConsts<typename Acc<S>::type>(spec));
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename S>
const char* backward_as(const void* grad_spike, const void* grad_v_next, const void* h,
                        void* grad_x, void* grad_v_prev, int64_t n, const NeuronSpec& spec,
                        void* stream) {
  if (n == 0) return nullptr;
  backward_kernel<S><<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const S*>(grad_spike), static_cast<const S*>(grad_v_next),
      static_cast<const S*>(h), static_cast<S*>(grad_x), static_cast<S*>(grad_v_prev), n,
      NeuronConsts<typename Acc<S>::type>(spec));
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename S>
const char* forward_steps_as(const void* x, const void* v0, void* spike, void* v_last, void* h,
                             int64_t T, int64_t n, const NeuronSpec& spec, void* stream) {
  if (n == 0 || T == 0) return nullptr;
  forward_steps_kernel<S><<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const S*>(x), static_cast<const S*>(v0), static_cast<S*>(spike),
      static_cast<S*>(v_last), static_cast<S*>(h), T, n,
      NeuronConsts<typename Acc<S>::type>(spec));
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

template <typename S>
const char* backward_steps_as(const void* grad_spike, const void* grad_v_last, const void* h,
                              void* grad_x, void* grad_v0, int64_t T, int64_t n,
                              const NeuronSpec& spec, void* stream) {
  if (n == 0 || T == 0) return nullptr;
  backward_steps_kernel<S><<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const S*>(grad_spike), static_cast<const S*>(grad_v_last),
      static_cast<const S*>(h), static_cast<S*>(grad_x), static_cast<S*>(grad_v0), T, n,
      NeuronConsts<typename Acc<S>::type>(spec));
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* launch_neuron_forward(int dtype, const void* x, const void* v, void* spike,
                                  void* v_next, void* h, int64_t n, const NeuronSpec& spec,
                                  void* stream) {
  switch (dtype) {
    case kFloat32: return forward_as<float>(x, v, spike, v_next, h, n, spec, stream);
    case kFloat64: return forward_as<double>(x, v, spike, v_next, h, n, spec, stream);
    case kFloat16: return forward_as<__half>(x, v, spike, v_next, h, n, spec, stream);
    case kBFloat16: return forward_as<__nv_bfloat16>(x, v, spike, v_next, h, n, spec, stream);
    default: return "mpipe: unsupported dtype for the fused neuron kernel";
  }
}

const char* launch_neuron_backward(int dtype, const void* grad_spike, const void* grad_v_next,
                                   const void* h, void* grad_x, void* grad_v_prev, int64_t n,
                                   const NeuronSpec& spec, void* stream) {
  switch (dtype) {
    case kFloat32:
      return backward_as<float>(grad_spike, grad_v_next, h, grad_x, grad_v_prev, n, spec, stream);
    case kFloat64:
      return backward_as<double>(grad_spike, grad_v_next, h, grad_x, grad_v_prev, n, spec, stream);
    case kFloat16:
      return backward_as<__half>(grad_spike, grad_v_next, h, grad_x, grad_v_prev, n, spec, stream);
    case kBFloat16:
      return backward_as<__nv_bfloat16>(grad_spike, grad_v_next, h, grad_x, grad_v_prev, n, spec,
                                        stream);
    default: return "mpipe: unsupported dtype for the fused neuron kernel";
  }
}

const char* launch_neuron_forward_steps(int dtype, const void* x, const void* v0, void* spike,
                                        void* v_last, void* h, int64_t T, int64_t n,
                                        const NeuronSpec& spec, void* stream) {
  switch (dtype) {
    case kFloat32: return forward_steps_as<float>(x, v0, spike, v_last, h, T, n, spec, stream);
    case kFloat64: return forward_steps_as<double>(x, v0, spike, v_last, h, T, n, spec, stream);
    case kFloat16: return forward_steps_as<__half>(x, v0, spike, v_last, h, T, n, spec, stream);
    case kBFloat16:
      return forward_steps_as<__nv_bfloat16>(x, v0, spike, v_last, h, T, n, spec, stream);
    default: return "mpipe: unsupported dtype for the fused neuron kernel";
  }
}

const char* launch_neuron_backward_steps(int dtype, const void* grad_spike,
                                         const void* grad_v_last, const void* h, void* grad_x,
                                         void* grad_v0, int64_t T, int64_t n,
                                         const NeuronSpec& spec, void* stream) {
  switch (dtype) {
    case kFloat32:
      return backward_steps_as<float>(grad_spike, grad_v_last, h, grad_x, grad_v0, T, n, spec,
                                      stream);
    case kFloat64:
      return backward_steps_as<double>(grad_spike, grad_v_last, h, grad_x, grad_v0, T, n, spec,
                                       stream);
    case kFloat16:
      return backward_steps_as<__half>(grad_spike, grad_v_last, h, grad_x, grad_v0, T, n, spec,
                                       stream);
    case kBFloat16:
      return backward_steps_as<__nv_bfloat16>(grad_spike, grad_v_last, h, grad_x, grad_v0, T, n,
                                              spec, stream);
    default: return "mpipe: unsupported dtype for the fused neuron kernel";
  }
}

}  // namespace detail
}  // namespace mpipe
