// Training: the runtime follows each schedule's programs and programs a user
// writes (TrainStepPrograms), the training step's gradients against the plain
// model, deferred BatchNorm (its statistics and precision), and bad input
// (checkpointing: test_checkpointing.cpp). The schedules as
// pure functions are in test_schedule.cpp.

#include "common.h"

#include <mpipe/mpipe.h>

#include <atomic>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

using namespace mpipe_test;
using mpipe::Checkpoint;
using mpipe::LossReduction;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Schedule;
using mpipe::TrainStepOptions;
namespace sch = mpipe::schedules;
using sch::B;
using sch::F;

namespace {

/// Logs, per stage, the order in which the runtime runs the stage's forwards
/// and backwards: a forward when the module runs (not when a checkpointed
/// stage is recomputed), a backward when the gradient of its output arrives.
struct OrderLog {
  std::mutex mutex;
  std::vector<sch::Program> per_stage;
};

struct OrderRecorderImpl : torch::nn::Module {
  OrderRecorderImpl(std::shared_ptr<OrderLog> log, int64_t stage) : log(log), stage(stage) {}
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t mb = mpipe::current_micro_batch().index;
    if (!mpipe::is_recomputing()) add(F(mb, stage));
    torch::Tensor y = x * 1;  // a node of our own for the hook
    if (y.requires_grad()) {
      auto l = log;
      const int64_t j = stage;
      y.register_hook([l, j, mb](const torch::Tensor& g) {
        std::lock_guard<std::mutex> lock(l->mutex);
        l->per_stage[static_cast<size_t>(j)].push_back(B(mb, j));
        return g;
      });
    }
    return y;
  }
  void add(sch::Op op) {
    std::lock_guard<std::mutex> lock(log->mutex);
    log->per_stage[static_cast<size_t>(stage)].push_back(op);
  }
  std::shared_ptr<OrderLog> log;
  int64_t stage;
};
TORCH_MODULE(OrderRecorder);

}  // namespace

std::string name_of(Schedule s) { return mpipe::to_string(s); }

TEST(TrainStepPrograms, TheRuntimeFollowsEachStagesProgram) {
  const int64_t n = 4;
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B,
                            Schedule::ZeroBubbleH1}) {
    const int64_t v = schedule == Schedule::Interleaved1F1B ? 2 : 1;
    for (Checkpoint ckpt : {Checkpoint::Never, Checkpoint::Always}) {
      for (bool threads : {true, false}) {
        for (int64_t m : {3, 7}) {
          SCOPED_TRACE(name_of(schedule) + (ckpt == Checkpoint::Never ? "" : ", checkpointing") +
                       (threads ? ", threads" : ", inline") + ", " + std::to_string(m) +
                       " micro-batches");
          auto log = std::make_shared<OrderLog>();
          log->per_stage.resize(n);
          auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads).checkpoint(ckpt));
          for (int64_t j = 0; j < n; ++j) {
            pipe->append(torch::nn::Sequential(torch::nn::Linear(3, 3), OrderRecorder(log, j)),
                         "cpu");
          }
          auto x = torch::randn({2 * m, 3}).requires_grad_();  // stage 0's I has work
          pipe->train_step(x, torch::randn({2 * m, 3}),
                           [](const torch::Tensor& y, const torch::Tensor& t) {
                             return torch::mse_loss(y, t);
                           },
                           TrainStepOptions(2).schedule(schedule).virtual_stages(v));
          // Each stage's operations in its worker's order. The hook on the
          // stage's output fires in B, and in I but not in W: the weight
          // gradients start from the Linear's node with the gradient I
          // brought there (Note [Split backward]). So I shows as a B.
          const auto programs = mpipe::programs_for(schedule, m, n, v);
          std::vector<sch::Program> expected(n);
          for (const auto& p : programs) {
            for (auto op : p) {
              if (op.kind == sch::OpKind::BackwardWeight) continue;
              if (op.kind != sch::OpKind::Forward) op.kind = sch::OpKind::Backward;
              expected[static_cast<size_t>(op.stage)].push_back(op);
            }
          }
          for (int64_t j = 0; j < n; ++j) {
            SCOPED_TRACE("stage " + std::to_string(j));
            EXPECT_EQ(log->per_stage[static_cast<size_t>(j)], expected[static_cast<size_t>(j)])
                << "the order of F and B";
          }
          // A forward call: every stage runs F(0..m-1) in order, no backward.
          for (auto& p : log->per_stage) p.clear();
          {
            torch::NoGradGuard no_grad;
            pipe->forward(x.detach(), 2);
          }
          const auto forwards = sch::forward_only(m, n);
          for (int64_t j = 0; j < n; ++j) {
            EXPECT_EQ(log->per_stage[static_cast<size_t>(j)], forwards[static_cast<size_t>(j)]);
          }
        }
      }
    }
  }
}

// Programs a user writes (TrainStepOptions::programs): an order no built-in
// schedule produces (stage 2 forwards micro-batch 1 before 0; stage 0 splits
// its backward and takes the weight gradients late; backwards out of order),
// run as written, equal to the plain model.
TEST(TrainStepPrograms, GivenProgramsRunAsWrittenAndEqualThePlainModel) {
  using sch::I;
  using sch::W;
  const std::vector<sch::Program> programs = {
      {F(0, 0), F(1, 0), F(2, 0), I(2, 0), I(0, 0), W(2, 0), I(1, 0), W(0, 0), W(1, 0)},
      {F(0, 1), F(1, 1), F(2, 1), B(1, 1), B(2, 1), B(0, 1)},
      {F(1, 2), F(0, 2), B(0, 2), F(2, 2), B(2, 2), B(1, 2)},
  };
  for (Checkpoint ckpt : {Checkpoint::Never, Checkpoint::Always}) {
    for (bool threads : {true, false}) {
      SCOPED_TRACE(std::string(ckpt == Checkpoint::Never ? "" : "checkpointing, ") +
                   (threads ? "threads" : "inline"));
      torch::manual_seed(0);
      auto log = std::make_shared<OrderLog>();
      log->per_stage.resize(3);
      std::vector<torch::nn::Sequential> stages;
      auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads).checkpoint(ckpt));
      for (int64_t j = 0; j < 3; ++j) {
        stages.push_back(torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::Tanh(),
                                               OrderRecorder(log, j)));
        stages.back()->to(torch::kDouble);
        pipe->append(stages.back(), "cpu");
      }
      const auto x = torch::randn({6, 3}, torch::kDouble);
      const auto y = torch::randn({6, 3}, torch::kDouble);
      auto mse = [](const torch::Tensor& out, const torch::Tensor& t) {
        return torch::mse_loss(out, t);
      };
      expect_train_step_transparent(pipe, stages, {torch::kCPU, torch::kCPU, torch::kCPU}, x, y,
                                    mse, TrainStepOptions(2).programs(programs));
      // Each stage's operations in the order written (I shows as a B, W not
      // at all: see TrainStepPrograms.TheRuntimeFollowsEachStagesProgram).
      for (int64_t j = 0; j < 3; ++j) {
        sch::Program expected;
        for (auto op : programs[static_cast<size_t>(j)]) {
          if (op.kind == sch::OpKind::BackwardWeight) continue;
          if (op.kind != sch::OpKind::Forward) op.kind = sch::OpKind::Backward;
          expected.push_back(op);
        }
        auto got = log->per_stage[static_cast<size_t>(j)];
        got.resize(std::min(got.size(), expected.size()));  // the plain model's run adds more
        EXPECT_EQ(got, expected) << "stage " << j;
      }
    }
  }
}

