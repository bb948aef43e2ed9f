#pragma once

// Private: facts about schedule programs that the runtime, not the user,
// needs: constant_train_step's programs and the activations in flight
// (the tests check them).

#include <mpipe/schedule.h>

#include <cstdint>
#include <vector>

namespace mpipe {
namespace detail {

/// constant_train_step's programs: rank s runs stage s, the forwards of
/// every time chunk, then their backwards from the last chunk down, since a
/// chunk's backward takes what the next chunk's sent back through the
/// stage's state (Note [Chained backward]).
inline std::vector<schedules::Program> chained(int64_t n_chunks, int64_t n_stages) {
  check_sizes("chained", n_chunks, n_stages);
  std::vector<schedules::Program> programs(static_cast<size_t>(n_stages));
  for (int64_t s = 0; s < n_stages; ++s) {
    schedules::Program& p = programs[static_cast<size_t>(s)];
    for (int64_t i = 0; i < n_chunks; ++i) p.push_back(schedules::F(i, s));
    for (int64_t i = n_chunks - 1; i >= 0; --i) p.push_back(schedules::B(i, s));
  }
  return programs;
}

/// The most (stage, micro-batch) activations a rank holds at once.
inline int64_t peak_in_flight(const schedules::Program& program) {
  return static_cast<int64_t>(schedules::peak_activations(program));
}

}  // namespace detail
}  // namespace mpipe
