#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/checkpoint.h"
#include "mpipe/detail/runtime/recompute.h"
#include "mpipe/state.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

namespace mpipe {

namespace detail {
MPIPE_INLINE_VAR thread_local MicroBatch t_micro_batch;
MPIPE_INLINE_VAR thread_local bool recomputing = false;

MPIPE_FUNC RecomputeGuard::RecomputeGuard() noexcept : previous_(recomputing) {
  recomputing = true;
}
MPIPE_FUNC RecomputeGuard::~RecomputeGuard() { recomputing = previous_; }
}  // namespace detail

MPIPE_FUNC bool is_recomputing() noexcept { return detail::recomputing; }

MPIPE_FUNC MicroBatch current_micro_batch() noexcept { return detail::t_micro_batch; }

MPIPE_FUNC MicroBatchGuard::MicroBatchGuard(MicroBatch micro_batch) noexcept
    : previous_(detail::t_micro_batch) {
  detail::t_micro_batch = micro_batch;
}

MPIPE_FUNC MicroBatchGuard::~MicroBatchGuard() { detail::t_micro_batch = previous_; }

MPIPE_FUNC std::any Stateful::save_state() const {
  TORCH_CHECK(false, "mpipe::Stateful::save_state: this module does not support state "
              "snapshots (override supports_state_snapshots, save_state and load_state)");
}

MPIPE_FUNC void Stateful::load_state(const std::any& /*state*/) {
  TORCH_CHECK(false, "mpipe::Stateful::load_state: this module does not support state "
              "snapshots (override supports_state_snapshots, save_state and load_state)");
}

MPIPE_FUNC int64_t reset_states(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* stateful = dynamic_cast<Stateful*>(m.get())) {
      stateful->reset_state();
      ++n;
    }
  }
  return n;
}

}  // namespace mpipe
