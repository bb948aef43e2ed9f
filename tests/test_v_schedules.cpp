// Schedules built by list scheduling: ZB-V as a pure function (its
// placement, makespan and peak memory against the paper's), Tailored against
// the built-ins over random costs, and the runtime running them (and
// DualPipeV, on the same V) equal to the plain model, threaded and inline,
// with checkpointing.

#include "common.h"

#include <mpipe/mpipe.h>

#include <cmath>
#include <limits>
#include <random>

using namespace mpipe_test;
using mpipe::Checkpoint;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Schedule;
using mpipe::TrainStepOptions;
namespace sch = mpipe::schedules;


TEST(ZeroBubbleV, PlacesStagesInAV) {
  EXPECT_EQ(sch::stage_workers(sch::zero_bubble_v(1, 3)), (std::vector<int64_t>{0, 1, 2, 2, 1, 0}));
  EXPECT_EQ(sch::stage_workers(sch::zero_bubble_v(4, 1)), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(sch::stage_workers(mpipe::programs_for(Schedule::ZeroBubbleV, 2, 8)),
            (std::vector<int64_t>{0, 1, 2, 3, 3, 2, 1, 0}));
  EXPECT_STREQ(mpipe::to_string(Schedule::ZeroBubbleV), "ZB-V");
  MPIPE_EXPECT_ERROR(mpipe::programs_for(Schedule::ZeroBubbleV, 2, 5), "ZB-V", "even", "5");
  EXPECT_THROW(sch::zero_bubble_v(0, 2), c10::Error);
  EXPECT_THROW(sch::zero_bubble_v(2, 0), c10::Error);
}

// Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", section 6): ZB-V keeps
// 1F1B's peak activation memory and, with F = B = W, leaves no bubble but
// the last worker's start. Here in units of a half-size stage: D workers, 2D
// stages, each micro-batch 6 units of work per worker.
TEST(ZeroBubbleV, MakespanAndPeakMemoryFollowThePaper) {
  for (int64_t d = 1; d <= 6; ++d) {
    for (int64_t m = 1; m <= 3 * d + 1; ++m) {
      SCOPED_TRACE(std::to_string(d) + " workers, " + std::to_string(m) + " micro-batches");
      const auto p = sch::zero_bubble_v(m, d);
      ASSERT_EQ(static_cast<int64_t>(p.size()), d);
      EXPECT_NO_THROW(sch::validate(p, 2 * d, m));
      const double span = sch::makespan(p);
      // The least possible: worker D-1 waits D-1 units for its first input,
      // then has 6m units of work; one micro-batch is a chain of 4D + 1.
      EXPECT_GE(span, std::max(6.0 * m + d - 1, 4.0 * d + 1));
      if (m % d == 0) EXPECT_DOUBLE_EQ(span, 6.0 * m + d - 1);
      // 1F1B's peak over D stages of twice the size: D full stages' worth.
      EXPECT_LE(max_peak(p), 2.0 * d);
      if (m < d) continue;
      // Never slower than ZB-H1 on the same D workers with whole stages
      // (F, I and W each 2 units), and faster than 1F1B there.
      const sch::Costs whole = {sch::StageCost{2, 2, 2, 0}};
      EXPECT_LE(span, sch::makespan(sch::zero_bubble_h1(m, d), whole));
      if (d > 1) EXPECT_LT(span, sch::makespan(sch::one_f_one_b(m, d), whole));
    }
  }
}

TEST(ZeroBubbleV, AHandOffBetweenTwoStagesOfOneWorkerCostsNothing) {
  // 2 workers: stages 1 and 2 share worker 1, so only 0-1 and 2-3 pay.
  const sch::Costs costs = {sch::StageCost{1, 1, 1, 5}};
  const auto p = sch::zero_bubble_v(1, 2);
  double f2_start = -1, f1_end = -1;
  for (const auto& t : sch::simulate(p, costs)) {
    if (t.op == sch::F(0, 1)) f1_end = t.end;
    if (t.op == sch::F(0, 2)) f2_start = t.start;
  }
  EXPECT_DOUBLE_EQ(f1_end, 7);  // 1 + 5 + 1
  EXPECT_DOUBLE_EQ(f2_start, f1_end);
}

namespace {

struct VCase {
  Schedule schedule;  // ZeroBubbleV or DualPipeV (VStep), Tailored (TailoredStep)
  Checkpoint checkpoint;
  bool threads;
};

class VStep : public ::testing::TestWithParam<VCase> {};

}  // namespace

// ZB-V and DualPipeV: loss, the input's gradient and every parameter's
// gradient equal the plain model's exactly, and GPipe's bit for bit: 1 to 4
// workers, 1 to 3D micro-batches (and uneven ones). The timeline names the
// schedule, places the stages in the V and marks DualPipeV's pairs.
TEST_P(VStep, EqualsThePlainModel) {
  torch::manual_seed(21);
  const int64_t width = 4;
  const Schedule schedule = GetParam().schedule;
  for (int64_t d = 1; d <= 4; ++d) {
    auto pipe = ModelPipeline(ModelPipelineOptions()
                                  .worker_threads(GetParam().threads)
                                  .checkpoint(GetParam().checkpoint)
                                  .record_timeline(true));
    std::vector<torch::nn::Sequential> stages;
    for (int64_t s = 0; s < 2 * d; ++s) {
      stages.push_back(mlp_stage(width, width));
      stages.back()->to(torch::kDouble);
      pipe->append(stages.back(), "cpu");
    }
    const std::vector<torch::Device> devices(stages.size(), torch::kCPU);
    const auto step = TrainStepOptions(2).schedule(schedule);
    for (int64_t m = 1; m <= 3 * d; ++m) {
      for (int64_t extra : {0, 1}) {  // m micro-batches of 2 rows, or the last one short
        const int64_t batch = 2 * m - extra;
        SCOPED_TRACE(std::to_string(d) + " workers, " + std::to_string(m) + " micro-batches, batch " +
                     std::to_string(batch));
        const auto x = torch::randn({batch, width}, torch::kDouble);
        const auto y = torch::randn({batch, width}, torch::kDouble);
        expect_train_step_transparent(pipe, stages, devices, x, y, mse, step);
        expect_gpipes_step(pipe, x, y, step);
        const auto t = pipe->timeline();  // the last step's
        EXPECT_EQ(t.schedule, mpipe::to_string(schedule));
        EXPECT_EQ(t.stage_ranks, sch::stage_workers(sch::zero_bubble_v(1, d)));
        int64_t paired = 0, pairs = 0;
        for (const auto& task : t.tasks) paired += task.paired;
        for (const auto& p : mpipe::programs_for(schedule, m, 2 * d)) {
          for (const auto& op : p) pairs += op.with_next;
        }
        EXPECT_EQ(paired, 2 * pairs);
        if (schedule == Schedule::DualPipeV && m >= 2 * d) EXPECT_GT(pairs, 0);
        if (pairs > 0 && GetParam().threads) {
          EXPECT_NE(t.to_svg().find("(paired)"), std::string::npos);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, VStep,
    ::testing::Values(VCase{Schedule::ZeroBubbleV, Checkpoint::Never, true},
                      VCase{Schedule::ZeroBubbleV, Checkpoint::Never, false},
                      VCase{Schedule::ZeroBubbleV, Checkpoint::ExceptLast, true},
                      VCase{Schedule::ZeroBubbleV, Checkpoint::Always, false},
                      VCase{Schedule::DualPipeV, Checkpoint::Never, true},
                      VCase{Schedule::DualPipeV, Checkpoint::Never, false},
                      VCase{Schedule::DualPipeV, Checkpoint::ExceptLast, true},
                      VCase{Schedule::DualPipeV, Checkpoint::Always, false}),
    [](const ::testing::TestParamInfo<VCase>& info) {
      const auto& c = info.param;
      return schedule_name(c.schedule) + "_" +
             (c.checkpoint == Checkpoint::Never        ? "NoCheckpoint"
              : c.checkpoint == Checkpoint::ExceptLast ? "CheckpointExceptLast"
                                                       : "CheckpointAlways") +
             (c.threads ? "_Threads" : "_Inline");
    });

TEST(ZeroBubbleVErrors, AnOddStageCountIsRefusedAndThePipelineStaysUsable) {
  auto pipe = ModelPipeline();
  pipe->append(mlp_stage(3, 3), "cpu").append(mlp_stage(3, 3), "cpu").append(mlp_stage(3, 3), "cpu");
  const auto x = torch::randn({4, 3}), y = torch::randn({4, 3});
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, TrainStepOptions(2).schedule(Schedule::ZeroBubbleV)),
                     "ZB-V", "even number of stages", "3");
  EXPECT_TRUE(pipe->train_step(x, y, mse, TrainStepOptions(2)).defined());
}

// Schedule::Tailored (Note [Choosing a schedule]): over random cost tables,
// placements and memory limits, never predicted slower than the best
// built-in within its bound, its programs valid and timed as reported.
TEST(Tailored, NeverPredictedSlowerThanTheBestBuiltIn) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> cost(0.5, 3.0), hand_off(0.0, 2.0);
  int faster = 0, cases = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const int64_t n = std::vector<int64_t>{2, 3, 4, 6}[static_cast<size_t>(trial % 4)];
    const int64_t m = 1 + static_cast<int64_t>(rng() % 10);
    sch::Costs costs;
    for (int64_t s = 0; s < n; ++s) costs.push_back({cost(rng), cost(rng), cost(rng), hand_off(rng)});
    std::vector<int64_t> devices;  // each its own, all on one, or a V of pairs
    for (int64_t s = 0; s < n; ++s) {
      devices.push_back(trial % 3 == 0 ? s : trial % 3 == 1 ? 0 : std::min(s, n - 1 - s));
    }
    auto options = TrainStepOptions(1).schedule(Schedule::Tailored).stage_costs(costs);
    std::vector<double> bytes;
    for (int64_t s = 0; s < n; ++s) bytes.push_back(1.0 + static_cast<double>(rng() % 3));
    if (trial % 2) options.activation_bytes(bytes).memory_limit(static_cast<double>(2 + rng() % 12));
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + std::to_string(n) + " stages, " +
                 std::to_string(m) + " micro-batches");
    const auto c = mpipe::choose_schedule(m, n, options, devices);
    ASSERT_EQ(c.schedule, Schedule::Tailored);
    const auto& built = c.candidates.back();
    ASSERT_EQ(built.schedule, Schedule::Tailored);
    EXPECT_NO_THROW(sch::validate(c.programs, n, m));
    const auto& one_f_one_b = c.candidates[1];
    double best = std::numeric_limits<double>::infinity();
    for (size_t k = 0; k + 1 < c.candidates.size(); ++k) {
      const auto& b = c.candidates[k];
      const bool within = trial % 2 ? b.fits
                                    : b.peak_memory <= one_f_one_b.peak_memory &&
                                          b.peak_in_flight <= one_f_one_b.peak_in_flight;
      if (within) best = std::min(best, b.time);
    }
    if (std::isinf(best)) continue;  // no built-in within the bound
    ++cases;
    EXPECT_LE(built.time, best * (1 + 1e-12));
    if (trial % 2) EXPECT_TRUE(built.fits);
    faster += built.time < best * (1 - 1e-9);
    // Its programs, run by simulate on the same devices, take the time reported.
    std::vector<int64_t> worker_devices;
    for (const auto& p : c.programs) worker_devices.push_back(devices[static_cast<size_t>(p.front().stage)]);
    EXPECT_DOUBLE_EQ(sch::makespan(c.programs, costs, worker_devices), built.time);
  }
  EXPECT_GT(cases, 60);
  EXPECT_GT(faster, cases / 4) << "Tailored was faster in " << faster << " of " << cases;
  MPIPE_EXPECT_ERROR(mpipe::programs_for(Schedule::Tailored, 2, 2), "Tailored", "choose_schedule");
}

