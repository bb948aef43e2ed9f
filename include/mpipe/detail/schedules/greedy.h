#pragma once

// Private: programs made by list scheduling on simulate's clock, behind
// schedules::zero_bubble_v and Schedule::Tailored (Note [Greedy schedules]).

#include <mpipe/schedule.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

// Note [Greedy schedules]
// ~~~~~~~~~~~~~~~~~~~~~~~
// ZB-V and the schedules built for measured costs come from one list
// scheduler. It plays the step on schedules::simulate's clock (a worker runs
// one operation at a time; F(s, i) waits for F(s - 1, i), I(s, i) for
// F(s, i) and I(s + 1, i), W(s, i) for I(s, i); a hand-off between stages
// of different workers costs the earlier stage's `transfer`) and at each turn
// appends to a program the operation that can start earliest on any worker
// (ties: the lower worker). Among one worker's operations ready at that
// moment it takes them by kind in the policy's order of I, F and W, and
// within a kind the highest stage first. I first: the stages before wait for
// it (the critical path). F before W: the worker stays busy, and the W's,
// which nobody waits for, fill what would be idle time; W before F frees
// activations as soon as possible. Each stage runs its F, I and W in
// micro-batch order. Memory: a worker admits a micro-batch (the F of its
// lowest stage) only while the policy's cap allows: at most `cap` admitted
// micro-batches holding activations there, or at most `cap` activations
// held and promised (an admitted micro-batch promises one per stage of the
// worker; each W frees one). The forwards of later stages of admitted
// micro-batches are never held back, so the cap cannot deadlock: the last
// worker's micro-batches always finish, then the one before's, and so on.
//
// ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section
// 6) places 2D stages on D workers in a V (worker w holds stages w and
// 2D-1-w) and must stay within 1F1B's peak memory: 2D half-stage activations
// per worker, D stages' worth. zero_bubble_v builds the V with every policy
// (orders IFW, FIW, IWF; caps of 1 to D micro-batches or 2 to 2D
// activations) at unit costs and keeps the shortest run within that memory.
// With m a multiple of D this takes 6m + D - 1 units of a half-stage
// operation, the least possible (the last worker cannot start before D - 1
// units and then never idles; order IFW, cap D micro-batches gives it); for
// other m >= D it stays within a few units of that and never above ZB-H1 on
// D whole stages. (tests/test_v_schedules.cpp checks these.)

/// How a worker picks among its ready operations, and what bounds its memory.
struct GreedyPolicy {
  /// The kinds in order of preference: "IFW", "FIW" or "IWF".
  const char* order = "IFW";
  /// At most this many admitted micro-batches on a worker (by_units false),
  /// or this many activations held and promised (by_units true: admitting a
  /// micro-batch promises one per stage of the worker, each W frees one).
  int64_t cap = 1;
  bool by_units = false;
};

