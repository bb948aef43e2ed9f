#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/snn/dropout.h"
#include "mpipe/snn/neuron.h"

#include "mpipe/checkpoint.h"

#include "mpipe/detail/cuda/device_probe.h"
#include "mpipe/detail/snn/fused_neuron.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace mpipe {
namespace snn {

MPIPE_FUNC NeuronBase::NeuronBase(const char* name, double v_threshold,
                                  std::optional<double> v_reset, bool detach_reset,
                                  Surrogate surrogate, bool fused, bool float_membrane,
                                  StepMode step_mode, ChargeKind charge_kind, double tau)
    : name_(name),
      v_threshold_(v_threshold),
      v_reset_(v_reset),
      detach_reset_(detach_reset),
      surrogate_(surrogate),
      fused_(fused),
      float_membrane_(float_membrane),
      step_mode_(step_mode),
      charge_kind_(charge_kind),
      tau_(tau) {
  TORCH_CHECK(std::isfinite(v_threshold), "mpipe::snn::", name,
              ": v_threshold must be finite, got ", v_threshold);
  TORCH_CHECK(!v_reset || std::isfinite(*v_reset), "mpipe::snn::", name,
              ": v_reset must be finite (or nullopt for soft reset), got ", *v_reset);
}

MPIPE_FUNC at::Tensor NeuronBase::forward(const at::Tensor& x) {
  return step_mode_ == StepMode::Multi ? multi_step(x) : single_step(x);
}

}  // namespace snn

namespace detail {
/// Half and bfloat16 inputs widened to float for a float membrane.
MPIPE_FUNC bool widens(bool float_membrane, const at::Tensor& x) {
  return float_membrane && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16);
}
}  // namespace detail

namespace snn {

MPIPE_FUNC at::Tensor NeuronBase::single_step(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.defined(), "mpipe::snn::", name_, ": the input is undefined");
  TORCH_CHECK(at::isFloatingType(x_in.scalar_type()), "mpipe::snn::", name_,
              ": the input must be floating point, got ", x_in.scalar_type());
  const bool widen = detail::widens(float_membrane_, x_in);
  const at::Tensor x = widen ? x_in.to(at::kFloat) : x_in;
  at::Tensor spike = step(x);
  count(spike);
  return widen ? spike.to(x_in.scalar_type()) : spike;
}

MPIPE_FUNC void NeuronBase::count(const at::Tensor& spikes) {
  if (!counting_ || is_recomputing() || detail::capturing_graph(spikes.device())) return;
  const at::Tensor n = spikes.detach().sum(at::kDouble);
  spikes_ = spikes_.defined() ? spikes_ + n : n;
  elements_ += spikes.numel();
}

MPIPE_FUNC at::Tensor NeuronBase::multi_step(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.defined(), "mpipe::snn::", name_, ": the input is undefined");
  TORCH_CHECK(at::isFloatingType(x_in.scalar_type()), "mpipe::snn::", name_,
              ": the input must be floating point, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.dim() >= 2, "mpipe::snn::", name_, ": a multi-step input is [T, N, ...], "
              "got shape ", x_in.sizes());
  if (x_in.size(0) == 0) return at::empty_like(x_in);
  const bool widen = detail::widens(float_membrane_, x_in);
  const at::Tensor x = widen ? x_in.to(at::kFloat) : x_in;
  at::Tensor spikes = steps(x);
  count(spikes);
  return widen ? spikes.to(x_in.scalar_type()) : spikes;
}

MPIPE_FUNC at::Tensor& NeuronBase::membrane(const at::Tensor& x, c10::IntArrayRef shape,
                                            const char* what) {
  at::Tensor& v = v_.get();
  if (!v.defined()) {
    v = at::full(shape, v_reset_.value_or(0.0), x.options());
  } else {
    TORCH_CHECK(v.sizes() == shape, "mpipe::snn::", name_, ": ", what, " of shape ", x.sizes(),
                " does not match the membrane potential's shape ", v.sizes(),
                " (micro-batch ", current_micro_batch().index,
                "); reset the neurons between batches with mpipe::reset_states(model)");
    if (v.device() != x.device() || v.scalar_type() != x.scalar_type()) v = v.to(x.options());
  }
  return v;
}

MPIPE_FUNC void NeuronBase::fill_spec(detail::NeuronSpec& spec) const {
  spec.charge = charge_kind_ == ChargeKind::IF               ? detail::kChargeIF
                : charge_kind_ == ChargeKind::LIFDecayInput ? detail::kChargeLIFDecayInput
                                                             : detail::kChargeLIF;
  spec.tau = tau_;
  spec.v_threshold = v_threshold_;
  spec.hard_reset = v_reset_.has_value();
  spec.v_reset = v_reset_.value_or(0.0);
  spec.detach_reset = detach_reset_;
  spec.surrogate = static_cast<int>(surrogate_.kind());  // detail::SurrogateKind's order
  spec.alpha = surrogate_.alpha();
}

MPIPE_FUNC at::Tensor NeuronBase::step(const at::Tensor& x) {
  at::Tensor& v = membrane(x, x.sizes(), "input");
  if (fused_ && detail::fused_neuron_supported(x)) {  // Note [Fused neurons]
    detail::NeuronSpec spec;
    fill_spec(spec);
    auto out = detail::fused_neuron_step(x, v, spec);
    v = std::move(out.second);
    return std::move(out.first);
  }
  return aten_step(v, x);
}