TEST(TrainStepPrograms, GivenProgramsThatCannotRunAreRefused) {
  auto pipe = ModelPipeline();
  for (int64_t j = 0; j < 2; ++j) pipe->append(torch::nn::Linear(3, 3), "cpu");
  const auto x = torch::randn({4, 3});
  const auto y = torch::randn({4, 3});
  auto mse = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  auto refused = [&](const std::vector<sch::Program>& programs, const std::string& why) {
    try {
      pipe->train_step(x, y, mse, TrainStepOptions(2).programs(programs));
      ADD_FAILURE() << "accepted programs where " << why;
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("mpipe::ModelPipeline::train_step: TrainStepOptions::programs cannot "
                          "run this step of 2 micro-batch(es) over 2 stages"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find(why), std::string::npos) << what;
    }
  };
  refused({{F(0, 0), F(1, 0), B(0, 0), B(1, 0)}, {F(0, 1), F(1, 1), B(0, 1)}},
          "stage 1 misses the backward of micro-batch 1");
  refused({{F(0, 0), F(1, 0), B(0, 0), B(1, 0)}, {F(0, 1), F(1, 1), B(0, 1), B(1, 1), B(1, 1)}},
          "repeated");
  refused({{F(0, 0), F(1, 0), F(2, 0), B(0, 0), B(1, 0), B(2, 0)},
           {F(0, 1), F(1, 1), F(2, 1), B(0, 1), B(1, 1), B(2, 1)}},
          "out of range");
  // Worker 1 waits for F(1, 0), which waits behind B(0, 0), which waits for
  // B(0, 1), behind worker 1's first operation: a cycle.
  refused({{F(0, 0), B(0, 0), F(1, 0), B(1, 0)}, {F(1, 1), F(0, 1), B(0, 1), B(1, 1)}},
          "cannot finish");
  // And the pipeline still trains.
  EXPECT_TRUE(pipe->train_step(x, y, mse, TrainStepOptions(2)).defined());
}

TEST(TrainStepChunks, ACountGivesTheStepOfItsRowsUnderEverySchedule) {
  const int64_t width = 4, batch = 10;
  auto mse = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubbleH1}) {
    for (int64_t n : {1, 3, 4, 10, 16}) {
      SCOPED_TRACE(name_of(schedule) + ", chunks " + std::to_string(n));
      torch::manual_seed(5);
      std::vector<torch::nn::Sequential> stages;
      auto pipe = ModelPipeline();
      for (int64_t j = 0; j < 3; ++j) {
        stages.push_back(mlp_stage(width, width));
        stages.back()->to(torch::kDouble);
        pipe->append(stages.back(), "cpu");
      }
      auto x = torch::randn({batch, width}, torch::kDouble);
      auto y = torch::randn({batch, width}, torch::kDouble);
      // Against the plain model, spelled both ways.
      expect_train_step_transparent(pipe, stages, {torch::kCPU, torch::kCPU, torch::kCPU}, x, y,
                                    mse, TrainStepOptions(mpipe::chunks(n)).schedule(schedule));
      expect_train_step_transparent(pipe, stages, {torch::kCPU, torch::kCPU, torch::kCPU}, x, y,
                                    mse, TrainStepOptions(4).chunks(n).schedule(schedule));
      // Bit for bit the step of ceil(batch / n) rows per micro-batch.
      pipe->zero_grad();
      auto by_count = pipe->train_step(x, y, mse, mpipe::chunks(n));
      std::vector<torch::Tensor> grads;
      for (auto& p : pipe->parameters()) grads.push_back(p.grad().clone());
      pipe->zero_grad();
      auto by_rows = pipe->train_step(x, y, mse, TrainStepOptions(1).split_size((batch + n - 1) / n));
      EXPECT_TRUE(torch::equal(by_count, by_rows));
      auto params = pipe->parameters();
      for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(grads[i], params[i].grad()));
    }
  }
}

TEST(TrainStepChunks, GivenProgramsCountTheChunks) {
  auto pipe = ModelPipeline();
  torch::nn::Linear l0(2, 2), l1(2, 2);
  pipe->append(l0, "cpu").append(l1, "cpu");
  auto mse = [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); };
  const auto programs = sch::one_f_one_b(2, 2);
  auto x = torch::randn({6, 2}), y = torch::randn({6, 2});
  EXPECT_TRUE(pipe->train_step(x, y, mse, TrainStepOptions(mpipe::chunks(2)).programs(programs))
                  .defined());
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, TrainStepOptions(mpipe::chunks(3)).programs(programs)),
                     "train_step", "of 3 micro-batch");
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, TrainStepOptions(2).chunks(0)),
                     "train_step", "chunks must be positive, got 0");
  EXPECT_TRUE(pipe->train_step(x, y, mse, mpipe::chunks(6)).defined());  // still usable
}

namespace {

struct TrainCase {
  Schedule schedule;
  Checkpoint checkpoint;
  bool threads;
};

std::string case_name(const ::testing::TestParamInfo<TrainCase>& info) {
  const auto& c = info.param;
  std::string s = schedule_name(c.schedule);
  s += c.checkpoint == Checkpoint::Never       ? "_NoCheckpoint"
       : c.checkpoint == Checkpoint::ExceptLast ? "_CheckpointExceptLast"
                                                : "_CheckpointAlways";
  return s + (c.threads ? "_Threads" : "_Inline");
}

class TrainStep : public ::testing::TestWithParam<TrainCase> {
 protected:
  ModelPipeline make() {
    return ModelPipeline(ModelPipelineOptions()
                             .worker_threads(GetParam().threads)
                             .checkpoint(GetParam().checkpoint));
  }
};

}  // namespace

