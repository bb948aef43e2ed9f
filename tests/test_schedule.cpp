#include <gtest/gtest.h>

#include <mpipe/schedule.h>
#include <mpipe/simulate.h>

#include "mpipe/detail/runtime/programs.h"  // the runtime's facts about programs
#include "common.h"                          // max_peak

#include <map>
#include <set>
#include <utility>

namespace sch = mpipe::schedules;

/// (stage, micro-batch) -> start tick of forward_only's programs under
/// simulate with unit costs.
std::map<std::pair<int64_t, int64_t>, double> forward_starts(int64_t m, int64_t n) {
  std::map<std::pair<int64_t, int64_t>, double> starts;
  for (const auto& t : sch::simulate(sch::forward_only(m, n))) {
    EXPECT_EQ(t.op.kind, sch::OpKind::Forward);
    EXPECT_TRUE(starts.emplace(std::make_pair(t.op.stage, t.op.micro_batch), t.start).second);
  }
  return starts;
}

TEST(Schedule, ForwardOnlyIsAWavefrontSmall) {
  // 3 micro-batches through 2 stages, and 2 through 3.
  using Starts = std::map<std::pair<int64_t, int64_t>, double>;
  EXPECT_EQ(forward_starts(3, 2),
            (Starts{{{0, 0}, 0}, {{0, 1}, 1}, {{0, 2}, 2}, {{1, 0}, 1}, {{1, 1}, 2}, {{1, 2}, 3}}));
  EXPECT_EQ(forward_starts(2, 3),
            (Starts{{{0, 0}, 0}, {{0, 1}, 1}, {{1, 0}, 1}, {{1, 1}, 2}, {{2, 0}, 2}, {{2, 1}, 3}}));
  EXPECT_EQ(sch::forward_only(1, 1), (std::vector<sch::Program>{{sch::F(0, 0)}}));
}

TEST(Schedule, ForwardOnlyInvariants) {
  for (int64_t m = 1; m <= 7; ++m) {
    for (int64_t n = 1; n <= 6; ++n) {
      const auto programs = sch::forward_only(m, n);
      ASSERT_EQ(static_cast<int64_t>(programs.size()), n);
      for (int64_t s = 0; s < n; ++s) {  // each stage's items in order, once
        ASSERT_EQ(static_cast<int64_t>(programs[static_cast<size_t>(s)].size()), m);
        for (int64_t i = 0; i < m; ++i) {
          EXPECT_EQ(programs[static_cast<size_t>(s)][static_cast<size_t>(i)], sch::F(i, s));
        }
      }
      EXPECT_NO_THROW(sch::validate(programs, n, m, /*backward=*/false));
      const auto starts = forward_starts(m, n);
      ASSERT_EQ(static_cast<int64_t>(starts.size()), m * n);
      for (const auto& e : starts) {  // the wavefront: tick i + s
        EXPECT_EQ(e.second, static_cast<double>(e.first.first + e.first.second)) << m << "x" << n;
      }
      EXPECT_EQ(sch::makespan(programs), static_cast<double>(m + n - 1));
    }
  }
}

TEST(Schedule, ForwardOnlyRefusesEmptySizes) {
  EXPECT_THROW(sch::forward_only(0, 4), c10::Error);
  EXPECT_THROW(sch::forward_only(4, 0), c10::Error);
  EXPECT_THROW(sch::forward_only(-1, 2), c10::Error);
}

