#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SNN_ENCODING_H_
#define MPIPE_SNN_ENCODING_H_

// Encoding inputs as spikes and decoding spikes as rates (functions only:
// this header does not pull torch::nn).

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mpipe {
namespace snn {

/// Poisson (Bernoulli-per-step) encoding: 1 where uniform noise < x, else 0,
/// in x's dtype. x holds firing probabilities in [0, 1]: on every device a
/// value outside (or NaN) is refused with the same c10::Error ("x must lie in
/// [0, 1], got values in [min, max]"). The check is one reduction
/// (at::aminmax) whose two values are read back together: on a GPU that costs
/// a host sync per call. A CUDA graph being captured cannot read anything
/// back, so its capture leaves the check out and its replays do not check
/// (there a value below 0 never fires and one above 1 always fires); the
/// eager calls around it, such as the warm-up before a capture, do.
///
/// `checked` false: SpikingJelly's PoissonEncoder, 1 where uniform noise <= x,
/// for any x (below 0 never fires, 1 and above always fire), with no check and
/// so no host sync on a GPU. It differs from the checked rule only where x is
/// out of [0, 1] or the noise equals x exactly.
at::Tensor poisson_encode(const at::Tensor& x, bool checked = true);

// The module form, PoissonEncoder, is in mpipe/snn/poisson_encoder.h.

/// Firing rate from spikes summed over T steps (constant_forward with
/// reduce = true): summed / T.
at::Tensor rate_from_sum(const at::Tensor& summed_spikes, int64_t T);

/// Firing rate from a [T, N, ...] spike sequence (sequence_forward): the mean
/// over dim 0.
at::Tensor rate_from_sequence(const at::Tensor& spikes);

/// The predicted class of each row: argmax of the rate over the last dim.
at::Tensor predict(const at::Tensor& rate);

/// Mean squared error between rates [N, C] and one-hot targets of `labels` [N].
at::Tensor rate_mse_loss(const at::Tensor& rate, const at::Tensor& labels);

}  // namespace snn
}  // namespace mpipe

#endif  // MPIPE_SNN_ENCODING_H_
