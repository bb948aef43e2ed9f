#pragma once

// Pure schedule functions: which stage runs which item (micro-batch or time
// step) at each clock tick. They hold no tensors and no threads, so they are
// tested exactly; the runtime follows them (docs/design.md, "One runtime").

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mpipe {
namespace schedules {

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
    throw std::invalid_argument("mpipe::schedules::fill_drain: sizes must be >= 0, got n_items=" +
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

// ---------------------------------------------------------------------------
// Training schedules: each stage runs a program, a list of forward and
// backward operations on micro-batches, in order. An operation waits only for
// its data: F(j, i) for F(j - 1, i)'s activation, B(j, i) for B(j + 1, i)'s
// gradient (the last stage's B(i) for its own F(i), which computes the loss).

enum class OpKind { Forward, Backward };

struct Op {
  OpKind kind;
  int64_t micro_batch;
  friend bool operator==(const Op& a, const Op& b) {
    return a.kind == b.kind && a.micro_batch == b.micro_batch;
  }
  friend bool operator!=(const Op& a, const Op& b) { return !(a == b); }
};

inline Op F(int64_t micro_batch) { return Op{OpKind::Forward, micro_batch}; }
inline Op B(int64_t micro_batch) { return Op{OpKind::Backward, micro_batch}; }

using Program = std::vector<Op>;

namespace detail {
inline void check_sizes(const char* who, int64_t n_micro, int64_t n_stages) {
  if (n_micro <= 0 || n_stages <= 0) {
    throw std::invalid_argument(std::string("mpipe::schedules::") + who +
                                ": sizes must be positive, got n_micro=" +
                                std::to_string(n_micro) + ", n_stages=" + std::to_string(n_stages));
  }
}
}  // namespace detail

/// GPipe (fill-drain): every stage runs all forwards, then all backwards.
/// Each stage keeps the activations of all n_micro micro-batches alive.
inline std::vector<Program> gpipe(int64_t n_micro, int64_t n_stages) {
  detail::check_sizes("gpipe", n_micro, n_stages);
  std::vector<Program> programs(static_cast<size_t>(n_stages));
  for (auto& p : programs) {
    for (int64_t i = 0; i < n_micro; ++i) p.push_back(F(i));
    for (int64_t i = 0; i < n_micro; ++i) p.push_back(B(i));
  }
  return programs;
}

/// 1F1B (PipeDream-flush): stage j runs min(n_stages - j - 1, n_micro) warm-up
/// forwards, then alternates one forward and one backward, then drains the
/// remaining backwards. Stage j keeps at most n_stages - j micro-batches'
/// activations alive; the run takes as many steps as GPipe.
inline std::vector<Program> one_f_one_b(int64_t n_micro, int64_t n_stages) {
  detail::check_sizes("one_f_one_b", n_micro, n_stages);
  std::vector<Program> programs(static_cast<size_t>(n_stages));
  for (int64_t j = 0; j < n_stages; ++j) {
    Program& p = programs[static_cast<size_t>(j)];
    const int64_t warmup = std::min(n_stages - j - 1, n_micro);
    int64_t next_f = 0, next_b = 0;
    while (next_f < warmup) p.push_back(F(next_f++));
    while (next_f < n_micro) {
      p.push_back(F(next_f++));
      p.push_back(B(next_b++));
    }
    while (next_b < n_micro) p.push_back(B(next_b++));
  }
  return programs;
}

/// Most micro-batches whose forward has run but whose backward has not, at
/// any point of `program`: the activations a stage holds at its peak.
inline int64_t peak_in_flight(const Program& program) {
  int64_t live = 0, peak = 0;
  for (const Op& op : program) {
    live += op.kind == OpKind::Forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

/// The program of a call with no backward operations (forward,
/// constant_forward, sequence_forward): every stage runs F(0), ..., F(n - 1).
/// Run on simulate's clock it is fill_drain's wavefront.
inline std::vector<Program> forward_only(int64_t n_items, int64_t n_stages) {
  detail::check_sizes("forward_only", n_items, n_stages);
  std::vector<Program> programs(static_cast<size_t>(n_stages));
  for (auto& p : programs) {
    for (int64_t i = 0; i < n_items; ++i) p.push_back(F(i));
  }
  return programs;
}

/// Throws std::invalid_argument unless every stage's program runs F(i) and B(i)
/// exactly once for each micro-batch i < n_micro, F(i) before B(i); with
/// `backward` = false, F(i) exactly once and no B at all.
inline void validate(const std::vector<Program>& programs, int64_t n_micro,
                     bool backward = true) {
  for (size_t j = 0; j < programs.size(); ++j) {
    std::vector<int> f(static_cast<size_t>(n_micro), 0), b(f);
    for (const Op& op : programs[j]) {
      const bool fwd = op.kind == OpKind::Forward;
      if (op.micro_batch < 0 || op.micro_batch >= n_micro ||
          (!fwd && !backward) || ++(fwd ? f : b)[static_cast<size_t>(op.micro_batch)] > 1 ||
          (!fwd && f[static_cast<size_t>(op.micro_batch)] == 0)) {
        throw std::invalid_argument("mpipe::schedules::validate: stage " + std::to_string(j) +
                                    " has a missing, repeated or misordered operation on "
                                    "micro-batch " + std::to_string(op.micro_batch));
      }
    }
    if (programs[j].size() != static_cast<size_t>((backward ? 2 : 1) * n_micro)) {
      throw std::invalid_argument("mpipe::schedules::validate: stage " + std::to_string(j) +
                                  " runs " + std::to_string(programs[j].size()) +
                                  " operations, expected " +
                                  std::to_string((backward ? 2 : 1) * n_micro));
    }
  }
}

struct TimedOp {
  int64_t stage;
  Op op;
  friend bool operator==(const TimedOp& a, const TimedOp& b) {
    return a.stage == b.stage && a.op == b.op;
  }
};

/// Runs `programs` on a clock where every operation takes one tick and starts
/// as soon as its stage is free and its input exists (produced at an earlier
/// tick). Returns the operations of each tick, by ascending stage. Throws
/// std::invalid_argument if the programs cannot finish (a dependency cycle, a
/// missing or repeated operation).
inline std::vector<std::vector<TimedOp>> simulate(const std::vector<Program>& programs) {
  const int64_t n = static_cast<int64_t>(programs.size());
  int64_t m = 0;
  for (const auto& p : programs) {
    for (const Op& op : p) m = std::max(m, op.micro_batch + 1);
  }
  // done_at[kind][stage][mb]: tick at which the op finished, -1 if not yet.
  std::vector<std::vector<int64_t>> f_done(static_cast<size_t>(n),
                                           std::vector<int64_t>(static_cast<size_t>(m), -1));
  auto b_done = f_done;
  std::vector<size_t> pc(static_cast<size_t>(n), 0);
  std::vector<std::vector<TimedOp>> ticks;
  size_t remaining = 0;
  for (const auto& p : programs) remaining += p.size();
  for (int64_t tick = 0; remaining > 0; ++tick) {
    std::vector<TimedOp> now;
    for (int64_t j = 0; j < n; ++j) {
      const Program& p = programs[static_cast<size_t>(j)];
      if (pc[static_cast<size_t>(j)] == p.size()) continue;
      const Op op = p[pc[static_cast<size_t>(j)]];
      const auto i = static_cast<size_t>(op.micro_batch);
      const auto js = static_cast<size_t>(j);
      bool ready;
      if (op.kind == OpKind::Forward) {
        ready = f_done[js][i] < 0 && (j == 0 || (f_done[js - 1][i] >= 0 && f_done[js - 1][i] < tick));
      } else {
        ready = b_done[js][i] < 0 && f_done[js][i] >= 0 &&
                (j == n - 1 || (b_done[js + 1][i] >= 0 && b_done[js + 1][i] < tick));
      }
      if (ready) now.push_back(TimedOp{j, op});
    }
    if (now.empty()) {
      throw std::invalid_argument("mpipe::schedules::simulate: the programs cannot finish (tick " +
                                  std::to_string(tick) + ")");
    }
    for (const TimedOp& t : now) {
      auto& done = t.op.kind == OpKind::Forward ? f_done : b_done;
      done[static_cast<size_t>(t.stage)][static_cast<size_t>(t.op.micro_batch)] = tick;
      ++pc[static_cast<size_t>(t.stage)];
      --remaining;
    }
    ticks.push_back(std::move(now));
  }
  return ticks;
}

/// Fraction of stage-tick slots left idle when `programs` run on simulate's
/// unit clock: 1 - operations / (stages * ticks). For GPipe and 1F1B it is
/// (n - 1) / (m + n - 1), as for fill_drain.
inline double bubble(const std::vector<Program>& programs) {
  if (programs.empty()) return 0.0;
  const auto ticks = simulate(programs);
  size_t ops = 0;
  for (const auto& t : ticks) ops += t.size();
  if (ticks.empty()) return 0.0;
  return 1.0 - static_cast<double>(ops) /
                   (static_cast<double>(programs.size()) * static_cast<double>(ticks.size()));
}

}  // namespace schedules
}  // namespace mpipe