// The fill-drain bubble of forward programs, which timelines report.
TEST(Schedule, BubbleFraction) {
  EXPECT_DOUBLE_EQ(sch::bubble(sch::forward_only(8, 4)), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(sch::bubble(sch::forward_only(1, 1)), 0.0);
}

// ---------------------------------------------------------------------------
// Training schedules, as pure functions: exact programs for small sizes, the
// simulated clock, invariants over a grid, and bad programs.

#include <mpipe/training.h>

namespace sch = mpipe::schedules;
using sch::B;
using sch::F;
using sch::I;
using sch::W;

namespace {

std::string describe(const std::vector<sch::Program>& programs) {
  std::string s;
  for (size_t r = 0; r < programs.size(); ++r) {
    s += "rank " + std::to_string(r) + ":";
    for (const auto& op : programs[r]) s += " " + c10::str(op);
    s += "\n";
  }
  return s;
}

}  // namespace

TEST(TrainingSchedule, ProgramsAreExactForSmallSizes) {
  EXPECT_EQ(sch::gpipe(3, 2),
            (std::vector<sch::Program>{{F(0, 0), F(1, 0), F(2, 0), B(0, 0), B(1, 0), B(2, 0)},
                                       {F(0, 1), F(1, 1), F(2, 1), B(0, 1), B(1, 1), B(2, 1)}}));
  EXPECT_EQ(sch::one_f_one_b(4, 2),
            (std::vector<sch::Program>{
                {F(0, 0), F(1, 0), B(0, 0), F(2, 0), B(1, 0), F(3, 0), B(2, 0), B(3, 0)},
                {F(0, 1), B(0, 1), F(1, 1), B(1, 1), F(2, 1), B(2, 1), F(3, 1), B(3, 1)}}));
  EXPECT_EQ(sch::one_f_one_b(2, 4)[0], (sch::Program{F(0, 0), F(1, 0), B(0, 0), B(1, 0)}));
  EXPECT_EQ(sch::forward_only(2, 2),
            (std::vector<sch::Program>{{F(0, 0), F(1, 0)}, {F(0, 1), F(1, 1)}}));
  // constant_train_step's: backwards from the last time chunk down.
  EXPECT_EQ(mpipe::detail::chained(3, 2),
            (std::vector<sch::Program>{{F(0, 0), F(1, 0), F(2, 0), B(2, 0), B(1, 0), B(0, 0)},
                                       {F(0, 1), F(1, 1), F(2, 1), B(2, 1), B(1, 1), B(0, 1)}}));
  EXPECT_NO_THROW(sch::validate(mpipe::detail::chained(5, 3), 3, 5));
  EXPECT_THROW(mpipe::detail::chained(0, 2), c10::ValueError);
}

TEST(TrainingSchedule, InterleavedProgramsFollowMegatronsRule) {
  // 4 stages on 2 ranks (stages 0, 2 on rank 0; 1, 3 on rank 1), 4
  // micro-batches in groups of 2. Rank r warms up with 2 (d - r - 1) +
  // (v - 1) d forwards, then alternates; backwards run the chunks in reverse.
  const auto p = sch::interleaved_one_f_one_b(4, 4, 2);
  const std::vector<sch::Program> expected = {
      {F(0, 0), F(1, 0), F(0, 2), F(1, 2),                    // warm-up: 4
       F(2, 0), B(0, 2), F(3, 0), B(1, 2), F(2, 2), B(0, 0), F(3, 2), B(1, 0),
       B(2, 2), B(3, 2), B(2, 0), B(3, 0)},
      {F(0, 1), F(1, 1),                                      // warm-up: 2
       F(0, 3), B(0, 3), F(1, 3), B(1, 3), F(2, 1), B(0, 1), F(3, 1), B(1, 1),
       F(2, 3), B(2, 3), F(3, 3), B(3, 3), B(2, 1), B(3, 1)}};
  EXPECT_EQ(p, expected) << describe(p);
  EXPECT_EQ(mpipe::schedules::stage_workers(p), (std::vector<int64_t>{0, 1, 0, 1}));
  // One chunk per rank is 1F1B.
  EXPECT_EQ(sch::interleaved_one_f_one_b(5, 3, 1), sch::one_f_one_b(5, 3));
  // 3 micro-batches: built for 4, micro-batch 3's operations dropped.
  auto padded = sch::interleaved_one_f_one_b(4, 4, 2);
  for (auto& prog : padded) {
    prog.erase(std::remove_if(prog.begin(), prog.end(),
                              [](const sch::Op& op) { return op.micro_batch == 3; }),
               prog.end());
  }
  EXPECT_EQ(sch::interleaved_one_f_one_b(3, 4, 2), padded);
}

TEST(TrainingSchedule, ZeroBubbleH1ProgramsDeferWeightGradients) {
  // Stage s runs min(n - s, m) forwards, then I(k), W(k - s), the next F.
  const auto p = sch::zero_bubble_h1(3, 2);
  const std::vector<sch::Program> expected = {
      {F(0, 0), F(1, 0), I(0, 0), W(0, 0), F(2, 0), I(1, 0), W(1, 0), I(2, 0), W(2, 0)},
      {F(0, 1), I(0, 1), F(1, 1), I(1, 1), W(0, 1), F(2, 1), I(2, 1), W(1, 1), W(2, 1)}};
  EXPECT_EQ(p, expected) << describe(p);
}

TEST(TrainingSchedule, SimulateRunsEachOperationAsEarlyAsItsInputsAllow) {
  // 1F1B, 3 micro-batches, 2 stages; F = 1, B = I + W = 2.
  using T = sch::TimedOp;
  const std::vector<T> expected = {
      T{0, F(0, 0), 0, 1},  T{0, F(1, 0), 1, 2},  T{1, F(0, 1), 1, 2},  T{1, B(0, 1), 2, 4},
      T{0, B(0, 0), 4, 6},  T{1, F(1, 1), 4, 5},  T{1, B(1, 1), 5, 7},  T{0, F(2, 0), 6, 7},
      T{0, B(1, 0), 7, 9},  T{1, F(2, 1), 7, 8},  T{1, B(2, 1), 8, 10}, T{0, B(2, 0), 10, 12},
  };
  EXPECT_EQ(sch::simulate(sch::one_f_one_b(3, 2)), expected);
  EXPECT_DOUBLE_EQ(sch::makespan(sch::one_f_one_b(3, 2)), 12);
  // Per-stage costs and transfers: F(0, 1) waits for F(0, 0) plus the hand-off.
  const sch::Costs costs = {{2, 1, 1, 0.5}, {1, 3, 1, 0}};
  const auto t = sch::simulate(sch::gpipe(1, 2), costs);
  EXPECT_EQ(t, (std::vector<T>{T{0, F(0, 0), 0, 2}, T{1, F(0, 1), 2.5, 3.5},
                               T{1, B(0, 1), 3.5, 7.5}, T{0, B(0, 0), 8, 10}}));
  // Split backward: W waits for I only.
  EXPECT_EQ(sch::simulate({{F(0, 0), I(0, 0), W(0, 0)}}),
            (std::vector<T>{T{0, F(0, 0), 0, 1}, T{0, I(0, 0), 1, 2}, T{0, W(0, 0), 2, 3}}));
}

TEST(TrainingSchedule, InvariantsOverAGrid) {
  for (int64_t m = 1; m <= 9; ++m) {
    for (int64_t n = 1; n <= 5; ++n) {
      SCOPED_TRACE(std::to_string(m) + " micro-batches, " + std::to_string(n) + " stages");
      const auto gp = sch::gpipe(m, n), ofob = sch::one_f_one_b(m, n), zb = sch::zero_bubble_h1(m, n);
      for (const auto* p : {&gp, &ofob, &zb}) EXPECT_NO_THROW(sch::validate(*p, n, m));
      // GPipe and 1F1B: 3 (m + n - 1) time units, bubble (n - 1) / (m + n - 1).
      EXPECT_DOUBLE_EQ(sch::makespan(gp), 3.0 * static_cast<double>(m + n - 1));
      EXPECT_DOUBLE_EQ(sch::makespan(ofob), 3.0 * static_cast<double>(m + n - 1));
      EXPECT_NEAR(sch::bubble(ofob), static_cast<double>(n - 1) / static_cast<double>(m + n - 1),
                  1e-12);
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_EQ(mpipe::detail::peak_in_flight(gp[j]), m);
        EXPECT_EQ(mpipe::detail::peak_in_flight(ofob[j]), std::min(n - j, m));
        EXPECT_LE(mpipe::detail::peak_in_flight(zb[j]), std::min(n, m));
      }
      // ZB-H1: 1F1B's peak; with m >= n, 3m + n - 1 units: the bubble time
      // per rank is n - 1, a third of 1F1B's 3 (n - 1).
      EXPECT_EQ(mpipe_test::max_peak(zb), mpipe_test::max_peak(ofob));
      if (m >= n) EXPECT_DOUBLE_EQ(sch::makespan(zb), 3.0 * static_cast<double>(m) + n - 1);
      EXPECT_LE(sch::makespan(zb), sch::makespan(ofob));
      // Interleaved: v chunks per rank. With m a multiple of d, 3 v m + 3 (d - 1)
      // units of a chunk: the bubble (d - 1) / (v m + d - 1), about v times
      // smaller than 1F1B's (d - 1) / (m + d - 1) over the same d ranks.
      for (int64_t v = 1; v <= 3; ++v) {
        const int64_t d = n;  // ranks
        const auto il = sch::interleaved_one_f_one_b(m, d * v, v);
        EXPECT_NO_THROW(sch::validate(il, d * v, m));
        EXPECT_EQ(static_cast<int64_t>(il.size()), d);
        EXPECT_EQ(static_cast<int64_t>(sch::simulate(il).size()), 2 * m * d * v);
        if (m % d == 0) {
          EXPECT_DOUBLE_EQ(sch::makespan(il), 3.0 * static_cast<double>(v * m + d - 1));
          EXPECT_NEAR(sch::bubble(il),
                      static_cast<double>(d - 1) / static_cast<double>(v * m + d - 1), 1e-12);
        }
      }
    }
  }
}