MPIPE_FUNC at::Tensor NeuronBase::steps(const at::Tensor& x) {
  at::Tensor& v = membrane(x, x.sizes().slice(1), "multi-step input");
  if (fused_ && detail::fused_neuron_supported(x)) {  // Note [Multi-step neurons]
    detail::NeuronSpec spec;
    fill_spec(spec);
    auto out = detail::fused_neuron_steps(x, v, spec);
    v = std::move(out.second);
    return std::move(out.first);
  }
  std::vector<at::Tensor> spikes;
  spikes.reserve(static_cast<size_t>(x.size(0)));
  for (int64_t t = 0; t < x.size(0); ++t) spikes.push_back(aten_step(v, x[t]));
  return at::stack(spikes);
}

MPIPE_FUNC at::Tensor NeuronBase::aten_step(at::Tensor& v, const at::Tensor& x) const {
  v = charge(v, x);
  const at::Tensor spike = surrogate_(v - v_threshold_);
  const at::Tensor s = detach_reset_ ? spike.detach() : spike;
  if (v_reset_) {
    v = v * (1 - s) + s * *v_reset_;
  } else {
    v = v - s * v_threshold_;
  }
  return spike;
}

MPIPE_FUNC void NeuronBase::print_common(std::ostream& stream) const {
  stream << "v_threshold=" << v_threshold_ << ", v_reset=";
  if (v_reset_) {
    stream << *v_reset_;
  } else {
    stream << "None (soft)";
  }
  stream << ", detach_reset=" << (detach_reset_ ? "true" : "false")
         << ", surrogate=" << surrogate_.name();
  if (step_mode_ == StepMode::Multi) stream << ", step_mode=multi";
}

MPIPE_FUNC IFNodeImpl::IFNodeImpl(IFNodeOptions options_)
    : NeuronBase("IFNode", options_.v_threshold(), options_.v_reset(), options_.detach_reset(),
                 options_.surrogate(), options_.fused(), options_.float_membrane(),
                 options_.step_mode(), ChargeKind::IF, 1.0),
      options(options_) {}

MPIPE_FUNC at::Tensor IFNodeImpl::charge(const at::Tensor& v, const at::Tensor& x) const {
  return v + x;
}

MPIPE_FUNC void IFNodeImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::snn::IFNode(";
  print_common(stream);
  stream << ")";
}

MPIPE_FUNC LIFNodeImpl::LIFNodeImpl(LIFNodeOptions options_)
    : NeuronBase(
          "LIFNode", options_.v_threshold(), options_.v_reset(), options_.detach_reset(),
          options_.surrogate(), options_.fused(), options_.float_membrane(), options_.step_mode(),
          options_.decay_input() ? ChargeKind::LIFDecayInput : ChargeKind::LIF, options_.tau()),
      options(options_) {
  TORCH_CHECK(options.tau() > 1 && std::isfinite(options.tau()),
              "mpipe::snn::LIFNode: tau must be a finite number > 1, got ", options.tau());
}

MPIPE_FUNC at::Tensor LIFNodeImpl::charge(const at::Tensor& v, const at::Tensor& x) const {
  const double v_reset = v_reset_.value_or(0.0);
  const double tau = options.tau();
  if (options.decay_input()) return v + (x - (v - v_reset)) / tau;
  return v - (v - v_reset) / tau + x;
}

MPIPE_FUNC void LIFNodeImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::snn::LIFNode(tau=" << options.tau()
         << ", decay_input=" << (options.decay_input() ? "true" : "false") << ", ";
  print_common(stream);
  stream << ")";
}

MPIPE_FUNC ParametricLIFNodeImpl::ParametricLIFNodeImpl(ParametricLIFNodeOptions options_)
    : NeuronBase("ParametricLIFNode", options_.v_threshold(), options_.v_reset(),
                 options_.detach_reset(), options_.surrogate(), /*fused=*/false,
                 options_.float_membrane(), options_.step_mode(),
                 options_.decay_input() ? ChargeKind::LIFDecayInput : ChargeKind::LIF,
                 options_.init_tau()),
      options(options_) {
  TORCH_CHECK(options.init_tau() > 1 && std::isfinite(options.init_tau()),
              "mpipe::snn::ParametricLIFNode: init_tau must be a finite number > 1, got ",
              options.init_tau());
  // sigmoid(w) = 1 / init_tau.
  w = register_parameter("w", at::full({}, -std::log(options.init_tau() - 1), at::kFloat));
}

MPIPE_FUNC double ParametricLIFNodeImpl::tau() const {
  return 1 / at::sigmoid(w.detach()).item<double>();
}

MPIPE_FUNC at::Tensor ParametricLIFNodeImpl::charge(const at::Tensor& v, const at::Tensor& x) const {
  const double v_reset = v_reset_.value_or(0.0);
  const at::Tensor k = at::sigmoid(w).to(v.scalar_type());
  if (options.decay_input()) return v + (x - (v - v_reset)) * k;
  return v - (v - v_reset) * k + x;
}

MPIPE_FUNC void ParametricLIFNodeImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::snn::ParametricLIFNode(tau=" << tau()
         << ", decay_input=" << (options.decay_input() ? "true" : "false") << ", ";
  print_common(stream);
  stream << ")";
}

}  // namespace snn
}  // namespace mpipe

namespace mpipe {
namespace snn {

MPIPE_FUNC int64_t set_step_mode(torch::nn::Module& module, StepMode mode) {
  int64_t n = 0;
  auto set = [&](torch::nn::Module& m) {
    if (auto* neuron = dynamic_cast<NeuronBase*>(&m)) {
      neuron->set_step_mode(mode);
      ++n;
    } else if (auto* dropout = dynamic_cast<DropoutImpl*>(&m)) {
      dropout->set_step_mode(mode);
      ++n;
    }
  };
  set(module);
  for (const auto& child : module.modules(/*include_self=*/false)) set(*child);
  return n;
}

}  // namespace snn
}  // namespace mpipe
