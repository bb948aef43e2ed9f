// Loss scaling: GradScaler (unscaling, skipped steps, growth and back-off,
// misuse, state) and TrainStepOptions::loss_scale under every schedule.

#include "common.h"

#include <mpipe/grad_scaler.h>

#include <torch/optim/sgd.h>

#include <cmath>
#include <limits>

using namespace mpipe_test;
using mpipe::GradScaler;
using mpipe::GradScalerOptions;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::TrainStepOptions;

namespace {
torch::nn::Linear small_linear() {
  torch::manual_seed(41);
  return torch::nn::Linear(4, 3);
}
}  // namespace

TEST(GradScaler, UnscalesBeforeTheStepAndGrowsAfterGoodSteps) {
  auto net = small_linear(), ref = small_linear();
  torch::optim::SGD opt(net->parameters(), 0.1), opt_ref(ref->parameters(), 0.1);
  GradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(2));
  const auto x = torch::randn({5, 4});
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    opt_ref.zero_grad();
    const double s = scaler.get_scale();
    auto loss = net(x).pow(2).mean();
    auto scaled = scaler.scale(loss);
    EXPECT_DOUBLE_EQ(scaled.item<double>(), loss.item<double>() * s);
    scaled.backward();
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
    ref(x).pow(2).mean().backward();
    opt_ref.step();
    for (size_t k = 0; k < ref->parameters().size(); ++k) {
      expect_close(net->parameters()[k], ref->parameters()[k], 1e-6, "parameter after step");
    }
  }
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 2048) << "grown once after 2 good steps";
  EXPECT_EQ(scaler.growth_tracker(), 1);
}

TEST(GradScaler, SkipsStepsWithInfOrNanAndBacksOff) {
  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    auto net = small_linear();
    torch::optim::SGD opt(net->parameters(), 0.1);
    GradScaler scaler(GradScalerOptions().init_scale(256));
    const auto before = net->weight.detach().clone();
    scaler.scale(net(torch::randn({2, 4})).sum()).backward();
    net->bias.mutable_grad()[1] = bad;  // an overflow
    scaler.unscale_(opt);
    EXPECT_TRUE(scaler.found_inf(opt));
    EXPECT_FALSE(scaler.step(opt)) << "the step is skipped";
    expect_close(net->weight, before, 0, "weights untouched");
    scaler.update();
    EXPECT_DOUBLE_EQ(scaler.get_scale(), 128);
    EXPECT_EQ(scaler.growth_tracker(), 0);
  }
}

TEST(GradScaler, MisuseIsRefusedAndOptionsChecked) {
  auto net = small_linear();
  torch::optim::SGD opt(net->parameters(), 0.1);
  GradScaler scaler;
  MPIPE_EXPECT_ERROR(scaler.update(), "no unscale_() or step()");
  scaler.scale(net(torch::randn({2, 4})).sum()).backward();
  scaler.unscale_(opt);
  MPIPE_EXPECT_ERROR(scaler.unscale_(opt), "already called");
  EXPECT_TRUE(scaler.step(opt));
  MPIPE_EXPECT_ERROR(scaler.step(opt), "already called");
  scaler.update();
  EXPECT_DOUBLE_EQ(scaler.get_scale(), 65536) << "one good step does not grow it";
  MPIPE_EXPECT_ERROR((void)GradScaler(GradScalerOptions().init_scale(0)), "init_scale", "0");
  MPIPE_EXPECT_ERROR((void)GradScaler(GradScalerOptions().growth_factor(1)), "growth_factor");
  MPIPE_EXPECT_ERROR((void)GradScaler(GradScalerOptions().backoff_factor(1.5)), "backoff_factor", "1.5");
  MPIPE_EXPECT_ERROR((void)GradScaler(GradScalerOptions().growth_interval(0)), "growth_interval");
  MPIPE_EXPECT_ERROR(scaler.update(-1), "positive", "-1");
  MPIPE_EXPECT_ERROR(scaler.scale(torch::Tensor()), "undefined");
}

TEST(GradScaler, DisabledIsPlainTrainingAndStateRoundTrips) {
  auto net = small_linear();
  torch::optim::SGD opt(net->parameters(), 0.1);
  GradScaler off(GradScalerOptions().enabled(false));
  const auto loss = net(torch::randn({2, 4})).sum();
  EXPECT_TRUE(off.scale(loss).is_same(loss));
  EXPECT_DOUBLE_EQ(off.get_scale(), 1);
  loss.backward();
  EXPECT_TRUE(off.step(opt));
  off.update();

  GradScaler a(GradScalerOptions().init_scale(512).growth_interval(3));
  a.update(96);
  torch::serialize::OutputArchive out;
  a.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  GradScaler b;
  b.load(in);
  EXPECT_DOUBLE_EQ(b.get_scale(), 96);
  EXPECT_EQ(b.growth_tracker(), 0);
}

TEST(GradScaler, TrainStepLossScaleUnderEveryScheduleGivesScaledGradients) {
  torch::manual_seed(42);
  std::vector<torch::nn::Sequential> stages{mlp_stage(6, 6), mlp_stage(6, 6)};
  for (auto& s : stages) s->to(torch::kDouble);
  const auto x = torch::randn({8, 6}, torch::kDouble);
  const auto target = torch::randn({8, 6}, torch::kDouble);
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); };
  for (bool threads : {true, false}) {
    ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads));
    for (auto& s : stages) pipe->append(s, "cpu");
    for (auto schedule : all_schedules()) {
      SCOPED_TRACE(schedule_name(schedule) + (threads ? ", threads" : ", inline"));
      const auto opts = schedule_options(schedule, 2, 2);
      const auto loss = pipe->train_step(x, target, loss_fn, opts);
      const auto grads = grads_of(*pipe);
      zero_grads(*pipe);
      const auto scaled_loss =
          pipe->train_step(x, target, loss_fn, TrainStepOptions(opts).loss_scale(1024));
      expect_close(scaled_loss, loss, 1e-12, "the returned loss is not scaled");
      for (const auto& kv : grads_of(*pipe)) {
        expect_close(kv.second, grads.at(kv.first) * 1024, 1e-9, "scaled grad of " + kv.first);
      }
      // The scaler's step brings them back.
      torch::optim::SGD opt(pipe->parameters(), 0.0);
      GradScaler scaler(GradScalerOptions().init_scale(1024));
      EXPECT_TRUE(scaler.step(opt));
      for (const auto& kv : grads_of(*pipe)) {
        expect_close(kv.second, grads.at(kv.first), 1e-12, "unscaled grad of " + kv.first);
      }
      zero_grads(*pipe);
    }
    for (double bad : {0.0, -2.0, std::nan("")}) {
      MPIPE_EXPECT_ERROR(
          pipe->train_step(x, target, loss_fn, TrainStepOptions(2).loss_scale(bad)), "loss_scale");
    }
    pipe->train_step(x, target, loss_fn, TrainStepOptions(2));  // still usable
    zero_grads(*pipe);
  }
}