TEST(TrainingSchedule, BadProgramsAreRejected) {
  EXPECT_THROW(sch::gpipe(0, 2), c10::Error);
  EXPECT_THROW(sch::one_f_one_b(2, 0), c10::Error);
  EXPECT_THROW(sch::zero_bubble_h1(0, 1), c10::Error);
  EXPECT_THROW(sch::interleaved_one_f_one_b(4, 3, 2), c10::Error);  // 2 does not divide 3
  EXPECT_THROW(sch::interleaved_one_f_one_b(4, 4, 0), c10::Error);
  auto rejects = [](const std::vector<sch::Program>& p, int64_t n, int64_t m,
                    const std::string& why) {
    try {
      sch::validate(p, n, m);
      ADD_FAILURE() << "accepted: " << describe(p);
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  rejects({{F(0, 0), B(0, 0), B(0, 0)}}, 1, 1, "B(0, 0) on rank 0: repeated");
  rejects({{B(0, 0), F(0, 0)}}, 1, 1, "before the forward");
  rejects({{F(0, 0)}}, 1, 1, "stage 0 misses the backward of micro-batch 0");
  rejects({{F(0, 0), I(0, 0)}}, 1, 1, "misses the weight gradient");
  rejects({{F(0, 0), W(0, 0), I(0, 0)}}, 1, 1, "weight gradient before the input gradient");
  rejects({{F(0, 0), I(0, 0), B(0, 0), W(0, 0)}}, 1, 1, "both a full and a split backward");
  rejects({{F(0, 0), B(0, 0)}, {F(0, 1)}, {B(0, 1)}}, 2, 1, "also runs on rank 1");
  rejects({{F(0, 0), B(0, 0), F(0, 1), B(0, 1)}}, 1, 1, "out of range");
  rejects({{F(0, 0)}, {B(0, 0)}}, 1, 1, "also runs on rank 0");
  // A cycle: stage 1 wants F(1) before F(0); stage 0 runs B(0) before F(1).
  const std::vector<sch::Program> cycle = {{F(0, 0), B(0, 0), F(1, 0), B(1, 0)},
                                           {F(1, 1), B(1, 1), F(0, 1), B(0, 1)}};
  EXPECT_NO_THROW(sch::validate(cycle, 2, 2));
  EXPECT_THROW(sch::simulate(cycle), c10::Error);
  EXPECT_THROW(sch::simulate(sch::gpipe(2, 2), {{1, -1, 1, 0}}), c10::Error);
  EXPECT_THROW(sch::simulate(sch::gpipe(2, 3), {{}, {}}), c10::Error);  // 2 costs, 3 stages
}

TEST(ScheduleChoice, PicksTheFastestThatFits) {
  using mpipe::Schedule;
  using mpipe::TrainStepOptions;
  // Equal stages, no memory limit: ZB-H1 has the least bubble of the three.
  auto c = mpipe::choose_schedule(8, 4, TrainStepOptions(1));
  EXPECT_EQ(c.schedule, Schedule::ZeroBubbleH1);
  ASSERT_EQ(c.candidates.size(), 4u);  // and Tailored, which finds nothing faster
  EXPECT_EQ(c.candidates[3].schedule, Schedule::Tailored);
  EXPECT_DOUBLE_EQ(c.candidates[3].time, 27);
  EXPECT_DOUBLE_EQ(c.candidates[0].time, 33);  // GPipe: 3 (8 + 4 - 1)
  EXPECT_DOUBLE_EQ(c.candidates[1].time, 33);  // 1F1B
  EXPECT_DOUBLE_EQ(c.candidates[2].time, 27);  // ZB-H1: 3 * 8 + 4 - 1
  // Memory: one unit per micro-batch and stage; a limit of 4 leaves out
  // GPipe (8 in flight) but not 1F1B or ZB-H1 (4).
  c = mpipe::choose_schedule(
      8, 4, TrainStepOptions(1).activation_bytes({1, 1, 1, 1}).memory_limit(4));
  EXPECT_FALSE(c.candidates[0].fits);
  EXPECT_DOUBLE_EQ(c.candidates[0].peak_memory, 8);
  EXPECT_TRUE(c.candidates[1].fits);
  EXPECT_EQ(c.schedule, Schedule::ZeroBubbleH1);
  // With a tight limit no built-in fits; Tailored admits fewer micro-batches
  // and does. A limit below one activation per stage: the least peak wins
  // (1F1B, before ZB-H1).
  c = mpipe::choose_schedule(8, 4,
                             TrainStepOptions(1).activation_bytes({1, 1, 1, 1}).memory_limit(2));
  for (size_t k = 0; k < 3; ++k) EXPECT_FALSE(c.candidates[k].fits);
  EXPECT_EQ(c.schedule, Schedule::Tailored);
  EXPECT_LE(c.candidates.back().peak_memory, 2);
  EXPECT_LT(c.candidates.back().time, 8 * 4 * 3);  // still pipelined
  c = mpipe::choose_schedule(8, 4,
                             TrainStepOptions(1).activation_bytes({2, 2, 2, 2}).memory_limit(1));
  EXPECT_EQ(c.schedule, Schedule::OneFOneB);
  // 4 stages on 2 devices (stage s on device s % 2), 2 chunks per worker.
  // Workers that share a device take turns on it, so GPipe's 4 workers fill
  // each other's bubbles as well as interleaving does (51 = 3 (2 * 8 + 2 - 1)
  // units), but hold 16 micro-batches per device to interleaving's 5: the tie
  // goes to the fewer activations. Tailored's list scheduling finds a shorter
  // run (49) holding 4. A limit of 6 bytes (one per activation) leaves 1F1B
  // (4 + 2), Interleaved1F1B (5) and Tailored.
  const std::vector<int64_t> devices = {0, 1, 0, 1};
  c = mpipe::choose_schedule(8, 4, TrainStepOptions(1).virtual_stages(2), devices);
  ASSERT_EQ(c.candidates.size(), 5u);  // and Tailored
  EXPECT_EQ(c.candidates[3].schedule, Schedule::Interleaved1F1B);
  EXPECT_DOUBLE_EQ(c.candidates[3].time, 3.0 * (2 * 8 + 2 - 1));
  EXPECT_DOUBLE_EQ(c.candidates[0].time, 3.0 * (2 * 8 + 2 - 1));
  EXPECT_DOUBLE_EQ(c.candidates[0].peak_in_flight, 16);
  EXPECT_DOUBLE_EQ(c.candidates[3].peak_in_flight, 5);
  EXPECT_DOUBLE_EQ(c.candidates[4].time, 49);
  EXPECT_DOUBLE_EQ(c.candidates[4].peak_in_flight, 4);
  EXPECT_EQ(c.schedule, Schedule::Tailored);
  // On one device every schedule takes the sum of its operations; the fewest
  // activations in flight win (ZB-V's 2 workers hold 4 each; 1F1B holds
  // 4 + 3 + 2 + 1).
  c = mpipe::choose_schedule(8, 4, TrainStepOptions(1), {0, 0, 0, 0});
  for (const auto& p : c.candidates) EXPECT_DOUBLE_EQ(p.time, 8 * 4 * 3);
  EXPECT_DOUBLE_EQ(c.candidates[1].peak_in_flight, 10);
  EXPECT_EQ(c.candidates[3].schedule, Schedule::ZeroBubbleV);
  EXPECT_DOUBLE_EQ(c.candidates[3].peak_in_flight, 8);
  EXPECT_EQ(c.schedule, Schedule::ZeroBubbleV);
  c = mpipe::choose_schedule(
      8, 4, TrainStepOptions(1).virtual_stages(2).activation_bytes({1, 1, 1, 1}).memory_limit(6),
      devices);
  EXPECT_DOUBLE_EQ(c.candidates[0].peak_memory, 16);
  EXPECT_DOUBLE_EQ(c.candidates[1].peak_memory, 6);
  EXPECT_DOUBLE_EQ(c.candidates[2].peak_memory, 8);
  EXPECT_DOUBLE_EQ(c.candidates[3].peak_memory, 5);
  EXPECT_DOUBLE_EQ(c.candidates[1].time, 52);
  EXPECT_DOUBLE_EQ(c.candidates[4].peak_memory, 4);
  EXPECT_EQ(c.schedule, Schedule::Tailored);
  // Costly hand-offs (3 units each): interleaving crosses devices twice as
  // often and loses to 1F1B (87 to 86 units); Tailored takes 74.
  c = mpipe::choose_schedule(
      8, 4,
      TrainStepOptions(1).virtual_stages(2).stage_costs({{1, 1, 1, 3}}).activation_bytes(
          {1, 1, 1, 1}).memory_limit(6),
      devices);
  EXPECT_DOUBLE_EQ(c.candidates[1].time, 86);
  EXPECT_DOUBLE_EQ(c.candidates[3].time, 87);
  EXPECT_DOUBLE_EQ(c.candidates[4].time, 74);
  EXPECT_LE(c.candidates[4].peak_memory, 6);
  EXPECT_EQ(c.schedule, Schedule::Tailored);
  EXPECT_THROW(mpipe::choose_schedule(8, 4, TrainStepOptions(1).activation_bytes({1})),
               c10::Error);
}

// The one-device cases of Note [Choosing a schedule], with its numbers.
TEST(ScheduleChoice, OnOneDeviceMemoryDecidesUntilHandOffsCost) {
  using mpipe::Schedule;
  using mpipe::TrainStepOptions;
  const std::vector<int64_t> one = {0, 0, 0, 0};
  // virtual_stages 1: all take the sum (8 micro-batches x 4 stages x 3 units),
  // ZB-V holds the fewest (8, to 1F1B's 10); with one micro-batch all hold
  // the same: GPipe.
  auto c = mpipe::choose_schedule(8, 4, TrainStepOptions(1), one);
  EXPECT_EQ(c.schedule, Schedule::ZeroBubbleV);
  c = mpipe::choose_schedule(1, 4, TrainStepOptions(1), one);
  for (const auto& p : c.candidates) EXPECT_DOUBLE_EQ(p.peak_in_flight, 4);
  EXPECT_EQ(c.schedule, Schedule::GPipe);
  // virtual_stages 2: interleaving is counted as holding fewer, 8 to 10.
  c = mpipe::choose_schedule(8, 4, TrainStepOptions(1).virtual_stages(2), one);
  // and ZB-V (8 too, later in the list), DualPipeV (its two workers' 2D + 1
  // = 5 each, on the one device), Tailored
  ASSERT_EQ(c.candidates.size(), 7u);
  EXPECT_EQ(c.candidates[5].schedule, Schedule::DualPipeV);
  EXPECT_DOUBLE_EQ(c.candidates[5].peak_in_flight, 10);
  for (const auto& p : c.candidates) EXPECT_DOUBLE_EQ(p.time, 8 * 4 * 3);
  EXPECT_DOUBLE_EQ(c.candidates[1].peak_in_flight, 10);
  EXPECT_DOUBLE_EQ(c.candidates[3].peak_in_flight, 8);
  EXPECT_EQ(c.schedule, Schedule::Interleaved1F1B);
  // ... but not with few micro-batches: 8 stages, 2 chunks per worker, 2 to 4
  // micro-batches pick 1F1B, 5 ZB-V (25 to 30).
  const std::vector<int64_t> one8(8, 0);
  EXPECT_EQ(mpipe::choose_schedule(5, 8, TrainStepOptions(1).virtual_stages(2), one8).schedule,
            Schedule::ZeroBubbleV);
  for (int64_t m = 2; m <= 4; ++m) {
    EXPECT_EQ(mpipe::choose_schedule(m, 8, TrainStepOptions(1).virtual_stages(2), one8).schedule,
              Schedule::OneFOneB)
        << m << " micro-batches";
  }
  EXPECT_EQ(mpipe::choose_schedule(6, 8, TrainStepOptions(1).virtual_stages(2), one8).schedule,
            Schedule::Interleaved1F1B);
  // A hand-off cost makes the device wait, and the times differ. ZB-V's
  // middle hand-off stays on its worker and costs nothing: as fast as GPipe
  // and ZB-H1, holding fewer. With hand-offs of 3, Tailored beats GPipe
  // within 1F1B's memory.
  c = mpipe::choose_schedule(8, 4, TrainStepOptions(1).stage_costs({{1, 1, 1, 1}}), one);
  EXPECT_DOUBLE_EQ(c.candidates[0].time, 96);
  EXPECT_DOUBLE_EQ(c.candidates[1].time, 98);
  EXPECT_DOUBLE_EQ(c.candidates[2].time, 96);
  EXPECT_DOUBLE_EQ(c.candidates[3].time, 96);
  EXPECT_EQ(c.schedule, Schedule::ZeroBubbleV);
  c = mpipe::choose_schedule(8, 4, TrainStepOptions(1).stage_costs({{1, 1, 1, 3}}), one);
  EXPECT_DOUBLE_EQ(c.candidates[0].time, 99);
  EXPECT_DOUBLE_EQ(c.candidates[1].time, 102);
  ASSERT_EQ(c.candidates.back().schedule, Schedule::Tailored);
  EXPECT_DOUBLE_EQ(c.candidates.back().time, 98);
  EXPECT_LE(c.candidates.back().peak_in_flight, c.candidates[1].peak_in_flight);
  EXPECT_EQ(c.schedule, Schedule::Tailored);
}
