#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_BATCHNORM_H_
#define MPIPE_BATCHNORM_H_

// Note [Deferred BatchNorm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Splitting a batch into micro-batches changes what BatchNorm sees: each
// micro-batch is normalised with its own statistics (that much is inherent),
// but the running statistics are also updated once per micro-batch, so they
// drift from what the unsplit model would track. DeferredBatchNorm normalises
// each micro-batch with its own statistics like BatchNorm, but accumulates the
// per-channel statistics over the micro-batches of a call and updates
// running_mean and running_var once, when it has seen all of them (their
// count is current_micro_batch()'s), with the whole batch's mean and unbiased
// variance: the running statistics equal the unsplit model's. The
// per-micro-batch means and sums of squared deviations are combined in double
// precision (Chan et al.'s pairwise update), so the variance stays exact when
// the data's mean is large against its spread (E[x^2] - mean^2 in float would
// not), and in micro-batch order whatever order the forwards ran in (given
// programs may run them out of order), so the result has the same bits.
//
// The partial statistics are state (mpipe::Stateful, Note [State snapshots]):
// a checkpointed recompute starts from, and leaves, the state of the original
// forward, so nothing is counted twice; a failed pipeline call loads the
// state of its start back, running statistics included, so it commits
// nothing; reset_state() drops partial statistics (never the running ones).
// In eval mode it normalises with the running statistics. Input: [N, C, ...]
// with C = num_features (like BatchNorm1d/2d/3d).

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <mpipe/state.h>

#include <ostream>
#include <vector>

namespace mpipe {

/// Options of DeferredBatchNorm, as torch::nn::BatchNormOptions.
struct DeferredBatchNormOptions {
  /// `num_features` channels, the other options at their defaults.
  /* implicit */ DeferredBatchNormOptions(int64_t num_features) : num_features_(num_features) {}
  /// C, the channels of input [N, C, ...].
  TORCH_ARG(int64_t, num_features);
  /// Added to the variance before its square root.
  TORCH_ARG(double, eps) = 1e-5;
  /// Weight of a call's statistics in the running statistics' update.
  TORCH_ARG(double, momentum) = 0.1;
  /// Learnable per-channel weight and bias.
  TORCH_ARG(bool, affine) = true;
};

/// BatchNorm whose running statistics are updated once per pipeline call,
/// with the whole batch's statistics (Note [Deferred BatchNorm]).
class DeferredBatchNormImpl : public torch::nn::Cloneable<DeferredBatchNormImpl>,
                              public Stateful {
 public:
  /// Checks num_features > 0 and creates the parameters and buffers.
  explicit DeferredBatchNormImpl(DeferredBatchNormOptions options);
  /// (Re)creates weight = 1, bias = 0, running_mean = 0, running_var = 1 and
  /// num_batches_tracked = 0, and drops partial statistics.
  void reset() override;
  /// Normalises `x` [N, C, ...]: with its own statistics in training mode
  /// (the running ones updated once it saw every micro-batch of the call),
  /// with the running statistics in eval mode.
  at::Tensor forward(const at::Tensor& x);
  /// Prints `mpipe::DeferredBatchNorm(C, eps=..., momentum=..., affine=...)`.
  void pretty_print(std::ostream& stream) const override;

  /// Drops the partial statistics of a call in progress (never the running ones).
  void reset_state() override;
  bool holds_state() const override { return !parts_.empty(); }
  bool supports_state_snapshots() const override { return true; }
  std::any save_state() const override;
  void load_state(const std::any& state) override;

  /// The options it was built with.
  DeferredBatchNormOptions options;
  /// Per-channel scale [C], a parameter when options.affine() (else undefined).
  at::Tensor weight;
  /// Per-channel shift [C], a parameter when options.affine() (else undefined).
  at::Tensor bias;
  /// Running mean [C] (buffer), updated once per call in training mode.
  at::Tensor running_mean;
  /// Running unbiased variance [C] (buffer), updated once per call in training mode.
  at::Tensor running_var;
  /// How many times the running statistics were updated (buffer, a scalar).
  at::Tensor num_batches_tracked;

 private:
  void commit();
  /// One forward's statistics, combined at commit() in micro-batch order.
  struct Part {
    int64_t micro_batch = 0;
    int64_t rows = 0;
    at::Tensor mean, m2;  // double: mean and sum of squared deviations
  };
  std::vector<Part> parts_;  // in the order the forwards ran
};
/// A holder for DeferredBatchNormImpl, as torch::nn's modules have.
TORCH_MODULE(DeferredBatchNorm);

}  // namespace mpipe

#endif  // MPIPE_BATCHNORM_H_
