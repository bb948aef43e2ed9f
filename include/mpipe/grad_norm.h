#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_GRAD_NORM_H_
#define MPIPE_GRAD_NORM_H_

// Clipping gradients by their global norm, as torch::nn::utils::clip_grad_norm_
// does, over every stage of a pipeline, in one process or across processes:
//
//   pipe->train_step(x, y, loss_fn, options);
//   const double norm = mpipe::clip_grad_norm(*pipe, 1.0);  // every rank calls it
//   optimizer.step();
//
// Across processes each rank holds only its own stages' gradients, so a clip
// that looked at them alone would scale each rank by a different factor; here
// the ranks add their parts of the norm first, and every rank scales by the
// same factor.

#include <mpipe/distributed.h>

#include <ATen/core/Tensor.h>

#include <limits>
#include <vector>

namespace mpipe {

class ModelPipelineImpl;

/// The global `norm_type`-norm (2 by default; infinity for the largest
/// element) of the gradients of `parameters`, summed over every rank of
/// `group` when it is defined (every rank calls it; data-parallel replicas,
/// whose gradients are equal after a step, count once). When it exceeds
/// `max_norm`, every gradient is multiplied by max_norm / (norm + 1e-6), as
/// torch::nn::utils::clip_grad_norm_ does. Parameters without a gradient are
/// skipped. Returns the norm before clipping (NaN or infinity if a gradient
/// holds one; nothing is scaled then).
double clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm,
                      const distributed::ProcessGroup& group = {}, double norm_type = 2.0);

/// clip_grad_norm over the parameters of every stage of `pipe`, across the
/// ranks of its process group when it has one.
double clip_grad_norm(ModelPipelineImpl& pipe, double max_norm, double norm_type = 2.0);

}  // namespace mpipe

#endif  // MPIPE_GRAD_NORM_H_