TEST_P(TrainStep, GradientsEqualThePlainModel) {
  torch::manual_seed(11);
  const int64_t width = 5, batch = 10;
  for (int64_t n_stages : {1, 2, 3, 4}) {
    std::vector<torch::nn::Sequential> stages;
    auto pipe = make();
    for (int64_t j = 0; j < n_stages; ++j) {
      stages.push_back(mlp_stage(width, width));
      stages.back()->to(torch::kDouble);
      pipe->append(stages.back(), "cpu");
    }
    std::vector<torch::Device> devices(stages.size(), torch::kCPU);
    for (int64_t split : {1, 3, 4, 10}) {
      for (auto reduction : {LossReduction::Mean, LossReduction::Sum}) {
        SCOPED_TRACE(std::to_string(n_stages) + " stages, split " + std::to_string(split) +
                     (reduction == LossReduction::Mean ? ", mean" : ", sum"));
        auto x = torch::randn({batch, width}, torch::kDouble);
        auto target = torch::randn({batch, width}, torch::kDouble);
        const auto red = reduction == LossReduction::Mean ? torch::Reduction::Mean
                                                          : torch::Reduction::Sum;
        expect_train_step_transparent(
            pipe, stages, devices, x, target,
            [red](const torch::Tensor& out, const torch::Tensor& t) {
              return torch::mse_loss(out, t, red);
            },
            schedule_options(GetParam().schedule, split, n_stages).reduction(reduction));
      }
    }
  }
}

TEST_P(TrainStep, GradientsAccumulateLikeBackward) {
  torch::manual_seed(12);
  auto stage = mlp_stage(3, 3);
  auto pipe = make();
  pipe->append(stage, "cpu").append(mlp_stage(3, 2), "cpu");
  auto x = torch::randn({6, 3});
  auto t = torch::randn({6, 2});
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& y) { return torch::mse_loss(o, y); };
  pipe->train_step(x, t, loss_fn, schedule_options(GetParam().schedule, 2, 2));
  auto once = grads_of(*pipe);
  pipe->train_step(x, t, loss_fn, schedule_options(GetParam().schedule, 4, 2));
  for (const auto& kv : grads_of(*pipe)) expect_close(kv.second, once[kv.first] * 2, 1e-5, kv.first);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, TrainStep,
    ::testing::Values(TrainCase{Schedule::GPipe, Checkpoint::Never, true},
                      TrainCase{Schedule::GPipe, Checkpoint::Never, false},
                      TrainCase{Schedule::GPipe, Checkpoint::ExceptLast, true},
                      TrainCase{Schedule::GPipe, Checkpoint::Always, false},
                      TrainCase{Schedule::OneFOneB, Checkpoint::Never, true},
                      TrainCase{Schedule::OneFOneB, Checkpoint::Never, false},
                      TrainCase{Schedule::OneFOneB, Checkpoint::ExceptLast, false},
                      TrainCase{Schedule::OneFOneB, Checkpoint::Always, true},
                      TrainCase{Schedule::Interleaved1F1B, Checkpoint::Never, true},
                      TrainCase{Schedule::Interleaved1F1B, Checkpoint::Never, false},
                      TrainCase{Schedule::Interleaved1F1B, Checkpoint::ExceptLast, true},
                      TrainCase{Schedule::Interleaved1F1B, Checkpoint::Always, false},
                      TrainCase{Schedule::ZeroBubbleH1, Checkpoint::Never, true},
                      TrainCase{Schedule::ZeroBubbleH1, Checkpoint::Never, false},
                      TrainCase{Schedule::ZeroBubbleH1, Checkpoint::ExceptLast, false},
                      TrainCase{Schedule::ZeroBubbleH1, Checkpoint::Always, true},
                      TrainCase{Schedule::Auto, Checkpoint::Never, true},
                      TrainCase{Schedule::Auto, Checkpoint::Always, false}),
    case_name);

TEST(DeferredBatchNorm, VarianceStaysExactForALargeMean) {
  // Data with mean 300 and standard deviation 1, in float: E[x^2] - mean^2 in
  // float lost three digits here; BatchNorm1d keeps about seven.
  torch::manual_seed(43);
  const auto x = torch::randn({512, 4}) + 300;
  torch::nn::BatchNorm1d reference(4);
  mpipe::DeferredBatchNorm deferred(4);
  {
    torch::NoGradGuard no_grad;
    reference(x);
    for (int64_t i = 0; i < 8; ++i) {
      mpipe::MicroBatchGuard mb({i, 8});
      deferred(x.narrow(0, i * 64, 64));
    }
  }
  const auto exact = x.to(torch::kDouble).var(0) * 0.1 + 0.9;
  const double ours = (deferred->running_var.to(torch::kDouble) - exact).abs().max().item<double>();
  const double theirs = (reference->running_var.to(torch::kDouble) - exact).abs().max().item<double>();
  EXPECT_LT(ours, 1e-6) << "BatchNorm1d's error: " << theirs;
  expect_close(deferred->running_mean, x.to(torch::kDouble).mean(0) * 0.1, 1e-5, "running_mean");
}

TEST(DeferredBatchNorm, RunningStatisticsEqualTheUnsplitModel) {
  torch::manual_seed(31);
  for (auto schedule : all_schedules()) {
    for (auto checkpoint : {Checkpoint::Never, Checkpoint::Always}) {
      SCOPED_TRACE(schedule_name(schedule));
      torch::nn::BatchNorm2d reference(3);
      reference->to(torch::kDouble);
      mpipe::DeferredBatchNorm deferred(3);
      deferred->to(torch::kDouble);
      auto pipe = ModelPipeline(ModelPipelineOptions().checkpoint(checkpoint));
      pipe->append(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 1)), "cpu");
      pipe->append(deferred, "cpu");
      pipe->to(torch::kDouble);
      auto conv = pipe->stage(0)->as<torch::nn::Conv2d>();
      for (int step = 0; step < 3; ++step) {
        auto x = torch::randn({10, 2, 4, 4}, torch::kDouble) * (step + 1) + step;
        pipe->train_step(x, torch::zeros({10, 3, 4, 4}, torch::kDouble),
                         [](const torch::Tensor& o, const torch::Tensor& y) {
                           return torch::mse_loss(o, y);
                         },
                         schedule_options(schedule, 3, 2));  // micro-batches of 3, 3, 3, 1
        torch::NoGradGuard no_grad;
        reference(conv->forward(x));  // the unsplit batch through plain BatchNorm
        expect_close(deferred->running_mean, reference->running_mean, 1e-10, "running_mean");
        expect_close(deferred->running_var, reference->running_var, 1e-10, "running_var");
      }
      EXPECT_EQ(deferred->num_batches_tracked.item<int64_t>(), 3);
    }
  }
}

