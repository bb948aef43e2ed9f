#pragma once

// Private: DualPipeV's programs (Schedule::DualPipeV; mpipe/schedule.h
// includes this file at its end).

#include <mpipe/schedule.h>

#include <c10/util/Exception.h>

#include <deque>
#include <vector>

namespace mpipe {
namespace detail {

// Note [DualPipeV]
// ~~~~~~~~~~~~~~~~
// DeepSeek's DualPipe (DeepSeek-V3 technical report, 2024; the DualPipe
// repository's "DualPipeV", the V-shaped half of it) runs 2D stages on D
// workers in ZB-V's V: worker r holds chunk 0 = stage r and chunk 1 = stage
// 2D - 1 - r. Its point is the pair: in the steady state a worker runs the
// forward of one chunk together with the backward of its other chunk, so
// that the two overlap (in DeepSeek's use, each one's communication hides
// behind the other's computation). Worker r's order, with m >= 2D:
//   1. 2 (D - r - 1) forwards of chunk 0;
//   2. r + 1 times: a forward of chunk 0, a forward of chunk 1;
//   3. D - r - 1 times: an input gradient (I) of chunk 1, the oldest
//      deferred weight gradient (W), a forward of chunk 1;
//   4. m - 2D + r + 1 times: F(chunk 0) & B(chunk 1), then F(chunk 1) &
//      B(chunk 0) (the last worker runs its very first pair as two single
//      operations: its B(chunk 1) waits for its own forwards);
//   5. D - r - 1 times: B of chunk 1, then F(chunk 1) & B(chunk 0);
//   6. r + 1 times: a backward of chunk 1, a backward of chunk 0, split
//      into I and a deferred W from the middle of this step on (from its
//      chunk 1 backward on odd workers, its chunk 0 backward on even ones);
//   7. D - r - 1 times: a deferred W, an I of chunk 0;
//   8. r + 1 deferred W's.
// Each chunk runs its micro-batches in order, and W's run oldest first. The
// generator below follows these step counts; validate and simulate check the
// result (tests/test_v_schedules.cpp), and with the pair charged F + B the
// run takes 6m + 2 (D - 1) units for F = I = W = 1 (ZB-V: 6m + D - 1), the
// DualPipe README's bubble (PP/2 - 1)(F&B + B - 3W) with F&B = F + B.
//
// The pair is Op::with_next on its first operation. The runtime issues the
// forward's work, then the backward's, and only then hands on what both
// produced (Executor::run_pair): on a GPU the two stages compute on their own
// streams, so their kernels run at once where the device has room, and a
// copy of the forward's output to another rank (which waits for it on the
// host) no longer delays the backward's launch. On a CPU they run one after
// the other. simulate charges a pair F + B, what one worker computing both
// costs, and makes the first one's result available at the pair's end; the
// gain of overlapping shows only in measurements (bench/RESULTS.md). With
// m < 2D the steps above have no steady state, and the programs are ZB-V's.

inline std::vector<schedules::Program> dualpipe_v(int64_t n_micro, int64_t n_workers) {
  check_sizes("dualpipe_v", n_micro, n_workers);
  const int64_t D = n_workers, m = n_micro;
  if (m < 2 * D) return schedules::zero_bubble_v(m, D);
  std::vector<schedules::Program> programs(static_cast<size_t>(D));
  for (int64_t r = 0; r < D; ++r) {
    schedules::Program& p = programs[static_cast<size_t>(r)];
    const int64_t stage[2] = {r, 2 * D - 1 - r};
    int64_t next_f[2] = {0, 0}, next_b[2] = {0, 0};
    std::deque<schedules::Op> deferred;  // W's, oldest first
    auto forward = [&](int c, bool with_next) {
      p.push_back(schedules::F(next_f[c]++, stage[c]));
      p.back().with_next = with_next;
    };
    auto backward = [&](int c, bool split) {
      const int64_t i = next_b[c]++;
      if (!split) return p.push_back(schedules::B(i, stage[c]));
      p.push_back(schedules::I(i, stage[c]));
      deferred.push_back(schedules::W(i, stage[c]));
    };
    auto weight = [&] {
      TORCH_INTERNAL_ASSERT(!deferred.empty());
      p.push_back(deferred.front());
      deferred.pop_front();
    };
    const int64_t rest = D - r - 1;
    for (int64_t k = 0; k < 2 * rest; ++k) forward(0, false);  // 1
    for (int64_t k = 0; k <= r; ++k) forward(0, false), forward(1, false);  // 2
    for (int64_t k = 0; k < rest; ++k) backward(1, true), weight(), forward(1, false);  // 3
    for (int64_t k = 0; k < m - 2 * D + r + 1; ++k) {  // 4
      forward(0, !(k == 0 && rest == 0));
      backward(1, false);
      forward(1, true);
      backward(0, false);
    }
    for (int64_t k = 0; k < rest; ++k) {  // 5
      backward(1, false);
      forward(1, true);
      backward(0, false);
    }
    bool split = false;  // 6
    for (int64_t k = 0; k <= r; ++k) {
      if (k == (r + 1) / 2 && r % 2 == 1) split = true;
      backward(1, split);
      if (k == (r + 1) / 2 && r % 2 == 0) split = true;
      backward(0, split);
    }
    for (int64_t k = 0; k < rest; ++k) weight(), backward(0, true);  // 7
    while (!deferred.empty()) weight();  // 8
  }
  return programs;
}

}  // namespace detail
}  // namespace mpipe
