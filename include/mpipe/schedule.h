#pragma once

// Pure schedule functions: which stage runs which item (micro-batch or time
// step) at each clock tick. They hold no tensors and no threads, so they are
// tested exactly; the runtime follows them (see Note [Pipeline runtime]).

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mpipe {
namespace schedule {

/// One unit of work: `stage` runs item `index` (a micro-batch, or a time step).
struct Task {
  int64_t stage;
  int64_t index;
  friend bool operator==(const Task& a, const Task& b) {
    return a.stage == b.stage && a.index == b.index;
  }
  friend bool operator!=(const Task& a, const Task& b) { return !(a == b); }
};

using Clock = std::vector<Task>;

/// Fill-drain wavefront (GPipe's forward): at clock k, stage j runs item k - j
/// for every stage j where that item exists; n_items + n_stages - 1 clocks in
/// all. Within a clock, tasks are listed by ascending stage. Every stage runs
/// every item exactly once, items in order, and item i reaches stage j only
/// after stage j - 1 finished it (at an earlier clock).
inline std::vector<Clock> fill_drain(int64_t n_items, int64_t n_stages) {
  if (n_items < 0 || n_stages < 0) {
    throw std::invalid_argument("mpipe::schedule::fill_drain: sizes must be >= 0, got n_items=" +
                                std::to_string(n_items) +
                                ", n_stages=" + std::to_string(n_stages));
  }
  std::vector<Clock> clocks;
  if (n_items == 0 || n_stages == 0) return clocks;
  const int64_t n_clocks = n_items + n_stages - 1;
  clocks.reserve(static_cast<size_t>(n_clocks));
  for (int64_t k = 0; k < n_clocks; ++k) {
    Clock clock;
    const int64_t first = k - n_items + 1 > 0 ? k - n_items + 1 : 0;
    const int64_t last = k < n_stages - 1 ? k : n_stages - 1;
    for (int64_t j = first; j <= last; ++j) clock.push_back(Task{j, k - j});
    clocks.push_back(std::move(clock));
  }
  return clocks;
}

/// Fraction of stage-clock slots left idle by fill_drain: (n - 1) / (m + n - 1).
inline double fill_drain_bubble(int64_t n_items, int64_t n_stages) {
  if (n_items <= 0 || n_stages <= 0) return 0.0;
  return static_cast<double>(n_stages - 1) / static_cast<double>(n_items + n_stages - 1);
}

}  // namespace schedule
}  // namespace mpipe
