#pragma once

// Private: a short spin before a thread of the runtime sleeps on a condition
// variable (Note [Spinning before sleeping]).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>

namespace mpipe {
namespace detail {

// Note [Spinning before sleeping]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage's worker that waits for its input sleeps on a condition variable,
// and the sender wakes it. On a GPU host that wake-up is most of what worker
// threads add per task: the next stage's input is usually ready a few µs after
// it starts waiting, but a sleeping thread takes 5-50 µs to run again (a futex
// wake, an idle core leaving its sleep state); the forward of the overhead
// workload cost 18-22 µs per task with threads against 6-13 inline on one
// H100 (bench/RESULTS.md). So each wait first watches a counter that every
// hand-off bumps, for up to spin_limit() (50 µs), then sleeps as before: the
// hand-offs that come quickly cost no wake-up, and a long wait (a backward
// that comes later in the schedule) burns at most 50 µs of one core.
// Spinning takes a core from whoever does the work, so it is on only where
// cores are to spare: 8 or more hardware threads (off on the 2-core build
// machine, where the threads' cost already met its bound). MPIPE_SPIN_US
// sets the limit in µs (0: never spin), for measurements. Not yet shown to
// pay: on one H100 the overhead workload did not tell spinning from not
// spinning (5-13 against 9-17 µs per forward task, the plain loop itself
// moving as much between runs; bench/RESULTS.md, issue 48), so measure it
// again with the interleaved timing before relying on it.
inline std::chrono::microseconds spin_limit() {
  static const std::chrono::microseconds limit = [] {
    if (const char* v = std::getenv("MPIPE_SPIN_US")) {
      return std::chrono::microseconds(std::max(0L, std::strtol(v, nullptr, 10)));
    }
    return std::chrono::microseconds(std::thread::hardware_concurrency() >= 8 ? 50 : 0);
  }();
  return limit;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// When a wait that starts now stops spinning; nullopt: it does not spin.
inline std::optional<std::chrono::steady_clock::time_point> spin_deadline() {
  const std::chrono::microseconds limit = spin_limit();
  if (limit.count() == 0) return std::nullopt;
  return std::chrono::steady_clock::now() + limit;
}

/// Watches `counter` until it differs from `seen` (true) or `until` passes
/// (false).
inline bool spin_until_changed(const std::atomic<uint64_t>& counter, uint64_t seen,
                               std::chrono::steady_clock::time_point until) {
  for (unsigned k = 1;; ++k) {
    if (counter.load(std::memory_order_acquire) != seen) return true;
    cpu_relax();
    if (k % 32 == 0 && std::chrono::steady_clock::now() >= until) return false;
  }
}

/// Spins while `ready()` is false (called with `lock` held), watching
/// `counter`, which whoever makes it true bumps under that lock; returns with
/// `lock` held, ready or not (then the caller sleeps as usual).
template <typename Ready>
void spin_while_not(std::unique_lock<std::mutex>& lock, const std::atomic<uint64_t>& counter,
                    const Ready& ready) {
  if (ready()) return;
  const auto until = spin_deadline();
  if (!until) return;
  for (;;) {
    const uint64_t seen = counter.load(std::memory_order_relaxed);
    lock.unlock();
    const bool changed = spin_until_changed(counter, seen, *until);
    lock.lock();
    if (!changed || ready()) return;
  }
}

}  // namespace detail
}  // namespace mpipe
