#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_TENSORS_H_
#define MPIPE_TENSORS_H_

// Stages with several tensors: what a stage takes and returns, and how a
// call's inputs are split into micro-batches.

#include <ATen/core/Tensor.h>

#include <functional>
#include <utility>
#include <vector>

namespace mpipe {

/// A stage's inputs or outputs when it has several: e.g. hidden states and an
/// attention mask, or features and a skip. Stage j's outputs are stage j+1's
/// inputs, in order.
using Tensors = std::vector<at::Tensor>;

/// One input of a pipeline call. A tensor converts to a batched Input: it is
/// split along dim 0 into micro-batches (forward, train_step), like every
/// batched input of the call. mpipe::unbatched(t) marks a tensor that every
/// micro-batch gets whole (a mask shared by all rows, a lookup table); its
/// gradient, if it needs one, is the sum over the micro-batches.
struct Input {
  /// `t` as a batched input.
  /* implicit */ Input(at::Tensor t) : tensor(std::move(t)) {}
  /// The tensor.
  at::Tensor tensor;
  /// Split along dim 0 into micro-batches (true), or given whole to every
  /// micro-batch (false, mpipe::unbatched).
  bool batched = true;
};

/// `t` as an input that every micro-batch gets whole (see Input).
inline Input unbatched(at::Tensor t) {
  Input in(std::move(t));
  in.batched = false;
  return in;
}

namespace detail {
/// How the runtime calls a stage: its inputs in, its outputs out.
using StageForward = std::function<Tensors(const Tensors&)>;
}  // namespace detail

}  // namespace mpipe

#endif  // MPIPE_TENSORS_H_
