#pragma once

// Private: the runtime's side of activation checkpointing (mpipe/checkpoint.h):
// which micro-batches a step recomputes, and the thread's recompute flag that
// mpipe::is_recomputing() reads (defined in state-inl.h).

#include "mpipe/checkpoint.h"

#include <cstdint>

namespace mpipe {
namespace detail {

/// Whether micro-batch `index` of `count` is checkpointed under `mode`.
inline bool checkpointed(Checkpoint mode, int64_t index, int64_t count) {
  return mode == Checkpoint::Always || (mode == Checkpoint::ExceptLast && index + 1 < count);
}

/// Marks this thread as recomputing (is_recomputing() true) while it lives.
class RecomputeGuard {
 public:
  RecomputeGuard() noexcept;
  ~RecomputeGuard();
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace detail
}  // namespace mpipe
