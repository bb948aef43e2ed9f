#ifndef MPIPE_SNN_DROPOUT_H_
#define MPIPE_SNN_DROPOUT_H_

// snn::Dropout: dropout whose mask holds for every time step until a reset
// (SpikingJelly's layer.Dropout).
//
// Note [Dropout across time steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch::nn::Dropout draws a new mask at every call, so in a single-step
// stage each time step drops other units, and in a SeqToANN each of the T*N
// rows does: a unit dropped at step 1 fires again at step 2 and the
// regularisation averages out over T. snn::Dropout draws one mask per
// micro-batch at its first training-mode call after a reset, keeps it as
// state (mpipe::Stateful: cleared by reset_states, which constant_train_step
// calls before and after itself, and which users call between batches of
// constant_forward and sequence_forward, as for the neurons), and multiplies
// every step by it: the same units are off for the whole sequence, whatever
// the time chunks. Inside a pipeline the
// draw comes from the stage's generator of that item (Note [Random draws]), so
// it is reproducible, threaded or inline, and a checkpointed recompute draws
// the same mask (the snapshot before the first chunk holds none).

#include <mpipe/snn/step_mode.h>
#include <mpipe/state.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <ostream>
#include <vector>

namespace mpipe {
namespace snn {

/// Options of snn::Dropout.
struct DropoutOptions {
  /// The probability that a unit is dropped, in [0, 1].
  /* implicit */ DropoutOptions(double p = 0.5) : p_(p) {}
  /// The probability that a unit is dropped, in [0, 1].
  TORCH_ARG(double, p);
  /// Single: forward takes one step [N, ...]; Multi: a sequence [T, N, ...].
  TORCH_ARG(StepMode, step_mode) = StepMode::Single;
};

/// Dropout with one mask for all time steps, drawn after each reset
/// (Note [Dropout across time steps]). In training mode it zeroes each unit
/// with probability p and scales the others by 1 / (1 - p); in evaluation
/// mode it passes its input through.
class DropoutImpl : public torch::nn::Module, public Stateful {
 public:
  /// A dropout layer with `options`; throws c10::Error unless 0 <= p <= 1.
  explicit DropoutImpl(DropoutOptions options = {}) : options(options) {
    TORCH_CHECK(std::isfinite(options.p()) && options.p() >= 0 && options.p() <= 1,
                "mpipe::snn::Dropout: p must be in [0, 1], got ", options.p());
  }

  /// x [N, ...] (Single) or [T, N, ...] (Multi) times the current micro-batch's mask.
  at::Tensor forward(const at::Tensor& x) {
    const bool multi = options.step_mode() == StepMode::Multi;
    TORCH_CHECK(x.defined(), "mpipe::snn::Dropout: the input is undefined");
    TORCH_CHECK(!multi || x.dim() >= 2, "mpipe::snn::Dropout: in multi-step mode the input is a "
                "[T, N, ...] sequence, got shape ", x.sizes());
    if (!is_training() || options.p() == 0) return x;
    const auto shape = multi ? x.sizes().slice(1) : x.sizes();
    at::Tensor& mask = mask_.get();
    if (!mask.defined()) {
      const double keep = 1 - options.p();
      mask = keep == 0 ? at::zeros(shape, x.options())
                       : at::empty(shape, x.options()).bernoulli_(keep).div_(keep);
    } else {
      TORCH_CHECK(mask.sizes() == shape, "mpipe::snn::Dropout: a step of shape ", shape,
                  " after steps of shape ", mask.sizes(), " since the last reset (micro-batch ",
                  current_micro_batch().index, "); call mpipe::reset_states between batches");
      if (mask.device() != x.device() || mask.scalar_type() != x.scalar_type()) {
        mask = mask.to(x.options());
      }
    }
    return multi ? x * mask.unsqueeze(0) : x * mask;
  }

  /// How forward takes time: one step or a sequence per call.
  StepMode step_mode() const noexcept { return options.step_mode(); }
  /// Changes how forward takes time (the mask is kept).
  void set_step_mode(StepMode mode) noexcept { options.step_mode(mode); }

  void reset_state() override { mask_.clear(); }
  bool holds_state() const override { return !mask_.slots().empty(); }
  /// True: the mask can be saved and put back (Note [State snapshots]).
  bool supports_state_snapshots() const override { return true; }
  std::any save_state() const override { return mask_.save(); }
  void load_state(const std::any& state) override { mask_.load(state); }
  /// The masks, one per micro-batch seen since the last reset (those of
  /// training-mode calls with p > 0), already scaled by 1 / (1 - p).
  const std::vector<at::Tensor>& masks() const { return mask_.slots(); }

  /// Prints `mpipe::snn::Dropout(p=..., step_mode=...)`.
  void pretty_print(std::ostream& stream) const override {
    stream << "mpipe::snn::Dropout(p=" << options.p() << ", step_mode=" << options.step_mode() << ")";
  }

  /// The options it was built with (step_mode follows set_step_mode).
  DropoutOptions options;

 private:
  PerMicroBatch<at::Tensor> mask_;
};
/// A holder for DropoutImpl, as torch::nn's modules have.
TORCH_MODULE(Dropout);

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_DROPOUT_H_
