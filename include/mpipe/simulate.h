#ifndef MPIPE_SIMULATE_H_
#define MPIPE_SIMULATE_H_

// Programs in time: simulate(), which runs programs (mpipe/schedule.h, Note [Programs]) on that
// clock, with makespan() and bubble() from it. Pure functions, like the
// schedules: no tensors and no threads, so they are tested exactly;
// choose_schedule (mpipe/training.h) and the timeline's predicted bubble use
// them. Bad arguments throw c10::ValueError.

#include <mpipe/schedule.h>

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace mpipe {
namespace schedules {

/// An operation as simulate() ran it: on which rank, from when to when.
struct TimedOp {
  /// The rank (worker) that ran it.
  int64_t rank;
  /// The operation.
  Op op;
  /// When it started.
  double start;
  /// When it ended.
  double end;
  /// Same rank, operation, start and end.
  bool operator==(const TimedOp& b) const {
    return rank == b.rank && op == b.op && start == b.start && end == b.end;
  }
};

/// Runs `programs`: each rank runs its operations in order, one at a time,
/// each as early as its rank is free and its inputs exist (the dependencies
/// of Note [Programs]), taking the stage's cost; a hand-off costs `transfer`
/// between stages of different ranks, nothing between two of one rank. `devices` (one per rank; empty:
/// every rank its own) names the device each rank computes on; ranks on one
/// device run one operation at a time between them, the earliest-ready first.
/// A pair (Op::with_next) runs its two operations one after the other and
/// hands on the first one's result when the second ends.
/// Returns every operation with its start and end, by start time
/// (dependencies first). Throws c10::ValueError (a c10::Error) if the
/// programs cannot finish (a dependency cycle, a missing operation) or a cost
/// is negative.
inline std::vector<TimedOp> simulate(const std::vector<Program>& programs, const Costs& costs = {},
                                     const std::vector<int64_t>& devices = {}) {
  int64_t n = 0, m = 0;
  size_t remaining = 0;
  for (const auto& p : programs) {
    for (const Op& op : p) {
      TORCH_CHECK_VALUE(op.stage >= 0 && op.micro_batch >= 0,
                        "mpipe::schedules::simulate: negative index in ", op);
      n = std::max(n, op.stage + 1);
      m = std::max(m, op.micro_batch + 1);
    }
    remaining += p.size();
  }
  TORCH_CHECK_VALUE(costs.size() <= 1 || static_cast<int64_t>(costs.size()) >= n,
                    "mpipe::schedules::simulate: ", costs.size(), " costs for ", n, " stages");
  TORCH_CHECK_VALUE(devices.empty() || devices.size() == programs.size(),
                    "mpipe::schedules::simulate: ", devices.size(), " devices for ",
                    programs.size(), " ranks");
  auto cost = [&](int64_t s) -> StageCost {
    return costs.empty() ? StageCost{} : costs[costs.size() == 1 ? 0 : static_cast<size_t>(s)];
  };
  for (int64_t s = 0; s < n; ++s) {
    const StageCost c = cost(s);
    TORCH_CHECK_VALUE(c.forward >= 0 && c.backward_input >= 0 && c.backward_weight >= 0 &&
                          c.transfer >= 0,
                      "mpipe::schedules::simulate: stage ", s, " has a negative or NaN cost");
  }
  // A hand-off between stages of one rank costs nothing (it stays on the worker).
  std::vector<size_t> rank_of(static_cast<size_t>(n), 0);
  for (size_t r = 0; r < programs.size(); ++r) {
    for (const Op& op : programs[r]) rank_of[static_cast<size_t>(op.stage)] = r;
  }
  auto hand_off = [&](int64_t from) {  // between stage `from` and from + 1
    return rank_of[static_cast<size_t>(from)] == rank_of[static_cast<size_t>(from) + 1]
               ? 0.0
               : cost(from).transfer;
  };
  const double unset = -1;
  // End times per (stage, micro-batch): forward, and input gradient (B or I).
  std::vector<std::vector<double>> f_end(static_cast<size_t>(n),
                                         std::vector<double>(static_cast<size_t>(m), unset));
  auto g_end = f_end;
  std::vector<size_t> pc(programs.size(), 0);
  std::vector<double> rank_free(programs.size(), 0);
  std::vector<double> device_free(programs.size(), 0);  // by device index (compacted below)
  std::vector<size_t> device(programs.size());
  for (size_t r = 0; r < programs.size(); ++r) {
    device[r] = r;
    for (size_t q = 0; q < r && !devices.empty(); ++q) {
      if (devices[q] == devices[r]) {
        device[r] = device[q];
        break;
      }
    }
  }
  /// When rank r's next operation can start, or < 0 while its inputs are missing.
  auto ready_at = [&](size_t r) -> double {
    const Op op = programs[r][pc[r]];
    const auto s = static_cast<size_t>(op.stage), i = static_cast<size_t>(op.micro_batch);
    double ready = std::max(rank_free[r], device_free[device[r]]);
    if (op.kind == OpKind::Forward) {
      if (s > 0) {
        if (f_end[s - 1][i] == unset) return -1;
        ready = std::max(ready, f_end[s - 1][i] + hand_off(op.stage - 1));
      }
    } else if (op.kind == OpKind::BackwardWeight) {
      if (g_end[s][i] == unset) return -1;
      ready = std::max(ready, g_end[s][i]);
    } else {
      if (f_end[s][i] == unset) return -1;
      ready = std::max(ready, f_end[s][i]);
      if (static_cast<int64_t>(s) + 1 < n) {
        if (g_end[s + 1][i] == unset) return -1;
        ready = std::max(ready, g_end[s + 1][i] + hand_off(op.stage));
      }
    }
    return ready;
  };
  // Per rank: the first operation of a pair whose result waits for the
  // pair's end (kind F or B/I, stage, micro-batch), or none.
  std::vector<c10::optional<Op>> held(programs.size());
  std::vector<TimedOp> out;
  out.reserve(remaining);
  while (remaining > 0) {
    // The operation that can start first (ties: the lower rank).
    size_t best = programs.size();
    double best_at = 0;
    for (size_t r = 0; r < programs.size(); ++r) {
      if (pc[r] == programs[r].size()) continue;
      const double at = ready_at(r);
      if (at >= 0 && (best == programs.size() || at < best_at)) best = r, best_at = at;
    }
    if (best == programs.size()) {
      std::string stuck;
      for (size_t r = 0; r < programs.size(); ++r) {
        if (pc[r] < programs[r].size()) {
          stuck += (stuck.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " at " +
                                                  c10::str(programs[r][pc[r]]));
        }
      }
      TORCH_CHECK_VALUE(false, "mpipe::schedules::simulate: the programs cannot finish (" +
                                  stuck + " wait for operations that never run)");
    }
    const Op op = programs[best][pc[best]];
    const StageCost c = cost(op.stage);
    const double d = op.kind == OpKind::Forward         ? c.forward
                     : op.kind == OpKind::Backward      ? c.backward_input + c.backward_weight
                     : op.kind == OpKind::BackwardInput ? c.backward_input
                                                        : c.backward_weight;
    const double end = best_at + d;
    auto finish = [&](const Op& done) {
      const auto ds = static_cast<size_t>(done.stage), di = static_cast<size_t>(done.micro_batch);
      if (done.kind == OpKind::Forward) f_end[ds][di] = end;
      if (done.kind == OpKind::Backward || done.kind == OpKind::BackwardInput) g_end[ds][di] = end;
    };
    if (held[best]) finish(*held[best]), held[best].reset();
    if (op.with_next && pc[best] + 1 < programs[best].size()) {
      held[best] = op;
    } else {
      finish(op);
    }
    out.push_back(TimedOp{static_cast<int64_t>(best), op, best_at, end});
    rank_free[best] = end;
    device_free[device[best]] = end;
    ++pc[best];
    --remaining;
  }
  // Chosen in order of start already; stable for equal starts (zero costs),
  // where dependencies were chosen first.
  std::stable_sort(out.begin(), out.end(),
                   [](const TimedOp& a, const TimedOp& b) { return a.start < b.start; });
  return out;
}

/// The time from the first start to the last end of simulate(programs, costs).
inline double makespan(const std::vector<Program>& programs, const Costs& costs = {},
                       const std::vector<int64_t>& devices = {}) {
  double end = 0;
  for (const TimedOp& t : simulate(programs, costs, devices)) end = std::max(end, t.end);
  return end;
}

/// Fraction of rank time left idle when `programs` run as in simulate:
/// 1 - (sum of operation times) / (ranks * makespan) (ranks sharing a device
/// count once). For GPipe and 1F1B with equal stages it is
/// (n - 1) / (m + n - 1), as for forward_only.
inline double bubble(const std::vector<Program>& programs, const Costs& costs = {},
                     const std::vector<int64_t>& devices = {}) {
  const auto ops = simulate(programs, costs, devices);
  size_t units = programs.size();
  if (!devices.empty()) {
    std::vector<int64_t> distinct(devices);
    std::sort(distinct.begin(), distinct.end());
    units = static_cast<size_t>(std::unique(distinct.begin(), distinct.end()) - distinct.begin());
  }
  double busy = 0, end = 0;
  for (const TimedOp& t : ops) {
    busy += t.end - t.start;
    end = std::max(end, t.end);
  }
  if (programs.empty() || end <= 0) return 0.0;
  return 1.0 - busy / (static_cast<double>(units) * end);
}

}  // namespace schedules
}  // namespace mpipe

#endif  // MPIPE_SIMULATE_H_
