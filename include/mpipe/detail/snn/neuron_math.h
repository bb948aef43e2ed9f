#pragma once

// Private: one neuron time step, element by element, for the fused kernels
// (Note [Fused neurons] in fused_neuron-inl.h). Plain C++ with no LibTorch
// includes, so that the CUDA file compiles with nvcc alone; the CPU loop and
// the CUDA kernel share these functions, so CI checks the arithmetic that the
// GPU runs.

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MPIPE_HD __host__ __device__
#else
#define MPIPE_HD
#endif

namespace mpipe {
namespace detail {

enum ChargeKind : int { kChargeIF = 0, kChargeLIFDecayInput = 1, kChargeLIF = 2 };
// The order of snn::Surrogate::Kind.
enum SurrogateKind : int {
  kSurrogateSigmoid = 0,
  kSurrogateATan = 1,
  kSurrogatePiecewiseQuadratic = 2,
  kSurrogateSoftSign = 3,
  kSurrogateErf = 4,
};

/// A neuron's settings, in double; NeuronConsts<A> holds them in the type
/// the arithmetic runs in.
struct NeuronSpec {
  int charge = kChargeLIFDecayInput;
  double tau = 2.0;
  double v_threshold = 1.0;
  double v_reset = 0.0;  // hard reset value; unused with soft reset
  bool hard_reset = true;
  bool detach_reset = false;
  int surrogate = kSurrogateSigmoid;
  double alpha = 4.0;
};

template <typename A>
struct NeuronConsts {
  int charge;
  bool hard_reset, detach_reset;
  int surrogate;
  A tau, thr, vr, alpha, atan_scale, atan_half_alpha, inv_alpha, alpha_sq, erf_scale, dh_dx, dh_dv;

  explicit NeuronConsts(const NeuronSpec& s)
      : charge(s.charge),
        hard_reset(s.hard_reset),
        detach_reset(s.detach_reset),
        surrogate(s.surrogate),
        tau(static_cast<A>(s.tau)),
        thr(static_cast<A>(s.v_threshold)),
        vr(static_cast<A>(s.hard_reset ? s.v_reset : 0.0)),
        alpha(static_cast<A>(s.alpha)),
        atan_scale(static_cast<A>(3.14159265358979323846 / 2 * s.alpha)),
        atan_half_alpha(static_cast<A>(s.alpha / 2)),
        inv_alpha(static_cast<A>(1 / s.alpha)),
        alpha_sq(static_cast<A>(s.alpha * s.alpha)),
        erf_scale(static_cast<A>(s.alpha / 1.7724538509055160273)),  // alpha / sqrt(pi)
        dh_dx(static_cast<A>(s.charge == kChargeLIFDecayInput ? 1.0 / s.tau : 1.0)),
        dh_dv(static_cast<A>(s.charge == kChargeIF ? 1.0 : 1.0 - 1.0 / s.tau)) {}
};

MPIPE_HD inline float neuron_exp(float x) { return expf(x); }
MPIPE_HD inline double neuron_exp(double x) { return exp(x); }

/// Charge: the same operations, in the same order, as the ATen path in
/// neuron-inl.h, so that float results agree to rounding. Callers round h to
/// the stored type before neuron_fire, as the ATen path stores it, so that
/// forward and backward (which reads the stored h) see the same spike.
template <typename A>
MPIPE_HD inline A neuron_charge(const NeuronConsts<A>& c, A x, A v) {
  if (c.charge == kChargeIF) return v + x;
  if (c.charge == kChargeLIFDecayInput) return v + (x - (v - c.vr)) / c.tau;
  return v - (v - c.vr) / c.tau + x;
}

/// Fire and reset from the charged potential h.
template <typename A>
MPIPE_HD inline void neuron_fire(const NeuronConsts<A>& c, A h, A& spike, A& v_next) {
  const bool fire = h - c.thr >= A(0);
  spike = fire ? A(1) : A(0);
  v_next = fire ? (c.hard_reset ? c.vr : h - c.thr) : h;
}

/// Gradients of one step from those of its outputs (spike, v_next), given
/// the charged potential h that forward saved. `gs` and `gv` are 0 where the
/// output got no gradient.
template <typename A>
MPIPE_HD inline void neuron_backward(const NeuronConsts<A>& c, A gs, A gv, A h, A& gx,
                                     A& gv_prev) {
  const A u = h - c.thr;
  A sg;
  const A au = u < A(0) ? -u : u;
  if (c.surrogate == kSurrogateSigmoid) {
    const A sig = A(1) / (A(1) + neuron_exp(-(u * c.alpha)));
    sg = sig * (A(1) - sig) * c.alpha;
  } else if (c.surrogate == kSurrogateATan) {
    const A w = u * c.atan_scale;
    sg = c.atan_half_alpha / (w * w + A(1));
  } else if (c.surrogate == kSurrogatePiecewiseQuadratic) {
    sg = au > c.inv_alpha ? A(0) : au * (-c.alpha_sq) + c.alpha;
  } else if (c.surrogate == kSurrogateSoftSign) {
    const A d = au * c.alpha + A(1);
    sg = c.alpha / (d * d * A(2));
  } else {  // Erf
    const A w = u * c.alpha;
    sg = neuron_exp(-(w * w)) * c.erf_scale;
  }
  const A s = u >= A(0) ? A(1) : A(0);
  // v_next = h (1 - s) + v_reset s (hard) or h - v_threshold s (soft).
  const A dvn_dh = c.hard_reset ? A(1) - s : A(1);
  const A dvn_ds = c.hard_reset ? c.vr - h : -c.thr;
  const A gs_total = c.detach_reset ? gs : gs + gv * dvn_ds;
  const A gh = gs_total * sg + gv * dvn_dh;
  gx = gh * c.dh_dx;
  gv_prev = gh * c.dh_dv;
}

}  // namespace detail
}  // namespace mpipe
