#include "mpipe/snn/neuron.h"

#include "fused_neuron.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace mpipe {
namespace snn {

NeuronBase::NeuronBase(const char* name, double v_threshold, std::optional<double> v_reset,
                       bool detach_reset, Surrogate surrogate, bool fused,
                       bool float_membrane, ChargeKind charge_kind, double tau)
    : name_(name),
      v_threshold_(v_threshold),
      v_reset_(v_reset),
      detach_reset_(detach_reset),
      surrogate_(surrogate),
      fused_(fused),
      float_membrane_(float_membrane),
      charge_kind_(charge_kind),
      tau_(tau) {
  TORCH_CHECK(std::isfinite(v_threshold), "mpipe::snn::", name,
              ": v_threshold must be finite, got ", v_threshold);
  TORCH_CHECK(!v_reset || std::isfinite(*v_reset), "mpipe::snn::", name,
              ": v_reset must be finite (or nullopt for soft reset), got ", *v_reset);
}

at::Tensor NeuronBase::forward(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.defined(), "mpipe::snn::", name_, ": the input is undefined");
  TORCH_CHECK(at::isFloatingType(x_in.scalar_type()), "mpipe::snn::", name_,
              ": the input must be floating point, got ", x_in.scalar_type());
  const bool widen = float_membrane_ && (x_in.scalar_type() == at::kHalf ||
                                         x_in.scalar_type() == at::kBFloat16);
  const at::Tensor x = widen ? x_in.to(at::kFloat) : x_in;
  at::Tensor spike = step(x);
  return widen ? spike.to(x_in.scalar_type()) : spike;
}

at::Tensor NeuronBase::step(const at::Tensor& x) {
  at::Tensor& v = v_.get();
  if (!v.defined()) {
    v = at::full_like(x, v_reset_.value_or(0.0));
  } else {
    TORCH_CHECK(v.sizes() == x.sizes(), "mpipe::snn::", name_, ": input of shape ", x.sizes(),
                " does not match the membrane potential's shape ", v.sizes(),
                " (micro-batch ", current_micro_batch().index,
                "); reset the neurons between batches with mpipe::reset_states(model)");
    if (v.device() != x.device() || v.scalar_type() != x.scalar_type()) v = v.to(x.options());
  }
  if (fused_ && detail::fused_neuron_supported(x)) {  // Note [Fused neurons]
    detail::NeuronSpec spec;
    spec.charge = charge_kind_ == ChargeKind::IF               ? detail::kChargeIF
                  : charge_kind_ == ChargeKind::LIFDecayInput ? detail::kChargeLIFDecayInput
                                                               : detail::kChargeLIF;
    spec.tau = tau_;
    spec.v_threshold = v_threshold_;
    spec.hard_reset = v_reset_.has_value();
    spec.v_reset = v_reset_.value_or(0.0);
    spec.detach_reset = detach_reset_;
    spec.surrogate = surrogate_.kind() == Surrogate::Kind::Sigmoid ? detail::kSurrogateSigmoid
                                                                   : detail::kSurrogateATan;
    spec.alpha = surrogate_.alpha();
    auto out = detail::fused_neuron_step(x, v, spec);
    v = std::move(out.second);
    return std::move(out.first);
  }
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

void NeuronBase::print_common(std::ostream& stream) const {
  stream << "v_threshold=" << v_threshold_ << ", v_reset=";
  if (v_reset_) {
    stream << *v_reset_;
  } else {
    stream << "None (soft)";
  }
  stream << ", detach_reset=" << (detach_reset_ ? "true" : "false")
         << ", surrogate=" << surrogate_.name();
}

IFNodeImpl::IFNodeImpl(IFNodeOptions options_)
    : NeuronBase("IFNode", options_.v_threshold(), options_.v_reset(), options_.detach_reset(),
                 options_.surrogate(), options_.fused(), options_.float_membrane(),
                 ChargeKind::IF, 1.0),
      options(options_) {}

at::Tensor IFNodeImpl::charge(const at::Tensor& v, const at::Tensor& x) const { return v + x; }

void IFNodeImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::snn::IFNode(";
  print_common(stream);
  stream << ")";
}

LIFNodeImpl::LIFNodeImpl(LIFNodeOptions options_)
    : NeuronBase("LIFNode", options_.v_threshold(), options_.v_reset(), options_.detach_reset(),
                 options_.surrogate(), options_.fused(), options_.float_membrane(),
                 options_.decay_input() ? ChargeKind::LIFDecayInput : ChargeKind::LIF,
                 options_.tau()),
      options(options_) {
  TORCH_CHECK(options.tau() > 1 && std::isfinite(options.tau()),
              "mpipe::snn::LIFNode: tau must be a finite number > 1, got ", options.tau());
}

at::Tensor LIFNodeImpl::charge(const at::Tensor& v, const at::Tensor& x) const {
  const double v_reset = v_reset_.value_or(0.0);
  const double tau = options.tau();
  if (options.decay_input()) return v + (x - (v - v_reset)) / tau;
  return v - (v - v_reset) / tau + x;
}

void LIFNodeImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::snn::LIFNode(tau=" << options.tau()
         << ", decay_input=" << (options.decay_input() ? "true" : "false") << ", ";
  print_common(stream);
  stream << ")";
}

}  // namespace snn
}  // namespace mpipe
