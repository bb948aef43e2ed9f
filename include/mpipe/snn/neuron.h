#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_NEURON_H_
#define MPIPE_SNN_NEURON_H_

// Spiking neurons in SpikingJelly's conventions. Each step:
//   charge  IF:  v = v + x
//           LIF: v = v + (x - (v - v_reset)) / tau    (decay_input, default)
//                v = v - (v - v_reset) / tau + x       (otherwise)
//   fire    s = step(v - v_threshold), surrogate gradient in backward
//   reset   hard (v_reset a number): v = v * (1 - s) + v_reset * s
//           soft (v_reset = nullopt): v = v - v_threshold * s
// detach_reset uses s.detach() inside the reset. The membrane potential is
// kept per micro-batch (Note [Per-micro-batch state] in mpipe/state.h), starts
// at v_reset (0 for soft reset), follows the input's device and dtype (float32
// for half and bfloat16 input, unless float_membrane(false)), and is cleared
// by reset_state() or mpipe::reset_states(model).
//
// Step modes (options.step_mode): StepMode::Single (default) takes one step
// per call, x [N, ...]; StepMode::Multi takes a sequence x [T, N, ...] per
// call and returns its spikes [T, N, ...], with v carried in from the last
// call and out to the next. A multi-step call runs the T steps as one fused
// kernel each way (Note [Multi-step neurons]); its values and gradients equal
// T single steps exactly. single_step() and multi_step() ignore the mode.
//
// By default (options.fused) a step runs as one fused kernel forward and one
// backward (on the CPU, and on CUDA when mpipe was built with its kernels);
// fused(false) runs the same step as separate ATen ops. Both give the same
// values and gradients (to rounding).

#include <mpipe/snn/step_mode.h>
#include <mpipe/snn/surrogate.h>
#include <mpipe/state.h>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <ostream>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {
struct NeuronSpec;  // mpipe/detail/snn/neuron_math.h
}  // namespace detail