inline std::vector<schedules::Program> greedy_programs(int64_t n_micro,
                                                       const std::vector<int64_t>& worker_of,
                                                       const schedules::Costs& costs,
                                                       const GreedyPolicy& policy,
                                                       double* makespan = nullptr) {
  using schedules::OpKind;
  const auto n = static_cast<int64_t>(worker_of.size());
  TORCH_CHECK_VALUE(n > 0 && n_micro > 0 && policy.cap > 0,
                    "mpipe::schedules: sizes must be positive, got n_micro=", n_micro,
                    ", n_stages=", n, ", cap=", policy.cap);
  const std::string order = policy.order;  // each kind's preference: 0, 1 or 2, times n
  const int64_t prefer_i = static_cast<int64_t>(order.find('I')) * n,
                prefer_f = static_cast<int64_t>(order.find('F')) * n,
                prefer_w = static_cast<int64_t>(order.find('W')) * n;
  TORCH_CHECK_VALUE(order.size() == 3 && prefer_i >= 0 && prefer_f >= 0 && prefer_w >= 0,
                    "mpipe::schedules: a policy orders I, F and W, got '", order, "'");
  const int64_t workers = *std::max_element(worker_of.begin(), worker_of.end()) + 1;
  TORCH_CHECK_VALUE(costs.size() <= 1 || static_cast<int64_t>(costs.size()) >= n,
                    "mpipe::schedules: ", costs.size(), " costs for ", n, " stages");
  for (const auto& c : costs) {
    TORCH_CHECK_VALUE(c.forward >= 0 && c.backward_input >= 0 && c.backward_weight >= 0 &&
                          c.transfer >= 0,
                      "mpipe::schedules: a negative or NaN cost");
  }
  auto cost = [&](int64_t s) {
    return costs.empty() ? schedules::StageCost{}
                         : costs[costs.size() == 1 ? 0 : static_cast<size_t>(s)];
  };
  auto hand_off = [&](int64_t from, int64_t to) {  // the cost between adjacent stages
    return worker_of[static_cast<size_t>(from)] == worker_of[static_cast<size_t>(to)]
               ? 0.0
               : cost(std::min(from, to)).transfer;
  };
  std::vector<int64_t> lowest(static_cast<size_t>(workers), n);  // each worker's entry stage
  std::vector<int64_t> held(static_cast<size_t>(workers), 0);     // stages per worker
  for (int64_t s = 0; s < n; ++s) {
    auto& l = lowest[static_cast<size_t>(worker_of[static_cast<size_t>(s)])];
    l = std::min(l, s);
    ++held[static_cast<size_t>(worker_of[static_cast<size_t>(s)])];
  }
  TORCH_CHECK_VALUE(!policy.by_units || policy.cap >= *std::max_element(held.begin(), held.end()),
                    "mpipe::schedules: a cap of ", policy.cap, " activations admits no micro-batch");
  // Per stage: the next micro-batch of each kind, and end times.
  const auto m = static_cast<size_t>(n_micro);
  std::vector<int64_t> next_f(static_cast<size_t>(n), 0), next_i = next_f, next_w = next_f;
  std::vector<std::vector<double>> f_end(static_cast<size_t>(n), std::vector<double>(m, -1));
  auto i_end = f_end;
  // Per worker: admitted micro-batches still holding activations, the
  // activations held and promised, and for each micro-batch the stages whose
  // W is still to come.
  std::vector<int64_t> admitted(static_cast<size_t>(workers), 0), units = admitted;
  std::vector<std::vector<int64_t>> pending(static_cast<size_t>(workers), std::vector<int64_t>(m, 0));
  for (int64_t s = 0; s < n; ++s) {
    for (auto& p : pending[static_cast<size_t>(worker_of[static_cast<size_t>(s)])]) ++p;
  }
  std::vector<double> free_at(static_cast<size_t>(workers), 0);
  std::vector<schedules::Program> programs(static_cast<size_t>(workers));
  for (int64_t left = 3 * n * n_micro; left > 0; --left) {
    int64_t best_w = -1;
    double best_at = 0;
    schedules::Op best_op{OpKind::Forward, 0, 0};
    for (int64_t w = 0; w < workers; ++w) {
      double at = -1;
      int64_t rank = 0;  // the preference among ops ready at `at` (lower first)
      schedules::Op pick{OpKind::Forward, 0, 0};
      auto offer = [&](schedules::Op op, double ready, int64_t preference) {
        ready = std::max(ready, free_at[static_cast<size_t>(w)]);
        if (at < 0 || ready < at || (ready == at && preference < rank)) {
          at = ready, rank = preference, pick = op;
        }
      };
      for (int64_t s = n - 1; s >= 0; --s) {
        if (worker_of[static_cast<size_t>(s)] != w) continue;
        const auto su = static_cast<size_t>(s);
        const int64_t high = n - 1 - s;  // higher stages first
        if (next_i[su] < n_micro) {
          const auto i = static_cast<size_t>(next_i[su]);
          const bool up = s + 1 == n || i_end[su + 1][i] >= 0;
          if (f_end[su][i] >= 0 && up) {
            offer(schedules::I(next_i[su], s),
                  std::max(f_end[su][i], s + 1 == n ? 0.0 : i_end[su + 1][i] + hand_off(s, s + 1)),
                  prefer_i + high);
          }
        }
        if (next_f[su] < n_micro) {
          const auto i = static_cast<size_t>(next_f[su]);
          const bool entry = s == lowest[static_cast<size_t>(w)];
          if ((s == 0 || f_end[su - 1][i] >= 0) &&
              (!entry || (policy.by_units ? units[static_cast<size_t>(w)] + held[static_cast<size_t>(w)]
                                          : admitted[static_cast<size_t>(w)] + 1) <= policy.cap)) {
            offer(schedules::F(next_f[su], s), s == 0 ? 0.0 : f_end[su - 1][i] + hand_off(s - 1, s),
                  prefer_f + high);
          }
        }
        if (next_w[su] < next_i[su]) {
          offer(schedules::W(next_w[su], s), i_end[su][static_cast<size_t>(next_w[su])],
                prefer_w + high);
        }
      }
      if (at >= 0 && (best_w < 0 || at < best_at)) best_w = w, best_at = at, best_op = pick;
    }
    TORCH_INTERNAL_ASSERT(best_w >= 0, "greedy_programs: no operation can run");
    const auto su = static_cast<size_t>(best_op.stage), i = static_cast<size_t>(best_op.micro_batch);
    const auto wu = static_cast<size_t>(best_w);
    const schedules::StageCost c = cost(best_op.stage);
    double end = best_at;
    if (best_op.kind == OpKind::Forward) {
      end += c.forward;
      f_end[su][i] = end;
      ++next_f[su];
      if (best_op.stage == lowest[wu]) ++admitted[wu], units[wu] += held[wu];
    } else if (best_op.kind == OpKind::BackwardInput) {
      end += c.backward_input;
      i_end[su][i] = end;
      ++next_i[su];
    } else {
      end += c.backward_weight;
      ++next_w[su];
      --units[wu];
      if (--pending[wu][i] == 0) --admitted[wu];
    }
    free_at[wu] = end;
    programs[wu].push_back(best_op);
  }
  if (makespan) *makespan = *std::max_element(free_at.begin(), free_at.end());
  return programs;
}