// Given programs may run a stage's forwards in any order: the running
// statistics are still updated once, with every micro-batch, bit for bit as
// in micro-batch order, and nothing is left for the next call.
TEST(DeferredBatchNorm, ForwardsOutOfOrderStillCommitTheWholeBatch) {
  torch::manual_seed(34);
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "checkpointing" : "no checkpoints");
    torch::nn::BatchNorm1d reference(3);
    reference->to(torch::kDouble);
    const auto options = ModelPipelineOptions().checkpoint(checkpointing ? Checkpoint::Always
                                                                         : Checkpoint::Never);
    mpipe::DeferredBatchNorm deferred(3), in_order(3);
    deferred->to(torch::kDouble);
    in_order->to(torch::kDouble);
    auto pipe = ModelPipeline(options), gpipe = ModelPipeline(options);
    pipe->append(deferred, "cpu");
    gpipe->append(in_order, "cpu");
    for (int step = 0; step < 2; ++step) {
      // Four micro-batches of rows far from 0, so that the order of the sums shows.
      const auto x = torch::randn({12, 3}, torch::kDouble) * (step + 2) + 1000.1;
      const auto y = torch::zeros({12, 3}, torch::kDouble);
      auto steps = TrainStepOptions(mpipe::chunks(4));
      gpipe->train_step(x, y, mse, steps);
      // The first step runs micro-batch 3's forward first and 0's last; the second is GPipe.
      if (step == 0) {
        steps.programs({{F(3, 0), F(1, 0), F(2, 0), F(0, 0), B(0, 0), B(3, 0), B(1, 0), B(2, 0)}});
      }
      pipe->train_step(x, y, mse, steps);
      EXPECT_EQ(deferred->num_batches_tracked.item<int64_t>(), step + 1);
      EXPECT_FALSE(deferred->holds_state());
      EXPECT_TRUE(torch::equal(deferred->running_mean, in_order->running_mean));
      EXPECT_TRUE(torch::equal(deferred->running_var, in_order->running_var));
      torch::NoGradGuard no_grad;
      reference(x);
      expect_close(deferred->running_mean, reference->running_mean, 1e-10, "running_mean");
      expect_close(deferred->running_var, reference->running_var, 1e-9, "running_var");
    }
  }
}

TEST(DeferredBatchNorm, EveryScheduleGivesThePlainPerMicroBatchGradients) {
  // In training, DeferredBatchNorm normalises each micro-batch by its own
  // statistics: the plain model is the loss summed over the micro-batches,
  // each weighted by its share of the batch, through BatchNorm in training
  // mode on that micro-batch alone.
  for (auto schedule : all_schedules()) {
    for (auto checkpoint : {Checkpoint::Never, Checkpoint::Always}) {
      SCOPED_TRACE(schedule_name(schedule) +
                   (checkpoint == Checkpoint::Never ? "" : ", checkpointing"));
      torch::manual_seed(33);
      torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 1));
      mpipe::DeferredBatchNorm deferred(3);
      torch::nn::Conv2d head(torch::nn::Conv2dOptions(3, 3, 1));
      auto pipe = ModelPipeline(ModelPipelineOptions().checkpoint(checkpoint));
      pipe->append(conv, "cpu").append(deferred, "cpu").append(head, "cpu");
      pipe->to(torch::kDouble);
      auto x = torch::randn({10, 2, 4, 4}, torch::kDouble) * 2 + 1;
      auto target = torch::randn({10, 3, 4, 4}, torch::kDouble);
      auto mse = [](const torch::Tensor& o, const torch::Tensor& y) { return torch::mse_loss(o, y); };
      auto loss = pipe->train_step(x, target, mse, schedule_options(schedule, 3, 3));
      const auto grads = grads_of(*pipe);
      zero_grads(*pipe);
      torch::Tensor plain_loss = torch::zeros({}, torch::kDouble);
      for (int64_t at = 0; at < 10; at += 3) {
        const int64_t rows = std::min<int64_t>(3, 10 - at);
        auto h = conv(x.narrow(0, at, rows));
        h = torch::batch_norm(h, deferred->weight, deferred->bias, {}, {}, /*training=*/true,
                              0.1, 1e-5, false);
        plain_loss = plain_loss + mse(head(h), target.narrow(0, at, rows)) * (rows / 10.0);
      }
      plain_loss.backward();
      expect_close(loss, plain_loss, 1e-12, "loss");
      expect_same_grads(grads, grads_of(*pipe), 1e-12);
    }
  }
}

TEST(DeferredBatchNorm, NormalisesEachMicroBatchAndUsesRunningStatsInEval) {
  torch::manual_seed(32);
  mpipe::DeferredBatchNorm bn(4);
  auto x = torch::randn({6, 4}) * 3 + 1;
  torch::nn::BatchNorm1d plain(4);
  {
    mpipe::MicroBatchGuard mb({0, 2});  // not the last: nothing committed yet
    expect_close(bn(x), plain(x), 1e-5, "training output");
    expect_close(bn->running_mean, torch::zeros({4}), 0.0, "running_mean untouched");
  }
  bn->eval();
  plain->eval();
  expect_close(bn(x), x / std::sqrt(1 + 1e-5), 1e-5, "eval uses running stats");
  MPIPE_EXPECT_ERROR(bn(torch::randn({2, 5})), "expected input [N, 4, ...]", "[2, 5]");
}