namespace snn {

/// Options of IFNode, the integrate-and-fire neuron (SpikingJelly's defaults).
struct IFNodeOptions {
  /// The membrane potential at which the neuron fires.
  TORCH_ARG(double, v_threshold) = 1.0;
  /// A number for hard reset; std::nullopt for soft reset.
  TORCH_ARG(std::optional<double>, v_reset) = 0.0;
  /// Reset with the spike detached from autograd.
  TORCH_ARG(bool, detach_reset) = false;
  /// The surrogate gradient of the spike.
  TORCH_ARG(Surrogate, surrogate) = Surrogate::sigmoid();
  /// One fused kernel per step and direction instead of separate ATen ops.
  TORCH_ARG(bool, fused) = true;
  /// With half or bfloat16 input, keep the membrane potential in float32 and
  /// compute the step in float32 (the spikes, exactly 0 or 1, come back in the
  /// input's dtype): a membrane summed over many steps in 8 bits of mantissa
  /// drifts. Costs two casts per step; false keeps everything in the input's dtype.
  TORCH_ARG(bool, float_membrane) = true;
  /// Single: forward takes one step [N, ...]; Multi: a sequence [T, N, ...].
  TORCH_ARG(StepMode, step_mode) = StepMode::Single;
};

/// Options of LIFNode, the leaky integrate-and-fire neuron (SpikingJelly's defaults).
struct LIFNodeOptions {
  /// Membrane time constant; must be > 1.
  TORCH_ARG(double, tau) = 2.0;
  /// Charge v + (x - (v - v_reset)) / tau (true) or v - (v - v_reset) / tau + x (false).
  TORCH_ARG(bool, decay_input) = true;
  /// The membrane potential at which the neuron fires.
  TORCH_ARG(double, v_threshold) = 1.0;
  /// A number for hard reset; std::nullopt for soft reset.
  TORCH_ARG(std::optional<double>, v_reset) = 0.0;
  /// Reset with the spike detached from autograd.
  TORCH_ARG(bool, detach_reset) = false;
  /// The surrogate gradient of the spike.
  TORCH_ARG(Surrogate, surrogate) = Surrogate::sigmoid();
  /// One fused kernel per step and direction instead of separate ATen ops.
  TORCH_ARG(bool, fused) = true;
  /// With half or bfloat16 input, keep the membrane potential in float32 and
  /// compute the step in float32 (the spikes, exactly 0 or 1, come back in the
  /// input's dtype): a membrane summed over many steps in 8 bits of mantissa
  /// drifts. Costs two casts per step; false keeps everything in the input's dtype.
  TORCH_ARG(bool, float_membrane) = true;
  /// Single: forward takes one step [N, ...]; Multi: a sequence [T, N, ...].
  TORCH_ARG(StepMode, step_mode) = StepMode::Single;
};

/// Options of ParametricLIFNode, the LIF neuron with a learnable time
/// constant (SpikingJelly's ParametricLIFNode, Fang et al. 2021, and its defaults).
struct ParametricLIFNodeOptions {
  /// The time constant it starts from, tau = 1 / sigmoid(w); must be > 1.
  TORCH_ARG(double, init_tau) = 2.0;
  /// Charge v + (x - (v - v_reset)) sigmoid(w) (true) or v - (v - v_reset) sigmoid(w) + x (false).
  TORCH_ARG(bool, decay_input) = true;
  /// The membrane potential at which the neuron fires.
  TORCH_ARG(double, v_threshold) = 1.0;
  /// A number for hard reset; std::nullopt for soft reset.
  TORCH_ARG(std::optional<double>, v_reset) = 0.0;
  /// Reset with the spike detached from autograd.
  TORCH_ARG(bool, detach_reset) = false;
  /// The surrogate gradient of the spike.
  TORCH_ARG(Surrogate, surrogate) = Surrogate::sigmoid();
  /// As LIFNodeOptions::float_membrane.
  TORCH_ARG(bool, float_membrane) = true;
  /// Single: forward takes one step [N, ...]; Multi: a sequence [T, N, ...].
  TORCH_ARG(StepMode, step_mode) = StepMode::Single;
};

/// What IF and LIF share: state per micro-batch, fire, reset.
class NeuronBase : public torch::nn::Module, public Stateful {
 public:
  /// single_step(x) or multi_step(x), as step_mode() says.
  at::Tensor forward(const at::Tensor& x);
  /// One time step: charge with `x` [N, ...], fire, reset; returns the spikes.
  at::Tensor single_step(const at::Tensor& x);
  /// T time steps of `x_seq` [T, N, ...] (T may be 0); returns the spikes
  /// [T, N, ...]. Equal, values and gradients, to T single_step calls.
  at::Tensor multi_step(const at::Tensor& x_seq);
  /// How forward takes time: one step or a sequence per call.
  StepMode step_mode() const noexcept { return step_mode_; }
  /// Changes how forward takes time (the state is kept).
  void set_step_mode(StepMode mode) noexcept { step_mode_ = mode; }
  void reset_state() override { v_.clear(); }
  bool holds_state() const override { return !v_.slots().empty(); }
  /// True: the state can be saved and put back, for checkpointing and failed
  /// calls (Note [State snapshots]).
  bool supports_state_snapshots() const override { return true; }
  std::any save_state() const override { return v_.save(); }
  void load_state(const std::any& state) override { v_.load(state); }
  /// Membrane potentials, one per micro-batch seen since the last reset.
  const std::vector<at::Tensor>& membrane_potentials() const { return v_.slots(); }
  /// Counts the spikes this neuron fires (FiringRateMonitor, mpipe/snn/monitor.h):
  /// on, every step adds its spikes and elements to the count (on the
  /// spikes' device, without synchronising); recomputations and steps inside
  /// a CUDA-graph capture are not counted. `owner` names who turned it on:
  /// turning it off with another owner does nothing (the newer monitor keeps it).
  void count_spikes(bool on, const void* owner = nullptr) noexcept {
    if (!on && owner != nullptr && owner != counter_owner_) return;
    counting_ = on;
    counter_owner_ = on ? owner : nullptr;
  }
  /// The spikes counted (a scalar tensor, undefined before any) and the
  /// elements they were fired from, since the last clear_spike_count().
  std::pair<at::Tensor, int64_t> spike_count() const { return {spikes_, elements_}; }
  /// Sets the count back to none.
  void clear_spike_count() noexcept {
    spikes_ = at::Tensor();
    elements_ = 0;
  }

