#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_SURROGATE_H_
#define MPIPE_SNN_SURROGATE_H_

// Surrogate gradients: the forward pass fires a spike (Heaviside step of
// x = v - v_threshold), the backward pass uses the derivative of a smooth
// function instead of the step's zero-almost-everywhere derivative.
//   Sigmoid(alpha = 4): g(x) = sigmoid(alpha x),   g'(x) = alpha s (1 - s)
//   ATan(alpha = 2):    g(x) = atan(pi/2 alpha x) / pi + 1/2,
//                       g'(x) = alpha / (2 (1 + (pi/2 alpha x)^2))
//   PiecewiseQuadratic(alpha = 1):
//                       g'(x) = alpha - alpha^2 |x| where |x| <= 1/alpha, else 0
//   SoftSign(alpha = 2): g(x) = (alpha x / (1 + |alpha x|) + 1) / 2,
//                       g'(x) = alpha / (2 (1 + |alpha x|)^2)
//   Erf(alpha = 2):     g(x) = (1 + erf(alpha x)) / 2,
//                       g'(x) = alpha / sqrt(pi) exp(-(alpha x)^2)
// (SpikingJelly's conventions and default alphas.)

#include <ATen/core/Tensor.h>

#include <string>

namespace mpipe {
namespace snn {

/// A surrogate gradient: the spike's step function forward, a smooth
/// function's derivative backward (the functions in the header's comment).
class Surrogate {
 public:
  /// Which smooth function.
  enum class Kind {
    /// g(x) = sigmoid(alpha x).
    Sigmoid,
    /// g(x) = atan(pi/2 alpha x) / pi + 1/2.
    ATan,
    /// g'(x) = alpha - alpha^2 |x| on |x| <= 1/alpha, 0 outside.
    PiecewiseQuadratic,
    /// g(x) = (alpha x / (1 + |alpha x|) + 1) / 2.
    SoftSign,
    /// g(x) = (1 + erf(alpha x)) / 2.
    Erf,
  };

  /// The default: Sigmoid with alpha 4.
  Surrogate() = default;
  /// Sigmoid with `alpha` (positive and finite, else c10::Error).
  static Surrogate sigmoid(double alpha = 4.0) { return Surrogate(Kind::Sigmoid, alpha); }
  /// ATan with `alpha` (positive and finite, else c10::Error).
  static Surrogate atan(double alpha = 2.0) { return Surrogate(Kind::ATan, alpha); }
  /// PiecewiseQuadratic with `alpha` (positive and finite, else c10::Error).
  static Surrogate piecewise_quadratic(double alpha = 1.0) {
    return Surrogate(Kind::PiecewiseQuadratic, alpha);
  }
  /// SoftSign with `alpha` (positive and finite, else c10::Error).
  static Surrogate soft_sign(double alpha = 2.0) { return Surrogate(Kind::SoftSign, alpha); }
  /// Erf with `alpha` (positive and finite, else c10::Error).
  static Surrogate erf(double alpha = 2.0) { return Surrogate(Kind::Erf, alpha); }
  /// Any kind with `alpha` (positive and finite, else c10::Error).
  static Surrogate of(Kind kind, double alpha) { return Surrogate(kind, alpha); }

  /// Spike: 1 where x >= 0, else 0 (x's dtype); gradient g'(x).
  at::Tensor operator()(const at::Tensor& x) const;
  /// The smooth function g whose derivative is the surrogate gradient.
  at::Tensor smooth(const at::Tensor& x) const;
  /// g'(x), as used in backward.
  at::Tensor derivative(const at::Tensor& x) const;

  /// Which smooth function.
  Kind kind() const noexcept { return kind_; }
  /// The steepness alpha.
  double alpha() const noexcept { return alpha_; }
  /// The kind and alpha, as "Sigmoid(alpha=4)" or "Erf(alpha=2)".
  std::string name() const;

 private:
  Surrogate(Kind kind, double alpha);
  Kind kind_ = Kind::Sigmoid;
  double alpha_ = 4.0;
};

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_SURROGATE_H_
