#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_SKIP_H_
#define MPIPE_SKIP_H_

// Skip connections across stages, as torchgpipe's stash/pop: a stage stashes a
// named tensor and a later stage pops it. The pipeline moves it from the
// stasher's device straight to the popper's, not through the stages between,
// and its gradient flows back the same way.
//
//   struct DownImpl : torch::nn::Module {          // stage 1
//     torch::Tensor forward(const torch::Tensor& x) {
//       mpipe::stash("skip1", x);                  // kept for stage 3
//       return pool(x);
//     }
//   };
//   struct UpImpl : torch::nn::Module {            // stage 3
//     torch::Tensor forward(const torch::Tensor& x) {
//       return up(x) + mpipe::pop("skip1");        // stage 1's x, on this device
//     }
//   };
//
// Within a pipeline call each micro-batch (or time step) has its own names:
// every name a stage stashes must be popped exactly once by the same or a
// later stage, for the same item. A pop without a stash, a second stash of
// a name, or a stash nobody pops fails the call with an error that names the
// stages. Outside a pipeline call (running the stages one after another as a
// plain model) stash and pop use a store of the calling thread, so the same
// modules run unpipelined; reset it with clear_stashed() after an error there.

#include <ATen/core/Tensor.h>

#include <string>

namespace mpipe {

/// Keeps `tensor` under `name` for pop() in the same or a later stage, for the
/// current micro-batch or time step.
void stash(const std::string& name, at::Tensor tensor);

/// Takes the tensor an earlier stage (or this one) stashed under `name` for
/// the same micro-batch or time step, on this stage's device.
at::Tensor pop(const std::string& name);

/// Drops what this thread stashed outside pipeline calls and never popped.
void clear_stashed();

}  // namespace mpipe

#endif  // MPIPE_SKIP_H_