 protected:
  /// How the fused step charges (the ATen path calls charge()).
  enum class ChargeKind { IF, LIFDecayInput, LIF };
  NeuronBase(const char* name, double v_threshold, std::optional<double> v_reset,
             bool detach_reset, Surrogate surrogate, bool fused, bool float_membrane,
             StepMode step_mode, ChargeKind charge_kind, double tau);
  virtual at::Tensor charge(const at::Tensor& v, const at::Tensor& x) const = 0;
  /// One step in x's dtype.
  at::Tensor step(const at::Tensor& x);
  /// T steps of x [T, ...] in x's dtype.
  at::Tensor steps(const at::Tensor& x);
  /// The membrane potential of the current micro-batch, created or checked
  /// against `shape` and moved to x's device and dtype.
  at::Tensor& membrane(const at::Tensor& x, c10::IntArrayRef shape, const char* what);
  void fill_spec(detail::NeuronSpec& spec) const;
  /// One step of the ATen path, updating v.
  at::Tensor aten_step(at::Tensor& v, const at::Tensor& x) const;
  /// Adds `spikes` to the count when counting.
  void count(const at::Tensor& spikes);
  void print_common(std::ostream& stream) const;

  const char* name_;
  double v_threshold_;
  std::optional<double> v_reset_;
  bool detach_reset_;
  Surrogate surrogate_;
  bool fused_;
  bool float_membrane_;
  StepMode step_mode_;
  ChargeKind charge_kind_;
  double tau_;

 private:
  PerMicroBatch<at::Tensor> v_;
  bool counting_ = false;
  const void* counter_owner_ = nullptr;
  at::Tensor spikes_;
  int64_t elements_ = 0;
};

/// Integrate-and-fire neuron: v = v + x, then fire and reset (see the header's comment).
class IFNodeImpl : public NeuronBase {
 public:
  /// A neuron with `options`.
  explicit IFNodeImpl(IFNodeOptions options = {});
  /// Prints `mpipe::snn::IFNode(v_threshold=..., v_reset=..., ...)`.
  void pretty_print(std::ostream& stream) const override;
  /// The options it was built with.
  const IFNodeOptions options;

 protected:
  at::Tensor charge(const at::Tensor& v, const at::Tensor& x) const override;
};
/// A holder for IFNodeImpl, as torch::nn's modules have.
TORCH_MODULE(IFNode);

/// Leaky integrate-and-fire neuron: v decays towards v_reset with time
/// constant tau while it charges, then fires and resets (see the header's comment).
class LIFNodeImpl : public NeuronBase {
 public:
  /// A neuron with `options`; throws c10::Error unless tau is finite and > 1.
  explicit LIFNodeImpl(LIFNodeOptions options = {});
  /// Prints `mpipe::snn::LIFNode(tau=..., decay_input=..., v_threshold=..., ...)`.
  void pretty_print(std::ostream& stream) const override;
  /// The options it was built with.
  const LIFNodeOptions options;

 protected:
  at::Tensor charge(const at::Tensor& v, const at::Tensor& x) const override;
};
/// A holder for LIFNodeImpl, as torch::nn's modules have.
TORCH_MODULE(LIFNode);

/// Leaky integrate-and-fire neuron whose time constant is learnt: a
/// parameter w, tau = 1 / sigmoid(w) (SpikingJelly's ParametricLIFNode). Each
/// step charges v + (x - (v - v_reset)) sigmoid(w) (decay_input) or
/// v - (v - v_reset) sigmoid(w) + x, then fires and resets as the others.
/// Runs as ATen ops (no fused kernel: w needs its gradient).
class ParametricLIFNodeImpl : public NeuronBase {
 public:
  /// A neuron with `options`; throws c10::Error unless init_tau is finite and > 1.
  explicit ParametricLIFNodeImpl(ParametricLIFNodeOptions options = {});
  /// The current time constant, 1 / sigmoid(w).
  double tau() const;
  /// Prints `mpipe::snn::ParametricLIFNode(tau=..., decay_input=..., ...)`.
  void pretty_print(std::ostream& stream) const override;
  /// The options it was built with.
  const ParametricLIFNodeOptions options;
  /// The learnt parameter, a scalar: tau = 1 / sigmoid(w).
  at::Tensor w;

 protected:
  at::Tensor charge(const at::Tensor& v, const at::Tensor& x) const override;
};
/// A holder for ParametricLIFNodeImpl, as torch::nn's modules have.
TORCH_MODULE(ParametricLIFNode);

/// Whether this build holds the fused neuron CUDA kernels (built into
/// mpipe::mpipe when CMake found nvcc, option MPIPE_CUDA_KERNELS; never in
/// header-only mode, mpipe::mpipe_header_only). Without them fused neurons run
/// their ATen path on the GPU: the same results, more kernel launches.
bool fused_cuda_kernels_built() noexcept;

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_NEURON_H_