/// Worker of each of 2D stages in the V placement: stage s on worker s for
/// s < D, else 2D - 1 - s.
inline std::vector<int64_t> v_placement(int64_t n_stages) {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < n_stages; ++s) out.push_back(s < n_stages / 2 ? s : n_stages - 1 - s);
  return out;
}

}  // namespace detail

namespace schedules {
inline std::vector<Program> zero_bubble_v(int64_t n_micro, int64_t n_workers) {
  TORCH_CHECK_VALUE(n_micro > 0 && n_workers > 0, "mpipe::schedules::zero_bubble_v: sizes must "
                    "be positive, got n_micro=", n_micro, ", n_workers=", n_workers);
  // Note [Greedy schedules]: the least makespan of the policies that hold at
  // most 2D activations per worker, built once per size.
  static std::mutex mutex;
  static std::map<std::pair<int64_t, int64_t>, std::vector<Program>> built;
  std::lock_guard<std::mutex> lock(mutex);
  if (built.size() >= 256 && !built.count({n_micro, n_workers})) built.clear();
  auto& out = built[{n_micro, n_workers}];
  if (!out.empty()) return out;
  const auto placement = detail::v_placement(2 * n_workers);
  double best = 0;
  for (const char* order : {"IFW", "FIW", "IWF"}) {
    for (bool by_units : {false, true}) {
      for (int64_t cap = by_units ? 2 : 1; cap <= (by_units ? 2 : 1) * n_workers; ++cap) {
        // Every such cap keeps 2D activations or fewer per worker.
        double span = 0;
        auto p = detail::greedy_programs(n_micro, placement, {}, {order, cap, by_units}, &span);
        if (out.empty() || span < best) out = std::move(p), best = span;
      }
    }
  }
  return out;
}
}  // namespace schedules
}  // namespace mpipe
