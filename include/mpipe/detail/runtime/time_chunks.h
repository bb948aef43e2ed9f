#pragma once

// Private: a call's T time steps as items of k steps each (Note [Time chunks]
// in calls-inl.h).

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace mpipe {
namespace detail {

/// A call's time chunk chosen by the pipeline (ModelPipelineOptions::time_chunk 0).
constexpr int64_t kAutoChunk = -1;

/// T steps as items of k steps each (the last may be shorter); k = 0 means
/// single-step items.
struct TimeChunks {
  int64_t T = 0;
  int64_t k = 0;
  bool multi() const { return k > 0; }
  int64_t count() const { return multi() ? (T + k - 1) / k : T; }
  int64_t first(int64_t i) const { return multi() ? i * k : i; }
  int64_t size(int64_t i) const { return multi() ? std::min(k, T - i * k) : 1; }
  /// " (time steps a to b of T)" for chunk i; empty for single steps.
  std::string steps_of(int64_t i) const {
    if (!multi()) return {};
    return c10::str(" (time steps ", first(i), " to ", first(i) + size(i) - 1, " of ", T, ")");
  }
  /// "time step t of T", or "time chunk i of n (time steps a to b of T)".
  std::string describe(int64_t i) const {
    if (!multi()) return c10::str("time step ", i, " of ", T);
    return c10::str("time chunk ", i, " of ", count(), steps_of(i));
  }
};

}  // namespace detail
}  // namespace mpipe
