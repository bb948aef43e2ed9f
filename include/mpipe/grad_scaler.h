#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_GRAD_SCALER_H_
#define MPIPE_GRAD_SCALER_H_

// Loss scaling for fp16 training, as PyTorch's torch.amp.GradScaler (which
// LibTorch lacks):
//
//   mpipe::GradScaler scaler;                      // scale 2^16, grows x2 every 2000 good steps
//   optimizer.zero_grad();
//   pipe->train_step(x, y, loss_fn, mpipe::TrainStepOptions(64).loss_scale(scaler.get_scale()));
//   scaler.step(optimizer);                        // unscales; skips the step on inf/NaN
//   scaler.update();                               // halves the scale after a skip
//
// or, without a pipeline, scaler.scale(loss).backward() in place of
// loss.backward(). Call unscale_(optimizer) before step() to clip the true
// gradients. For a pipeline across processes, give the options the process
// group: every rank then skips the same steps and keeps the same scale (each
// rank's optimizer holds only its own stages' parameters).
//
// The scale is kept on the host: step() reads whether a gradient overflowed
// (one synchronisation per optimizer and device, as PyTorch's step() does).

#include <mpipe/distributed.h>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mpipe {

/// Options of GradScaler, with torch.amp.GradScaler's defaults.
struct GradScalerOptions {
  /// The scale to start from (positive and finite).
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this (> 1) after growth_interval steps in a
  /// row without inf/NaN gradients.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by this (in (0, 1)) after a step whose gradients
  /// held inf or NaN.
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// How many good steps in a row grow the scale.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// Disabled: scale() returns the loss, step() steps, update() does nothing.
  TORCH_ARG(bool, enabled) = true;
  /// A pipeline across processes: inf/NaN on any rank skips the step on all.
  TORCH_ARG(distributed::ProcessGroup, process_group) = {};
};

/// Loss scaling for fp16 training, as torch.amp.GradScaler: scales the loss,
/// unscales the gradients, skips steps with inf/NaN gradients and adapts the scale.
class GradScaler {
 public:
  /// Starts at options.init_scale(); throws c10::Error on invalid options.
  explicit GradScaler(GradScalerOptions options = {}) : options_(std::move(options)) {
    TORCH_CHECK(options_.init_scale() > 0 && std::isfinite(options_.init_scale()),
                "mpipe::GradScaler: init_scale must be positive and finite, got ",
                options_.init_scale());
    TORCH_CHECK(options_.growth_factor() > 1, "mpipe::GradScaler: growth_factor must be > 1, got ",
                options_.growth_factor());
    TORCH_CHECK(options_.backoff_factor() > 0 && options_.backoff_factor() < 1,
                "mpipe::GradScaler: backoff_factor must be in (0, 1), got ",
                options_.backoff_factor());
    TORCH_CHECK(options_.growth_interval() > 0,
                "mpipe::GradScaler: growth_interval must be positive, got ",
                options_.growth_interval());
    scale_ = options_.init_scale();
  }

  /// GradScalerOptions::enabled.
  bool is_enabled() const { return options_.enabled(); }
  /// The current scale (1 when disabled).
  double get_scale() const { return is_enabled() ? scale_ : 1.0; }
  /// Good steps in a row since the scale last changed.
  int64_t growth_tracker() const { return growth_tracker_; }

  /// `loss` times the scale (`loss` itself when disabled).
  at::Tensor scale(const at::Tensor& loss) const {
    TORCH_CHECK(loss.defined(), "mpipe::GradScaler::scale: the loss is undefined");
    return is_enabled() ? loss * scale_ : loss;
  }