TEST(TrainStepErrors, BadInputsAreRefusedAndThePipelineStaysUsable) {
  auto pipe = ModelPipeline();
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& y) { return torch::mse_loss(o, y); };
  MPIPE_EXPECT_ERROR(pipe->train_step(torch::randn({4, 2}), torch::randn({4, 2}), loss_fn, 2),
                     "no stages");
  torch::nn::Linear l0(2, 2), l1(2, 2);
  pipe->append(l0, "cpu").append(l1, "cpu");
  auto x = torch::randn({4, 2});
  MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({3, 2}), loss_fn, 2),
                     "target needs the input's batch size (4)", "[3, 2]");
  MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}), loss_fn, 0),
                     "split_size must be positive, got 0");
  MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}), mpipe::LossFunction(), 2),
                     "loss_fn is empty");
  {
    torch::NoGradGuard no_grad;
    MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}), loss_fn, 2), "gradients are off");
  }
  // Schedule options that do not fit the pipeline.
  MPIPE_EXPECT_ERROR(
      pipe->train_step(x, torch::randn({4, 2}), loss_fn,
                       TrainStepOptions(2).schedule(Schedule::Interleaved1F1B).virtual_stages(3)),
      "virtual_stages=3 must divide the stage count, 2");
  MPIPE_EXPECT_ERROR(
      pipe->train_step(x, torch::randn({4, 2}), loss_fn,
                       TrainStepOptions(2).schedule(Schedule::Interleaved1F1B).virtual_stages(0)),
      "virtual_stages must be >= 1, got 0");
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubbleH1}) {
    MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}), loss_fn,
                                        TrainStepOptions(2).schedule(s).virtual_stages(2)),
                       "virtual_stages=2 applies to Schedule::Interleaved1F1B, Auto and Tailored",
                       std::string("not ") + mpipe::to_string(s));
  }
  MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}), loss_fn,
                                      TrainStepOptions(2).schedule(Schedule::Auto).stage_costs(
                                          {{1, 1, 1, 0}, {1, 1, 1, 0}, {1, 1, 1, 0}})),
                     "stage_costs has 3 entries for 2 stages");
  MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}), loss_fn,
                                      TrainStepOptions(2).schedule(Schedule::Auto).stage_costs(
                                          {{1, -2, 1, 0}})),
                     "stage_costs[0] has a negative or NaN cost", "backward_input -2");
  MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}), loss_fn,
                                      TrainStepOptions(2).schedule(Schedule::Auto).activation_bytes({1})),
                     "activation_bytes has 1 entries for 2 stages");
  MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}), loss_fn,
                                      TrainStepOptions(2).schedule(Schedule::Auto).memory_limit(-1)),
                     "memory_limit must be >= 0");
  for (auto schedule : all_schedules()) {
    for (bool threads : {true, false}) {
      SCOPED_TRACE(schedule_name(schedule) + (threads ? ", threads" : ", inline"));
      pipe->options.worker_threads(threads);
      MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({4, 2}),
                                          [](const torch::Tensor& o, const torch::Tensor&) {
                                            return o;  // not a scalar
                                          },
                                          schedule_options(schedule, 2, 2)),
                         "train_step", "stage 1", "loss of micro-batch 0 of 2",
                         "must return one value", "[2, 2]");
      // A stage that fails in backward.
      MPIPE_EXPECT_ERROR(
          pipe->train_step(x, torch::randn({4, 2}),
                           [](const torch::Tensor& o, const torch::Tensor&) {
                             auto out = o * 1;
                             out.register_hook([](torch::Tensor g) -> torch::Tensor {
                               TORCH_CHECK(false, "planted backward failure");
                               return g;
                             });
                             return out.sum();
                           },
                           schedule_options(schedule, 1, 2)),
          "stage 1",
          schedule == Schedule::ZeroBubbleH1 || schedule == Schedule::ZeroBubbleV
              ? "input gradient of micro-batch 0 of 4"
          : schedule == Schedule::Auto || schedule == Schedule::Tailored
              ? "micro-batch 0 of 4"
              : "backward of micro-batch 0 of 4",
          "planted backward failure");
      // The next step equals the plain model, in loss and gradients.
      zero_grads(*pipe);  // the failed steps left partial gradients
      expect_train_step_transparent(pipe, std::vector<torch::nn::Linear>{l0, l1},
                                    {torch::kCPU, torch::kCPU}, x, torch::randn({4, 2}),
                                    loss_fn, schedule_options(schedule, 2, 2), 1e-6);
    }
  }
}

TEST(ConstantTrainStep, LossAndGradientsEqualThePlainLoop) {
  torch::manual_seed(23);
  std::vector<Leaky> stages{Leaky(6, 0.7), Leaky(6, 0.4), Leaky(6, 0.9)};
  for (bool threads : {true, false}) {
    auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
    for (auto& s : stages) pipe->append(s, "cpu");
    const auto x = torch::randn({5, 6});
    const auto target = torch::randn({5, 6});
    auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& t) {
      return (out / 4 - t).pow(2).mean();  // out is the sum over the T = 4 steps
    };
    mpipe::reset_states(*pipe);
    auto x1 = x.clone().requires_grad_();
    auto loss = pipe->constant_train_step(x1, 4, target, loss_fn);
    EXPECT_FALSE(loss.requires_grad());
    EXPECT_EQ(loss.dim(), 0);
    for (auto& s : stages) EXPECT_TRUE(s->state.slots().empty()) << "state is reset after the step";
    auto pipe_grads = grads_of(*pipe);
    zero_grads(*pipe);

    // The plain loop, from reset state.
    mpipe::reset_states(*pipe);
    auto x2 = x.clone().requires_grad_();
    torch::Tensor out;
    for (int t = 0; t < 4; ++t) {
      torch::Tensor y = x2;
      for (auto& s : stages) y = s(y);
      out = out.defined() ? out + y : y;
    }
    auto loss2 = loss_fn(out, target);
    loss2.backward();
    expect_close(loss, loss2, 1e-12, "loss");
    expect_close(x1.grad(), x2.grad(), 1e-12, "grad of x");
    expect_same_grads(pipe_grads, grads_of(*pipe), 1e-12);
    zero_grads(*pipe);
    mpipe::reset_states(*pipe);
  }
}

/// Adds the input it saw one step earlier: its state holds a stage input,
/// so a time step's gradient reaches the step before through that input.
struct EchoImpl : torch::nn::Module, mpipe::Stateful {
  explicit EchoImpl(int64_t width) { fc = register_module("fc", torch::nn::Linear(width, width)); }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor& before = last.get();
    torch::Tensor out = torch::tanh(fc(x) + (before.defined() ? before * 0.5 : torch::zeros_like(x)));
    before = x;
    return out;
  }
  void reset_state() override { last.clear(); }
  torch::nn::Linear fc{nullptr};
  mpipe::PerMicroBatch<torch::Tensor> last;
};
TORCH_MODULE(Echo);

