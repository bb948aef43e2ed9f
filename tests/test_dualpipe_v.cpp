// DualPipeV (Note [DualPipeV]): its programs as a pure function (the V, the
// pairs, makespan and peak memory against the DualPipe README's table),
// validate's rules for pairs, given programs with pairs, and a step on the
// GPU. (The runtime's steps on the CPU, against the plain model and GPipe:
// VStep in test_v_schedules.cpp.)

#include "common.h"

#include <mpipe/mpipe.h>

#include <map>
#include <tuple>

using namespace mpipe_test;
using mpipe::Checkpoint;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Schedule;
using mpipe::TrainStepOptions;
namespace sch = mpipe::schedules;

namespace {

std::vector<sch::Program> dualpipe_v(int64_t m, int64_t d) {
  return mpipe::programs_for(Schedule::DualPipeV, m, 2 * d);
}

int64_t count_pairs(const std::vector<sch::Program>& programs) {
  int64_t n = 0;
  for (const auto& p : programs) {
    for (const auto& op : p) n += op.with_next;
  }
  return n;
}

}  // namespace

TEST(DualPipeV, RunsOnTheVAndPairsForwardsWithBackwards) {
  EXPECT_STREQ(mpipe::to_string(Schedule::DualPipeV), "DualPipeV");
  for (int64_t d = 1; d <= 4; ++d) {
    for (int64_t m = 1; m <= 3 * d + 1; ++m) {
      SCOPED_TRACE(std::to_string(d) + " workers, " + std::to_string(m) + " micro-batches");
      const auto p = dualpipe_v(m, d);
      EXPECT_EQ(sch::stage_workers(p), sch::stage_workers(sch::zero_bubble_v(m, d)));
      if (m < 2 * d) {  // no steady state: ZB-V's programs
        EXPECT_EQ(p, sch::zero_bubble_v(m, d));
        continue;
      }
      // Every worker pairs: m - 2D + r + 1 steady rounds of two pairs, less
      // the last worker's first, plus D - r - 1 more (step 5).
      for (int64_t r = 0; r < d; ++r) {
        const int64_t want = 2 * (m - 2 * d + r + 1) - (r == d - 1 ? 1 : 0) + (d - r - 1);
        EXPECT_EQ(count_pairs({p[static_cast<size_t>(r)]}), want) << "worker " << r;
      }
      for (const auto& q : p) {
        for (size_t k = 0; k < q.size(); ++k) {
          if (!q[k].with_next) continue;
          EXPECT_EQ(q[k].kind, sch::OpKind::Forward);
          EXPECT_EQ(q[k + 1].kind, sch::OpKind::Backward);
          EXPECT_NE(q[k].stage, q[k + 1].stage);
        }
      }
    }
  }
  MPIPE_EXPECT_ERROR(mpipe::programs_for(Schedule::DualPipeV, 4, 5), "DualPipeV", "even", "5");
  std::ostringstream text;
  text << sch::Op{sch::OpKind::Forward, 3, 1, true};
  EXPECT_EQ(text.str(), "F(3, 1)&");
}

// The DualPipe README (deepseek-ai/DualPipe, "Pipeline Bubbles and Memory
// Usage Comparison"): with PP = 2D chunks, DualPipeV's bubble is
// (PP/2 - 1)(F&B + B - 3W) and each device holds PP + 1 chunks' activations.
// simulate charges a pair F + B (no overlap), so with F = I = W = 1 (B = 2,
// F&B = 3) the bubble is 2(D - 1): 6m + 2(D - 1) units in all.
TEST(DualPipeV, MakespanAndPeakMemoryFollowTheDualPipeReadme) {
  for (int64_t d = 1; d <= 6; ++d) {
    for (int64_t m = 2 * d; m <= 3 * d + 2; ++m) {
      SCOPED_TRACE(std::to_string(d) + " workers, " + std::to_string(m) + " micro-batches");
      const auto p = dualpipe_v(m, d);
      EXPECT_NO_THROW(sch::validate(p, 2 * d, m));
      EXPECT_DOUBLE_EQ(sch::makespan(p), 6.0 * m + 2.0 * (d - 1));
      EXPECT_DOUBLE_EQ(max_peak(p), 2.0 * d + 1);
      // A pair hands on its forward's result only when its backward ends.
      std::map<std::tuple<int, int64_t, int64_t>, sch::TimedOp> at;
      for (const auto& t : sch::simulate(p)) {
        at[std::make_tuple(static_cast<int>(t.op.kind), t.op.micro_batch, t.op.stage)] = t;
      }
      auto find = [&](const sch::Op& op) {
        return at.at(std::make_tuple(static_cast<int>(op.kind), op.micro_batch, op.stage));
      };
      for (const auto& q : p) {
        for (size_t k = 0; k < q.size(); ++k) {
          if (!q[k].with_next || q[k].stage + 1 == 2 * d) continue;
          const auto next = find(sch::F(q[k].micro_batch, q[k].stage + 1));
          EXPECT_GE(next.start, find(q[k + 1]).end) << q[k];
        }
      }
    }
  }
}

