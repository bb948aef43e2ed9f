#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/precision/cast_grads.h"

#include "mpipe/detail/precision/autocast.h"

#include "mpipe/linear.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace mpipe {
namespace detail {

// Note [Cast gradients per step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under autocast a float32 weight is cast once per call (mpipe::Linear, Note
// [Linear under autocast]) and all micro-batches use that cast. But
// train_step runs one backward per micro-batch and stage, so the cast's
// gradient reaches the weight once per micro-batch: each time converted from
// bf16 to float32 and added to .grad, two passes over a float32 copy of the
// weight (wide-mlp, 8 micro-batches: 64 of them over 256 MiB per step, 60
// ms of which this option saves 14; bench/RESULTS.md). One backward over the whole batch, as
// a plain autocast loop or forward() + backward() run, sums the cast's
// gradients in bf16 first and converts once. train_step does the same: inside
// its stage calls (CastGradsGuard, set by the executor around forward and
// recompute), mpipe::Linear computes with a bf16 leaf copy of the weight, made
// once per step and stage; autograd accumulates the micro-batches' gradients
// into the copy's .grad in bf16, and after the last micro-batch the executor
// adds it to the weight's .grad once (flush, on the stage's stream). Sums in
// the autocast dtype are what autograd's own accumulation of a shared tensor's
// gradients does; the option accumulate_cast_grads(false) turns this off.
// Hooks registered on the weight do not see these gradients (they are added
// by flush, not by autograd). A graphed step captures all of it: the copy,
// the sums and flush's addition are device work on the stages' streams, and a
// replay repeats them (Note [Automatic graphs of training steps]).

MPIPE_INLINE_VAR thread_local CastGrads* t_cast_grads = nullptr;

MPIPE_FUNC CastGradsGuard::CastGradsGuard(CastGrads* grads) : previous_(t_cast_grads) {
  t_cast_grads = grads;
}
MPIPE_FUNC CastGradsGuard::~CastGradsGuard() { t_cast_grads = previous_; }

MPIPE_FUNC at::Tensor CastGrads::weight_for(const at::Tensor& weight) {
  if (!c10::GradMode::is_enabled() || !weight.defined() || !weight.requires_grad() ||
      !weight.is_leaf() || weight.scalar_type() != at::kFloat) {
    return {};
  }
  const AutocastState autocast = AutocastState::current();
  const bool cuda = weight.is_cuda();
  if (!(cuda ? autocast.cuda : weight.is_cpu() && autocast.cpu)) return {};
  const at::ScalarType dtype = cuda ? autocast.cuda_dtype : autocast.cpu_dtype;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& c : copies_) {
    if (c.first.is_same(weight) && c.second.scalar_type() == dtype) return c.second;
  }
  at::Tensor copy;
  {
    c10::NoGradGuard no_grad;
    copy = weight.to(dtype);
  }
  copy.set_requires_grad(true);
  copies_.emplace_back(weight, copy);
  return copy;
}

MPIPE_FUNC void CastGrads::flush() {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    copies.swap(copies_);
  }
  c10::NoGradGuard no_grad;
  for (auto& c : copies) {
    const at::Tensor& g = c.second.grad();
    if (!g.defined()) continue;
    at::Tensor& grad = c.first.mutable_grad();
    if (grad.defined()) {
      grad.add_(g);  // float32 += bf16 in one kernel
    } else {
      grad = g.to(c.first.scalar_type());
    }
  }
}

}  // namespace detail

MPIPE_FUNC at::Tensor LinearImpl::step_weight() const {
  detail::CastGrads* grads = detail::t_cast_grads;  // NOLINT: the thread's, set by the executor
  return grads ? grads->weight_for(weight) : at::Tensor();
}

}  // namespace mpipe