TEST(ConstantTrainStep, EqualsThePlainLoopBitForBitThroughStateAndTheCallersGraph) {
  // Note [Chained backward]: each (stage, time step) backpropagates its own
  // nodes and carries what leaves them; the sums come out in the order of one
  // backward of the whole graph.
  torch::manual_seed(25);
  torch::nn::Linear encoder(3, 6);  // the caller's graph, before the pipeline
  Leaky a(6, 0.7), c(6, 0.4);
  Echo b(6);
  for (bool threads : {true, false}) {
    SCOPED_TRACE(threads ? "threads" : "inline");
    auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
    pipe->append(a, "cpu").append(b, "cpu").append(c, "cpu");
    const auto img = torch::randn({4, 3});
    const auto target = torch::randn({4, 6});
    auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& t) {
      return (out - t).pow(2).mean();
    };
    for (int64_t T : {1, 2, 5}) {
      SCOPED_TRACE("T = " + std::to_string(T));
      zero_grads(*pipe);
      encoder->zero_grad();
      auto loss = pipe->constant_train_step(encoder(img), T, target, loss_fn);
      auto pipe_grads = grads_of(*pipe);
      const auto encoder_grad = encoder->weight.grad().clone();

      zero_grads(*pipe);
      encoder->zero_grad();
      mpipe::reset_states(*pipe);
      const auto x = encoder(img);
      torch::Tensor out;
      for (int64_t t = 0; t < T; ++t) {
        torch::Tensor y = c(b(a(x)));
        out = out.defined() ? out + y : y;
      }
      auto plain = loss_fn(out, target);  // the outputs summed over the T steps
      plain.backward();
      mpipe::reset_states(*pipe);
      expect_close(loss, plain, 0.0, "loss");
      expect_close(encoder_grad, encoder->weight.grad(), 0.0, "the caller's encoder");
      expect_same_grads(pipe_grads, grads_of(*pipe), 0.0);
    }
  }
}

TEST(ConstantTrainStep, StartsFromRestAndAccumulates) {
  torch::manual_seed(24);
  Leaky a(3, 0.5), b(3, 0.5);
  auto pipe = ModelPipeline();
  pipe->append(a, "cpu").append(b, "cpu");
  auto x = torch::randn({2, 3});
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor&) { return out.mean(); };
  pipe->constant_forward(x, 3);  // leaves state behind...
  EXPECT_FALSE(a->state.slots().empty());
  auto first = pipe->constant_train_step(x, 3, torch::Tensor(), loss_fn);  // ...which is reset
  auto g1 = grads_of(*pipe);
  auto second = pipe->constant_train_step(x, 3, torch::Tensor(), loss_fn);
  expect_close(first, second, 0.0, "the same step twice");
  for (const auto& kv : grads_of(*pipe)) {
    expect_close(kv.second, g1.at(kv.first) * 2, 1e-12, "accumulated grad of " + kv.first);
  }
}

TEST(ConstantTrainStep, BadInputsAreRefusedAndThePipelineStaysUsable) {
  auto pipe = ModelPipeline();
  auto mean = [](const torch::Tensor& out, const torch::Tensor&) { return out.mean(); };
  auto x = torch::randn({2, 3});
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 2, torch::Tensor(), mean), "no stages");
  Leaky a(3, 0.5);
  pipe->append(a, "cpu").append(Failing(3), "cpu");
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 0, torch::Tensor(), mean),
                     "constant_train_step", "T (the number of time steps) must be positive, got 0");
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 2, torch::Tensor(), mpipe::LossFunction()),
                     "loss_fn is empty");
  {
    torch::NoGradGuard no_grad;
    MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 2, torch::Tensor(), mean),
                       "gradients are off");
  }
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(
                         x, 2, torch::Tensor(),
                         [](const torch::Tensor& out, const torch::Tensor&) { return out; }),
                     "constant_train_step", "must return one value", "[2, 3]",
                     "reduce it, e.g. with .mean() or .sum()");
  // Stage 1 fails at its 4th call (the step above made 2): time step 1 of 3.
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 3, torch::Tensor(), mean),
                     "constant_train_step", "stage 1", "time step 1 of 3", "planted failure");
  EXPECT_TRUE(a->state.slots().empty()) << "a failed step leaves the state of its start";
  // The next step equals the plain loop (stage 1 is x * 2 when it does not fail).
  zero_grads(*pipe);
  auto loss = pipe->constant_train_step(x, 3, torch::Tensor(), mean);
  auto pipe_grads = grads_of(*pipe);
  zero_grads(*pipe);
  mpipe::reset_states(*pipe);
  torch::Tensor out;
  for (int t = 0; t < 3; ++t) out = t == 0 ? a(x) * 2 : out + a(x) * 2;
  auto loss2 = mean(out, torch::Tensor());
  loss2.backward();
  mpipe::reset_states(*pipe);
  expect_close(loss, loss2, 1e-6, "loss after the errors");
  expect_same_grads(pipe_grads, grads_of(*pipe), 1e-6);
}

// On the GPU, and across GPUs.

namespace {

/// train_step against the plain model on `devices`, for every schedule and
/// every checkpointing mode.
void check_train_step(const std::vector<torch::Device>& devices) {
  torch::manual_seed(13);
  const int64_t width = 6, batch = 11;
  for (auto schedule : all_schedules()) {
    for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::ExceptLast,
                            mpipe::Checkpoint::Always}) {
      for (bool threads : {true, false}) {
        std::vector<torch::nn::Sequential> stages;
        auto pipe = ModelPipeline(
            ModelPipelineOptions().worker_threads(threads).checkpoint(checkpoint));
        for (const auto& d : devices) {
          stages.push_back(mlp_stage(width, width));
          stages.back()->to(torch::kDouble);
          pipe->append(stages.back(), d);
        }
        expect_train_step_transparent(
            pipe, stages, devices, torch::randn({batch, width}, torch::kDouble).to(devices.front()),
            torch::randn({batch, width}, torch::kDouble).to(devices.back()),
            [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); },
            schedule_options(schedule, 3, static_cast<int64_t>(devices.size())));
      }
    }
  }
}

}  // namespace

TEST(TrainStepPlacement, MatchesThePlainModelOnTheGpu_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0"), c(torch::kCPU);
  check_train_step({g, g, g, g});
  check_train_step({c, g, c, g});
}

TEST(TrainStepPlacement, AcrossGpus_MultiCUDA) {
  MPIPE_REQUIRE_CUDA(2);
  const torch::Device g0("cuda:0"), g1("cuda:1");
  check_train_step({g0, g1, g0, g1});
}