  /// Divides the gradients of `optimizer`'s parameters by the scale and
  /// records whether any is inf or NaN. At most once per optimizer between
  /// update() calls; step() calls it when you have not.
  void unscale_(torch::optim::Optimizer& optimizer) {
    if (!is_enabled()) return;
    PerOptimizer& st = state_[&optimizer];
    TORCH_CHECK(!st.unscaled,
                "mpipe::GradScaler::unscale_: already called for this optimizer since the last "
                "update()");
    TORCH_CHECK(!st.stepped, "mpipe::GradScaler::unscale_: step() was already called for this "
                             "optimizer since the last update()");
    const double inv = 1.0 / scale_;
    std::map<std::string, at::Tensor> found;  // by device: any non-finite value
    int64_t index = 0;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        at::Tensor g = p.mutable_grad();
        ++index;
        if (!g.defined()) continue;
        TORCH_CHECK(!g.is_sparse(), "mpipe::GradScaler::unscale_: parameter ", index - 1,
                    " has a sparse gradient, which is not supported");
        TORCH_CHECK(g.is_floating_point(), "mpipe::GradScaler::unscale_: parameter ", index - 1,
                    " has a gradient of ", g.scalar_type(), ", not floating point");
        at::NoGradGuard no_grad;
        g.mul_(inv);
        at::Tensor bad = at::logical_not(at::isfinite(g)).any();
        at::Tensor& f = found[g.device().str()];
        f = f.defined() ? at::logical_or(f, bad) : bad;
      }
    }
    bool any = false;
    for (auto& f : found) any = any || f.second.item<bool>();
    if (options_.process_group().defined()) any = options_.process_group().any(any);
    st.unscaled = true;
    st.found_inf = any;
  }

  /// unscale_ (unless called already), then optimizer.step() unless a
  /// gradient held inf or NaN. Returns whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer) {
    if (!is_enabled()) {
      optimizer.step();
      return true;
    }
    PerOptimizer& st = state_[&optimizer];
    TORCH_CHECK(!st.stepped, "mpipe::GradScaler::step: already called for this optimizer since "
                             "the last update()");
    if (!st.unscaled) unscale_(optimizer);  // std::map: `st` stays valid
    st.stepped = true;
    if (st.found_inf) return false;
    optimizer.step();
    return true;
  }

  /// Whether the last unscale_ of `optimizer` since update() found inf or NaN.
  bool found_inf(const torch::optim::Optimizer& optimizer) const {
    auto it = state_.find(&optimizer);
    return it != state_.end() && it->second.found_inf;
  }

  /// Adjusts the scale after a step: backoff_factor if any optimizer's
  /// gradients held inf or NaN, growth_factor after growth_interval good steps.
  void update() {
    if (!is_enabled()) return;
    TORCH_CHECK(!state_.empty() && any_unscaled(),
                "mpipe::GradScaler::update: no unscale_() or step() since the last update()");
    bool inf = false;
    for (const auto& s : state_) inf = inf || s.second.found_inf;
    if (inf) {
      scale_ *= options_.backoff_factor();
      growth_tracker_ = 0;
    } else if (++growth_tracker_ == options_.growth_interval()) {
      scale_ *= options_.growth_factor();
      growth_tracker_ = 0;
    }
    state_.clear();
  }
  /// Sets the scale (and clears what this step recorded).
  void update(double new_scale) {
    TORCH_CHECK(new_scale > 0 && std::isfinite(new_scale),
                "mpipe::GradScaler::update: the new scale must be positive and finite, got ",
                new_scale);
    scale_ = new_scale;
    growth_tracker_ = 0;
    state_.clear();
  }

  /// The scale and the growth tracker (resume training where it stopped).
  void save(torch::serialize::OutputArchive& archive) const {
    archive.write("scale", at::tensor(scale_, at::kDouble));
    archive.write("growth_tracker", at::tensor(growth_tracker_, at::kLong));
  }
  /// Puts back what save() wrote (and clears what this step recorded).
  void load(torch::serialize::InputArchive& archive) {
    at::Tensor s, t;
    archive.read("scale", s);
    archive.read("growth_tracker", t);
    scale_ = s.item<double>();
    growth_tracker_ = t.item<int64_t>();
    state_.clear();
  }

  /// The options it was built with.
  const GradScalerOptions& options() const { return options_; }

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    bool found_inf = false;
  };
  bool any_unscaled() const {
    for (const auto& s : state_) {
      if (s.second.unscaled) return true;
    }
    return false;
  }

  GradScalerOptions options_;
  double scale_ = 1.0;
  int64_t growth_tracker_ = 0;
  std::map<const torch::optim::Optimizer*, PerOptimizer> state_;
};

}  // namespace mpipe

#endif  // MPIPE_GRAD_SCALER_H_