TEST(DualPipeV, ValidateRefusesPairsThatAreNotAForwardAndABackward) {
  auto pair = [](sch::Op a) {
    a.with_next = true;
    return a;
  };
  // One worker, stages 0 and 1, two micro-batches.
  auto check = [](const sch::Program& p, std::vector<std::string> pieces) {
    try {
      sch::validate({p}, 2, 2);
      ADD_FAILURE() << "accepted";
    } catch (const c10::Error& e) {
      for (const auto& piece : pieces) {
        EXPECT_NE(std::string(e.what_without_backtrace()).find(piece), std::string::npos)
            << e.what_without_backtrace();
      }
    }
  };
  const sch::Program ok = {sch::F(0, 0), sch::F(0, 1), pair(sch::F(1, 0)), sch::B(0, 1),
                           sch::F(1, 1), sch::B(1, 1), sch::B(0, 0), sch::B(1, 0)};
  EXPECT_NO_THROW(sch::validate({ok}, 2, 2));
  EXPECT_EQ(sch::makespan({ok}), 12.0);
  check({sch::F(0, 0), pair(sch::F(0, 1)), sch::F(1, 0), sch::B(0, 1), sch::F(1, 1), sch::B(1, 1),
         sch::B(0, 0), sch::B(1, 0)},
        {"F(0, 1)&", "a forward and a backward"});
  check({sch::F(0, 0), sch::F(0, 1), pair(sch::F(1, 0)), sch::B(0, 0), sch::F(1, 1), sch::B(1, 1),
         sch::B(0, 1), sch::B(1, 0)},
        {"F(1, 0)&", "two stages and two micro-batches"});
  check({sch::F(0, 0), sch::F(0, 1), pair(sch::F(1, 0)), pair(sch::B(0, 1)), sch::F(1, 1),
         sch::B(1, 1), sch::B(0, 0), sch::B(1, 0)},
        {"pairs do not chain"});
  check({sch::F(0, 0), sch::F(0, 1), sch::F(1, 0), sch::B(0, 1), sch::F(1, 1), sch::B(1, 1),
         sch::B(0, 0), pair(sch::B(1, 0))},
        {"B(1, 0)&", "ends its program"});
}

// Given programs with pairs run too; a bad pair is refused before anything
// runs, and the pipeline stays usable.
TEST(DualPipeVErrors, BadPairsAndOddStageCountsAreRefused) {
  auto pipe = ModelPipeline();
  pipe->append(mlp_stage(3, 3), "cpu").append(mlp_stage(3, 3), "cpu").append(mlp_stage(3, 3), "cpu");
  const auto x = torch::randn({4, 3}), y = torch::randn({4, 3});
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, TrainStepOptions(2).schedule(Schedule::DualPipeV)),
                     "DualPipeV", "even number of stages", "3");
  auto two = ModelPipeline();
  two->append(mlp_stage(3, 3), "cpu").append(mlp_stage(3, 3), "cpu");
  auto programs = dualpipe_v(4, 1);
  ASSERT_GT(count_pairs(programs), 0);
  const auto step = TrainStepOptions(1).programs(programs);
  expect_gpipes_step(two, x, y, step);
  for (auto& op : programs[0]) {
    if (op.with_next) {
      op.kind = sch::OpKind::Backward;  // now a backward before its forward, or two backwards
      break;
    }
  }
  EXPECT_THROW(two->train_step(x, y, mse, TrainStepOptions(1).programs(programs)), c10::Error);
  EXPECT_TRUE(two->train_step(x, y, mse, TrainStepOptions(1)).defined());
}

// On one GPU, every stage on its own stream: the step equals GPipe's bit for
// bit, and the timeline times each pair's forward and backward on the GPU
// (whether they overlapped is the device's business: printed, not asserted).
TEST(DualPipeV, OnTheGpuEqualsGPipeAndTimesThePairs_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  torch::manual_seed(29);
  const int64_t d = 2, width = 256;
  auto pipe = ModelPipeline(ModelPipelineOptions().record_timeline(true));
  for (int64_t s = 0; s < 2 * d; ++s) pipe->append(mlp_stage(width, width), "cuda:0");
  const auto x = torch::randn({64, width}, torch::kCUDA), y = torch::randn({64, width}, torch::kCUDA);
  const auto step = TrainStepOptions(mpipe::chunks(8)).schedule(Schedule::DualPipeV);
  expect_gpipes_step(pipe, x, y, step);
  const auto t = pipe->timeline();
  ASSERT_EQ(t.schedule, "DualPipeV");
  // Per worker, in the order its thread began them: forward, backward, ...
  std::map<int64_t, std::vector<mpipe::Timeline::Task>> paired;
  int64_t n_paired = 0;
  for (const auto& task : t.tasks) {
    EXPECT_TRUE(task.device.is_cuda());
    EXPECT_LE(task.start_ms, task.end_ms);
    if (!task.paired) continue;
    paired[t.rank_of(task.stage)].push_back(task);
    ++n_paired;
  }
  EXPECT_EQ(n_paired, 2 * count_pairs(dualpipe_v(8, d)));
  double overlap = 0;
  for (const auto& w : paired) {
    for (size_t k = 0; k + 1 < w.second.size(); k += 2) {
      const auto &f = w.second[k], &b = w.second[k + 1];
      EXPECT_EQ(f.kind, mpipe::TaskKind::Forward);
      EXPECT_EQ(b.kind, mpipe::TaskKind::Backward);
      overlap += std::max(0.0, std::min(f.end_ms, b.end_ms) - std::max(f.start_ms, b.start_ms));
    }
  }
  std::printf("DualPipeV on the GPU: %lld paired tasks, %.3f ms of overlap in a %.3f ms step\n",
              static_cast<long long>(n_paired), overlap, t.makespan_ms());
}