// Zero-bubble's weight pass reuses the input pass's gradients
// (Note [Split backward]).

namespace {

std::atomic<int> g_identity_backwards{0};

/// y = x, counting its backward calls: each activation-gradient pass through
/// the stage counts one.
struct CountingIdentity : torch::autograd::Function<CountingIdentity> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.view_as(x).clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    ++g_identity_backwards;
    return {g[0]};
  }
};

struct CountedImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return CountingIdentity::apply(x); }
};
TORCH_MODULE(Counted);

/// Linear, counted identity, the same Linear again when `tied`, else a second one.
struct TwoLayersImpl : torch::nn::Module {
  explicit TwoLayersImpl(bool tied)
      : a(register_module("a", torch::nn::Linear(4, 4))),
        b(tied ? a : register_module("b", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(c(a(x)))); }
  torch::nn::Linear a, b;
  Counted c;
};
TORCH_MODULE(TwoLayers);

}  // namespace

TEST(ZeroBubble, WeightGradientsComputeNoActivationGradientTwice) {
  for (bool tied : {false, true}) {
    for (bool threads : {true, false}) {
      SCOPED_TRACE(std::string(tied ? "tied weights" : "separate weights") +
                   (threads ? ", threads" : ", inline"));
      torch::manual_seed(5);
      std::vector<TwoLayers> stages{TwoLayers(tied), TwoLayers(false), TwoLayers(tied)};
      auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
      for (auto& s : stages) {
        s->to(torch::kDouble);
        pipe->append(s, "cpu");
      }
      const int64_t m = 3;
      auto x = torch::randn({2 * m, 4}, torch::kDouble);
      auto target = torch::randn({2 * m, 4}, torch::kDouble);
      g_identity_backwards = 0;
      expect_train_step_transparent(
          pipe, stages, std::vector<torch::Device>(3, torch::kCPU), x, target,
          [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); },
          TrainStepOptions(2).schedule(Schedule::ZeroBubbleH1));
      // Once per micro-batch and stage in the pipeline (the input requires
      // grad, so stage 0's I runs too), plus once per stage in the plain
      // model's backward. A tied weight (used before and after the input
      // path) makes those stages fall back and count twice per micro-batch.
      const int per_step = tied ? 2 * 2 * m + m : 3 * m;
      EXPECT_EQ(g_identity_backwards.load(), per_step + 3);
    }
  }
}

namespace {

/// Stages whose weights reach the backward by two ways: a stage with a skip
/// and its output (or two outputs) from one Linear, and a Linear applied twice
/// side by side. Split backwards must still add as backward does.
struct StashesImpl : torch::nn::Module {  // h = tanh(fc(x)), stashes h / 2
  StashesImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(fc(x));
    mpipe::stash("half", h * 0.5);
    return h;
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(Stashes);
struct TwiceImpl : torch::nn::Module {  // tanh(fc(x) + fc(2 x))
  TwiceImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x) + fc(x * 2)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Twice);
struct PopsImpl : torch::nn::Module {  // tanh(fc(x)) + the stash
  PopsImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x)) + mpipe::pop("half"); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Pops);
struct HalvesImpl : torch::nn::Module {  // (h, h / 2), h = tanh(fc(x))
  HalvesImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) {
    auto h = torch::tanh(fc(x));
    return {h, h * 0.5};
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(Halves);
struct SkipAddImpl : torch::nn::Module {  // tanh(fc(a)) + b
  SkipAddImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& a, const torch::Tensor& b) {
    return torch::tanh(fc(a)) + b;
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(SkipAdd);

}  // namespace

// Every split-backward schedule against GPipe, bit for bit, on stages whose
// weights reach the loss by two ways, with and without a gradient for the
// input (without one, stage 0's backward is all W): Note [Split backward].
TEST(ZeroBubble, WeightsReachedTwiceGetGPipesBits) {
  for (bool two_outputs : {false, true}) {
    for (Schedule schedule : {Schedule::ZeroBubbleH1, Schedule::ZeroBubbleV, Schedule::DualPipeV}) {
      for (bool input_grad : {false, true}) {
        for (bool threads : {true, false}) {
          SCOPED_TRACE(std::string(two_outputs ? "two outputs, " : "a skip, ") +
                       mpipe::to_string(schedule) + (input_grad ? ", input grad" : "") +
                       (threads ? ", threads" : ", inline"));
          auto build = [&] {
            torch::manual_seed(11);
            auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
            if (two_outputs) {
              pipe->append(Halves(), "cpu").append(SkipAdd(), "cpu");
            } else {
              pipe->append(Stashes(), "cpu").append(Twice(), "cpu").append(Pops(), "cpu");
            }
            while (pipe->size() < 4) pipe->append(Twice(), "cpu");
            pipe->to(torch::kDouble);
            return pipe;
          };
          torch::manual_seed(12);
          const auto x = torch::randn({8, 4}, torch::kDouble);
          const auto y = torch::randn({8, 4}, torch::kDouble);
          auto run = [&](Schedule s, torch::Tensor& x_grad) {
            auto pipe = build();
            auto xs = x.clone().requires_grad_(input_grad);
            const auto loss = pipe->train_step(xs, y, mse, TrainStepOptions(2).schedule(s));
            if (input_grad) x_grad = xs.grad();
            return std::make_pair(loss, grads_of(*pipe));
          };
          torch::Tensor want_x_grad, got_x_grad;
          const auto want = run(Schedule::GPipe, want_x_grad);
          const auto got = run(schedule, got_x_grad);
          EXPECT_TRUE(torch::equal(want.first, got.first));
          if (input_grad) EXPECT_TRUE(torch::equal(want_x_grad, got_x_grad));
          ASSERT_EQ(want.second.size(), got.second.size());
          for (const auto& g : want.second) {
            EXPECT_TRUE(torch::equal(g.second, got.second.at(g.first))) << g.first;
          }
        }
      }
    }
  }
}

// mpipe::clip_grad_norm against torch::nn::utils::clip_grad_norm_ on the plain
// model's gradients: the same norm, the same clipped gradients, for 2-, 1- and
// infinity-norms, clipped or not; bad arguments are refused and nothing moves.
TEST(ClipGradNorm, EqualsClippingThePlainModelsGradients) {
  for (double norm_type : {2.0, 1.0, 3.0, std::numeric_limits<double>::infinity()}) {
    for (double max_norm : {1e-2, 1e6}) {
      SCOPED_TRACE("norm " + std::to_string(norm_type) + ", max " + std::to_string(max_norm));
      torch::manual_seed(3);
      std::vector<torch::nn::Sequential> stages, plain;
      auto pipe = ModelPipeline();
      for (int s = 0; s < 3; ++s) {
        stages.push_back(mlp_stage(8, 8));
        plain.push_back(torch::nn::Sequential(
            std::dynamic_pointer_cast<torch::nn::SequentialImpl>(stages.back()->clone())));
        pipe->append(stages.back(), "cpu");
      }
      const auto x = torch::randn({12, 8}), y = torch::randn({12, 8}) * 5;
      pipe->train_step(x, y, mse, TrainStepOptions(4));
      torch::Tensor h = x;
      for (auto& s : plain) h = s->forward(h);
      mse(h, y).backward();
      std::vector<torch::Tensor> plain_params;
      for (auto& s : plain) {
        for (auto& p : s->parameters()) plain_params.push_back(p);
      }
      const double want = torch::nn::utils::clip_grad_norm_(plain_params, max_norm, norm_type);
      const double got = mpipe::clip_grad_norm(*pipe, max_norm, norm_type);
      EXPECT_NEAR(got, want, 1e-5 * want);
      EXPECT_GT(got, max_norm == 1e6 ? 0.0 : max_norm) << "the case must clip, or must not";
      const auto params = pipe->parameters();
      ASSERT_EQ(params.size(), plain_params.size());
      for (size_t k = 0; k < params.size(); ++k) {
        expect_close(params[k].grad(), plain_params[k].grad(), 1e-6, "gradient " + std::to_string(k));
      }
    }
  }
  auto pipe = ModelPipeline();
  pipe->append(mlp_stage(4, 4), "cpu");
  pipe->train_step(torch::randn({4, 4}), torch::randn({4, 4}), mse, TrainStepOptions(2));
  const auto before = pipe->parameters()[0].grad().clone();
  MPIPE_EXPECT_ERROR(mpipe::clip_grad_norm(*pipe, -1.0), "max_norm must not be negative", "-1");
  MPIPE_EXPECT_ERROR(mpipe::clip_grad_norm(*pipe, 1.0, 0.0), "norm_type must be positive", "0");
  EXPECT_TRUE(torch::equal(pipe->parameters()[0].grad(), before)) << "nothing scaled";
  // No gradients at all: norm 0, nothing to do.
  auto fresh = ModelPipeline();
  fresh->append(mlp_stage(4, 4), "cpu");
  EXPECT_EQ(mpipe::clip_grad_norm(*fresh, 1.0), 0.0);
}

namespace {
/// The identity, recording the thread that runs its backward.
struct RecordBackwardThread : torch::autograd::Function<RecordBackwardThread> {
  static std::thread::id seen;
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    seen = std::this_thread::get_id();
    return {grads[0]};
  }
};
std::thread::id RecordBackwardThread::seen;
}  // namespace