namespace {

class TailoredStep : public ::testing::TestWithParam<VCase> {};

}  // namespace

// Tailored (and Auto picking it) runs its programs: bit for bit GPipe's step,
// and the timeline names it.
TEST_P(TailoredStep, EqualsThePlainModel) {
  torch::manual_seed(22);
  const int64_t width = 4, n = 4;
  auto pipe = ModelPipeline(ModelPipelineOptions()
                                .worker_threads(GetParam().threads)
                                .checkpoint(GetParam().checkpoint)
                                .record_timeline(true));
  std::vector<torch::nn::Sequential> stages;
  for (int64_t s = 0; s < n; ++s) {
    stages.push_back(mlp_stage(width, width));
    stages.back()->to(torch::kDouble);
    pipe->append(stages.back(), "cpu");
  }
  const std::vector<torch::Device> devices(stages.size(), torch::kCPU);
  // Uneven stages and costly hand-offs: list scheduling beats the built-ins.
  const sch::Costs costs = {{1, 2, 1, 3}, {3, 1, 2, 3}, {1, 1, 1, 3}, {2, 3, 1, 3}};
  for (Schedule schedule : {Schedule::Tailored, Schedule::Auto}) {
    for (int64_t m : {1, 3, 8}) {
      SCOPED_TRACE(std::string(mpipe::to_string(schedule)) + ", " + std::to_string(m) +
                   " micro-batches");
      const auto x = torch::randn({2 * m, width}, torch::kDouble);
      const auto y = torch::randn({2 * m, width}, torch::kDouble);
      // 6 activations at most on the one device: no built-in fits with 8.
      const auto options = TrainStepOptions(2).schedule(schedule).stage_costs(costs)
                               .activation_bytes({1, 1, 1, 1}).memory_limit(6);
      expect_train_step_transparent(pipe, stages, devices, x, y, mse, options);
      expect_gpipes_step(pipe, x, y, options);
      const auto choice = mpipe::choose_schedule(m, n, options, {0, 0, 0, 0});
      EXPECT_EQ(pipe->timeline().schedule, mpipe::to_string(choice.schedule));
      if (m == 8) EXPECT_EQ(choice.schedule, Schedule::Tailored);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, TailoredStep,
                         ::testing::Values(VCase{Schedule::Tailored, Checkpoint::Never, true},
                                           VCase{Schedule::Tailored, Checkpoint::Never, false},
                                           VCase{Schedule::Tailored, Checkpoint::Always, true}));

// Tailored with virtual_stages(2) may place stage s on worker s % 2 (the
// stages share the CPU): still bit for bit GPipe's step.
TEST(TailoredErrors, VirtualStagesAddInterleavingAndBadOnesAreRefused) {
  torch::manual_seed(23);
  auto pipe = ModelPipeline(ModelPipelineOptions().record_timeline(true));
  for (int64_t s = 0; s < 4; ++s) pipe->append(mlp_stage(3, 3), "cpu");
  const auto x = torch::randn({8, 3}), y = torch::randn({8, 3});
  const auto options = TrainStepOptions(1).schedule(Schedule::Tailored).virtual_stages(2)
                           .stage_costs({{1, 1, 1, 2}});
  expect_gpipes_step(pipe, x, y, options);
  EXPECT_EQ(pipe->timeline().schedule, "Tailored");
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, TrainStepOptions(1).schedule(Schedule::Tailored)
                                                     .virtual_stages(3)),
                     "virtual_stages=3", "must divide the stage count, 4");
  EXPECT_TRUE(pipe->train_step(x, y, mse, options).defined());  // still usable
}
