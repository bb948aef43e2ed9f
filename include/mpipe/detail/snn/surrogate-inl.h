#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/snn/surrogate.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <sstream>

namespace mpipe {
namespace detail {

constexpr double kPi = 3.14159265358979323846;

/// Heaviside forward, surrogate backward. The surrogate travels as (kind, alpha)
/// in saved_data so one Function serves every kind.
struct SpikeFunction : torch::autograd::Function<SpikeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t kind, double alpha) {
    ctx->save_for_backward({x});
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["alpha"] = alpha;
    return x.ge(0).to(x.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const auto kind = static_cast<snn::Surrogate::Kind>(ctx->saved_data["kind"].toInt());
    const double alpha = ctx->saved_data["alpha"].toDouble();
    const snn::Surrogate s = kind == snn::Surrogate::Kind::Sigmoid ? snn::Surrogate::sigmoid(alpha)
                                                                   : snn::Surrogate::atan(alpha);
    return {grad_out[0] * s.derivative(x), at::Tensor(), at::Tensor()};
  }
};

}  // namespace detail

namespace snn {

MPIPE_FUNC Surrogate::Surrogate(Kind kind, double alpha) : kind_(kind), alpha_(alpha) {
  TORCH_CHECK(alpha > 0 && std::isfinite(alpha),
              "mpipe::snn::Surrogate: alpha must be positive and finite, got ", alpha);
}

MPIPE_FUNC at::Tensor Surrogate::operator()(const at::Tensor& x) const {
  return detail::SpikeFunction::apply(x, static_cast<int64_t>(kind_), alpha_);
}

MPIPE_FUNC at::Tensor Surrogate::smooth(const at::Tensor& x) const {
  if (kind_ == Kind::Sigmoid) return at::sigmoid(x * alpha_);
  return at::atan(x * (detail::kPi / 2 * alpha_)) / detail::kPi + 0.5;
}

MPIPE_FUNC at::Tensor Surrogate::derivative(const at::Tensor& x) const {
  if (kind_ == Kind::Sigmoid) {
    const at::Tensor s = at::sigmoid(x * alpha_);
    return s * (1 - s) * alpha_;
  }
  const at::Tensor u = x * (detail::kPi / 2 * alpha_);
  return (alpha_ / 2) / (u * u + 1);
}

MPIPE_FUNC std::string Surrogate::name() const {
  std::ostringstream out;
  out << (kind_ == Kind::Sigmoid ? "Sigmoid" : "ATan") << "(alpha=" << alpha_ << ")";
  return out.str();
}

}  // namespace snn
}  // namespace mpipe
