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
    return {grad_out[0] * snn::Surrogate::of(kind, alpha).derivative(x), at::Tensor(),
            at::Tensor()};
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
  switch (kind_) {
    case Kind::Sigmoid:
      return at::sigmoid(x * alpha_);
    case Kind::ATan:
      return at::atan(x * (detail::kPi / 2 * alpha_)) / detail::kPi + 0.5;
    case Kind::PiecewiseQuadratic: {
      // 0 below -1/alpha, 1 above 1/alpha, a quadratic between (SpikingJelly's primitive).
      const at::Tensor inside = x.abs() <= 1 / alpha_;
      const at::Tensor mid = x * x * x.sign() * (-alpha_ * alpha_ / 2) + x * alpha_ + 0.5;
      return at::where(inside, mid, (x > 1 / alpha_).to(x.scalar_type()));
    }
    case Kind::SoftSign:
      return (x * alpha_ / (x.abs() * alpha_ + 1) + 1) / 2;
    case Kind::Erf:
      return (at::erf(x * alpha_) + 1) / 2;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown surrogate");
}

MPIPE_FUNC at::Tensor Surrogate::derivative(const at::Tensor& x) const {
  switch (kind_) {
    case Kind::Sigmoid: {
      const at::Tensor s = at::sigmoid(x * alpha_);
      return s * (1 - s) * alpha_;
    }
    case Kind::ATan: {
      const at::Tensor u = x * (detail::kPi / 2 * alpha_);
      return (alpha_ / 2) / (u * u + 1);
    }
    case Kind::PiecewiseQuadratic: {
      const at::Tensor a = x.abs();
      return (a * (-alpha_ * alpha_) + alpha_).masked_fill(a > 1 / alpha_, 0);
    }
    case Kind::SoftSign: {
      const at::Tensor d = x.abs() * alpha_ + 1;
      return alpha_ / (d * d * 2);
    }
    case Kind::Erf: {
      const at::Tensor u = x * alpha_;
      return (-(u * u)).exp() * (alpha_ / std::sqrt(detail::kPi));
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown surrogate");
}

MPIPE_FUNC std::string Surrogate::name() const {
  static const char* const names[] = {"Sigmoid", "ATan", "PiecewiseQuadratic", "SoftSign", "Erf"};
  std::ostringstream out;
  out << names[static_cast<int>(kind_)] << "(alpha=" << alpha_ << ")";
  return out.str();
}

}  // namespace snn
}  // namespace mpipe