// Both training steps end the same way: the inputs' gradients, whole, go on
// through the caller's graph from the caller's thread after the call
// (backward_through_caller), also where the stages ran on worker threads.
TEST(TrainStepInputs, BothStepsRunTheCallersGraphOnTheCallersThread) {
  torch::manual_seed(0);
  ModelPipeline pipe(ModelPipelineOptions().worker_threads(true));
  std::vector<torch::nn::Linear> fc;
  for (int s = 0; s < 3; ++s) {
    fc.emplace_back(4, 4);
    pipe->append(fc.back(), "cpu");
  }
  const auto x0 = torch::randn({8, 4}, torch::requires_grad());
  const auto y = torch::randn({8, 4});
  auto mse = [](const torch::Tensor& out, const torch::Tensor& t) { return (out - t).pow(2).mean(); };
  auto plain = [&](const torch::Tensor& x) { return fc[2](fc[1](fc[0](x))); };
  for (const bool constant : {false, true}) {
    SCOPED_TRACE(constant ? "constant_train_step" : "train_step");
    RecordBackwardThread::seen = std::thread::id();
    x0.mutable_grad() = torch::Tensor();
    const auto x = RecordBackwardThread::apply(x0);
    if (constant) {
      pipe->constant_train_step(x, 4, y, mse, /*time_chunk=*/1);
    } else {
      pipe->train_step(x, y, mse, TrainStepOptions(mpipe::chunks(4)));
    }
    EXPECT_EQ(RecordBackwardThread::seen, std::this_thread::get_id());
    const auto got = x0.grad().clone();
    x0.mutable_grad() = torch::Tensor();
    const auto out = constant ? plain(x0) * 4 : plain(x0);  // 4 equal steps, summed
    mse(out, y).backward();
    EXPECT_TRUE(torch::allclose(got, x0.grad(), 1e-5, 1e-6)) << got << x0.grad();
  }
}

namespace {
/// fc(a) + 2 b: a stage of two inputs.
struct TwoInputsImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  TwoInputsImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(torch::Tensor a, torch::Tensor b) { return fc(a) + 2 * b; }
};
TORCH_MODULE(TwoInputs);
}  // namespace

// One tensor given as two inputs gets its gradient once, through both uses,
// in both training steps (constant_train_step's last backward catches it
// once).
TEST(TrainStepInputs, ATensorGivenTwiceGetsItsGradientOnce) {
  torch::manual_seed(0);
  TwoInputs first;
  torch::nn::Linear second(4, 4);
  ModelPipeline pipe;
  pipe->append(first, "cpu").append(second, "cpu");
  const auto x = torch::randn({6, 4}, torch::requires_grad());
  const auto y = torch::randn({6, 4});
  auto mse = [](const torch::Tensor& out, const torch::Tensor& t) { return (out - t).pow(2).mean(); };
  for (const bool constant : {false, true}) {
    SCOPED_TRACE(constant ? "constant_train_step" : "train_step");
    x.mutable_grad() = torch::Tensor();
    if (constant) {
      pipe->constant_train_step({x, x}, 3, y, mse);
    } else {
      pipe->train_step({x, x}, y, mse, TrainStepOptions(2));
    }
    const auto got = x.grad().clone();
    x.mutable_grad() = torch::Tensor();
    const auto out = second(first(x, x));
    mse(constant ? out * 3 : out, y).backward();
    EXPECT_TRUE(torch::allclose(got, x.grad(), 1e-5, 1e-6)) << got << x.grad();
  }
}
