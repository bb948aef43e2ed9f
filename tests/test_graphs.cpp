// CUDA graphs: graphed forward-type calls and graphed training steps against
// eager calls on one GPU (_CUDA tests; they skip themselves elsewhere).

#include "common.h"

#include <mpipe/autocast.h>
#include <mpipe/linear.h>
#include <mpipe/snn.h>

#include <map>

using namespace mpipe_test;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;

TEST(CudaGraphs, GraphedForwardMatchesEagerForward_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  torch::manual_seed(17);
  auto eager = ModelPipeline(ModelPipelineOptions().auto_cuda_graphs(false));
  auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  HostCalls host;
  for (int i = 0; i < 3; ++i) {
    auto s = mlp_stage(16, 16);
    eager->append(s, "cuda:0");
    graphed->append(s, "cuda:0");  // the same modules: the same parameters
  }
  graphed->append(host, "cuda:0");  // and an identity stage that counts host calls
  torch::NoGradGuard no_grad;
  int64_t calls_after_first_rounds = 0;
  for (int rep = 0; rep < 4; ++rep) {
    for (int64_t batch : {12, 7}) {  // two shapes: two graphs
      auto x = torch::randn({batch, 16}, torch::Device("cuda:0"));
      expect_close(graphed->forward(x, 4), eager->forward(x, 4), 1e-6, "forward");
    }
    if (rep == 1) calls_after_first_rounds = host->calls;
  }
  EXPECT_EQ(graphed->cuda_graphs_captured(), 2u);
  EXPECT_GT(calls_after_first_rounds, 0);
  EXPECT_EQ(host->calls, calls_after_first_rounds) << "rounds 3 and 4 must be replays";
  // In-place parameter updates (an optimizer's) reach the replays.
  for (auto& p : eager->parameters()) p.mul_(0.5);
  auto x = torch::randn({12, 16}, torch::Device("cuda:0"));
  expect_close(graphed->forward(x, 4), eager->forward(x, 4), 1e-6, "after an update");
  EXPECT_EQ(host->calls, calls_after_first_rounds) << "a replay after an update";
  // With gradients on, the call runs eagerly and is differentiable.
  torch::AutoGradMode grad_on(true);
  EXPECT_TRUE(graphed->forward(x, 4).requires_grad());
  EXPECT_EQ(host->calls, calls_after_first_rounds + 3) << "an eager run: 3 micro-batches";
  EXPECT_EQ(graphed->cuda_graphs_captured(), 2u);
}

TEST(CudaGraphs, GraphedSpikingCallsMatchEagerCalls_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  torch::manual_seed(18);
  auto eager = ModelPipeline(ModelPipelineOptions().auto_cuda_graphs(false));
  auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  std::vector<mpipe::snn::LIFNode> neurons;
  HostCalls host;
  graphed->append(host, "cuda:0");  // an identity stage that counts host calls
  for (int i = 0; i < 4; ++i) {
    neurons.emplace_back();
    torch::nn::Linear fc(32, 32);
    {
      torch::NoGradGuard no_grad;  // strong enough that every layer fires
      fc->weight.mul_(3);
      fc->bias.fill_(1.2);  // spike rate about 0.25 (checked on the CPU)
    }
    torch::nn::Sequential s(fc, neurons.back());
    eager->append(s, "cuda:0");
    graphed->append(s, "cuda:0");
  }
  torch::NoGradGuard no_grad;
  int64_t calls_after_first_rounds = 0;
  for (int rep = 0; rep < 4; ++rep) {
    if (rep == 2) calls_after_first_rounds = host->calls;
    auto x = torch::rand({8, 32}, torch::Device("cuda:0")) * 2;
    mpipe::reset_states(*eager);
    auto want = eager->constant_forward(x, 6);
    const double rate = want.mean().item<double>() / 6;
    EXPECT_TRUE(rate > 0.05 && rate < 0.95) << "spike rate " << rate
                                            << ": too few or too many spikes make the test weak";
    mpipe::reset_states(*eager);
    expect_close(graphed->constant_forward(x, 6), want, 1e-6, "constant_forward");
    for (auto& n : neurons) EXPECT_FALSE(n->holds_state()) << "reset after a graphed call";
    auto frames = torch::rand({5, 8, 32}, torch::Device("cuda:0")) * 2;
    mpipe::reset_states(*eager);
    auto want_seq = eager->sequence_forward(frames);
    mpipe::reset_states(*eager);
    expect_close(graphed->sequence_forward(frames), want_seq, 1e-6, "sequence_forward");
  }
  EXPECT_EQ(graphed->cuda_graphs_captured(), 2u) << "constant_forward and sequence_forward";
  EXPECT_GT(calls_after_first_rounds, 0);
  EXPECT_EQ(host->calls, calls_after_first_rounds) << "rounds 3 and 4 must be replays";
}

namespace {

/// A deep copy of a Sequential, for a second pipeline with equal parameters.
torch::nn::Sequential copy_of(const torch::nn::Sequential& s) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s->clone()));
}

/// Two spiking stages with equal weights, Linear(32, 32) then a LIF neuron,
/// strong enough that every layer fires; separate modules (neurons are not
/// Cloneable).
std::pair<torch::nn::Sequential, torch::nn::Sequential> firing_stages() {
  torch::nn::Linear fc(32, 32);
  {
    torch::NoGradGuard no_grad;
    fc->weight.mul_(3);
    fc->bias.fill_(1.2);
  }
  auto fc_copy = std::dynamic_pointer_cast<torch::nn::LinearImpl>(fc->clone());
  return {torch::nn::Sequential(fc, mpipe::snn::LIFNode()),
          torch::nn::Sequential(torch::nn::Linear(fc_copy), mpipe::snn::LIFNode())};
}

/// Clears or zeroes gradients the ways users do, by step number: set to None,
/// zeroed in place, or kept (accumulate).
void prepare_grads(torch::nn::Module& m, int step) {
  for (auto& p : m.parameters()) {
    if (!p.grad().defined()) continue;
    if (step % 3 == 0) p.mutable_grad() = torch::Tensor();
    if (step % 3 == 1) p.mutable_grad().zero_();
  }
}

}  // namespace

TEST(CudaGraphs, GraphedTrainStepMatchesEagerSteps_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (auto schedule : all_schedules()) {
    SCOPED_TRACE(schedule_name(schedule));
    torch::manual_seed(19);
    auto eager = ModelPipeline(ModelPipelineOptions().auto_cuda_graphs(false));
    auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
    HostCalls host;
    for (int i = 0; i < 3; ++i) {
      auto s = mlp_stage(16, 16);
      auto c = copy_of(s);
      if (i == 0) c->push_back(host);
      if (i == 1) {  // a parameter the step never uses: its .grad must stay None
        s->register_parameter("unused", torch::zeros({3}));
        c->register_parameter("unused", torch::zeros({3}));
      }
      eager->append(s, g);
      graphed->append(c, g);
    }
    torch::optim::SGD opt_eager(eager->parameters(), 0.1), opt_graphed(graphed->parameters(), 0.1);
    auto loss_fn = [](const torch::Tensor& y, const torch::Tensor& t) {
      return (y - t).pow(2).mean();
    };
    const auto options = schedule_options(schedule, 4, 3);
    std::vector<int64_t> calls_before;  // host calls before each step
    for (int step = 0; step < 7; ++step) {
      calls_before.push_back(host->calls);
      const int64_t batch = step == 5 ? 9 : 12;  // a second shape: a second graph
      auto x = torch::randn({batch, 16}, g), t = torch::randn({batch, 16}, g);
      prepare_grads(*eager, step);
      prepare_grads(*graphed, step);
      auto want = eager->train_step(x, t, loss_fn, options);
      auto got = graphed->train_step(x, t, loss_fn, options);
      const std::string what = "step " + std::to_string(step);
      expect_close(got, want, 1e-5, what + ": loss");
      expect_same_grads(grads_of(*graphed), grads_of(*eager), 1e-5);
      opt_eager.step();  // in-place updates reach the replays
      opt_graphed.step();
    }
    // Step 0 warmed up, step 1 captured; the batch of 9 ran eagerly once.
    EXPECT_EQ(graphed->cuda_graphs_captured(), 1u);
    calls_before.push_back(host->calls);
    EXPECT_EQ(calls_before[1] - calls_before[0], 3) << "step 0: eager warm-up";
    EXPECT_EQ(calls_before[2] - calls_before[1], 3) << "step 1: capture";
    for (int step : {2, 3, 4, 6}) {
      EXPECT_EQ(calls_before[step + 1], calls_before[step]) << "step " << step << ": a replay";
    }
    EXPECT_EQ(calls_before[6] - calls_before[5], 3) << "step 5: another shape, eager";
    for (auto* m : {static_cast<torch::nn::Module*>(eager.get()),
                    static_cast<torch::nn::Module*>(graphed.get())}) {
      EXPECT_FALSE(m->named_parameters()["stages.1.unused"].grad().defined());
    }
    // Freezing a stage after the capture: the graph is captured again and the
    // frozen parameters get no gradient.
    for (auto* m : {static_cast<torch::nn::Module*>(eager.get()),
                    static_cast<torch::nn::Module*>(graphed.get())}) {
      for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
      for (auto& p : m->named_parameters()) {
        if (p.key().rfind("stages.0.", 0) == 0) p.value().requires_grad_(false);
      }
    }
    for (int rep = 0; rep < 3; ++rep) {  // capture (the warm-up happened before), replays
      const int64_t calls = host->calls;
      auto x = torch::randn({12, 16}, g), t = torch::randn({12, 16}, g);
      expect_close(graphed->train_step(x, t, loss_fn, options),
                   eager->train_step(x, t, loss_fn, options), 1e-5, "frozen stage 0: loss");
      expect_same_grads(grads_of(*graphed), grads_of(*eager), 1e-5);
      EXPECT_FALSE(graphed->named_parameters()["stages.0.0.weight"].grad().defined());
      EXPECT_EQ(host->calls - calls, rep == 0 ? 3 : 0) << "frozen stage 0, round " << rep;
      for (auto* m : {static_cast<torch::nn::Module*>(eager.get()),
                      static_cast<torch::nn::Module*>(graphed.get())}) {
        for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
      }
    }
    for (auto* m : {static_cast<torch::nn::Module*>(eager.get()),
                    static_cast<torch::nn::Module*>(graphed.get())}) {
      for (auto& p : m->parameters()) p.requires_grad_(true);
    }
    // An input that requires grad runs eagerly and gets its gradient.
    {
      const int64_t calls = host->calls;
      auto x = torch::randn({12, 16}, g), t = torch::randn({12, 16}, g);
      auto x1 = x.clone().requires_grad_(), x2 = x.clone().requires_grad_();
      expect_close(graphed->train_step(x1, t, loss_fn, options),
                   eager->train_step(x2, t, loss_fn, options), 1e-5, "input grad: loss");
      expect_close(x1.grad(), x2.grad(), 1e-5, "grad of the input");
      EXPECT_EQ(host->calls - calls, 3) << "an input that requires grad runs eagerly";
    }
    // A .grad the user replaced by another tensor is honoured, too.
    auto x = torch::randn({12, 16}, g), t = torch::randn({12, 16}, g);
    for (auto* m : {static_cast<torch::nn::Module*>(eager.get()),
                    static_cast<torch::nn::Module*>(graphed.get())}) {
      for (auto& p : m->parameters()) p.mutable_grad() = torch::full_like(p, 0.25);
    }
    expect_close(graphed->train_step(x, t, loss_fn, options),
                 eager->train_step(x, t, loss_fn, options), 1e-5, "replaced grads: loss");
    expect_same_grads(grads_of(*graphed), grads_of(*eager), 1e-5);
  }
}

TEST(CudaGraphs, GraphedConstantTrainStepMatchesEagerSteps_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(20);
  auto eager = ModelPipeline(ModelPipelineOptions().auto_cuda_graphs(false));
  auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  for (int i = 0; i < 4; ++i) {
    const auto stages = firing_stages();
    eager->append(stages.first, g);
    graphed->append(stages.second, g);
  }
  HostCalls host;
  graphed->append(host, g);
  torch::optim::SGD opt_eager(eager->parameters(), 0.05);
  torch::optim::SGD opt_graphed(graphed->parameters(), 0.05);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& labels) {
    return torch::cross_entropy_loss(out / 6, labels);
  };
  std::vector<int64_t> calls_before;
  for (int step = 0; step < 5; ++step) {
    calls_before.push_back(host->calls);
    auto x = torch::rand({8, 32}, g) * 2;
    auto labels = torch::randint(0, 32, {8}, torch::TensorOptions(g).dtype(torch::kLong));
    prepare_grads(*eager, step);
    prepare_grads(*graphed, step);
    {
      torch::NoGradGuard no_grad;
      mpipe::reset_states(*eager);
      const double rate = eager->constant_forward(x, 6).mean().item<double>() / 6;
      EXPECT_TRUE(rate > 0.05 && rate < 0.95) << "spike rate " << rate;
    }
    auto want = eager->constant_train_step(x, 6, labels, loss_fn);
    auto got = graphed->constant_train_step(x, 6, labels, loss_fn);
    expect_close(got, want, 1e-5, "step " + std::to_string(step) + ": loss");
    expect_same_grads(grads_of(*graphed), grads_of(*eager), 1e-5);
    double grad_norm = 0;
    for (auto& p : graphed->parameters()) grad_norm += p.grad().norm().item<double>();
    EXPECT_GT(grad_norm, 0) << "surrogate gradients flow";
    opt_eager.step();
    opt_graphed.step();
  }
  EXPECT_EQ(graphed->cuda_graphs_captured(), 1u);
  calls_before.push_back(host->calls);
  EXPECT_EQ(calls_before[1] - calls_before[0], 6) << "step 0: eager warm-up, T = 6";
  EXPECT_EQ(calls_before[2] - calls_before[1], 6) << "step 1: capture";
  EXPECT_EQ(calls_before[5], calls_before[2]) << "steps 2 to 4: replays";
}

TEST(CudaGraphs, GraphedTrainStepDrawsNewDropoutMasksOnEveryReplay_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(41);
  auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  HostCalls host;
  graphed->append(torch::nn::Sequential(torch::nn::Linear(32, 32), torch::nn::Dropout(0.5)), g)
      .append(torch::nn::Sequential(torch::nn::Linear(32, 32), torch::nn::Dropout(0.5)), g)
      .append(host, g);
  auto x = torch::randn({16, 32}, g), t = torch::randn({16, 32}, g);
  auto loss_fn = [](const torch::Tensor& y, const torch::Tensor& target) {
    return torch::mse_loss(y, target);
  };
  std::vector<double> losses;
  std::vector<torch::Tensor> grads;
  int64_t calls_after_capture = 0;
  for (int step = 0; step < 6; ++step) {
    for (auto& p : graphed->parameters()) p.mutable_grad() = torch::Tensor();
    losses.push_back(graphed->train_step(x, t, loss_fn, mpipe::TrainStepOptions(4)).item<double>());
    grads.push_back(graphed->parameters()[0].grad().clone());
    if (step == 1) calls_after_capture = host->calls;
  }
  EXPECT_EQ(graphed->cuda_graphs_captured(), 1u);
  EXPECT_EQ(host->calls, calls_after_capture) << "steps 2 to 5 are replays";
  // The same input and parameters: only the masks can make replays differ.
  for (int step = 3; step < 6; ++step) {
    EXPECT_NE(losses[step], losses[step - 1]) << "replay " << step << " drew the same masks";
    EXPECT_FALSE(torch::equal(grads[step], grads[step - 1]));
  }
}

TEST(CudaGraphs, GraphedTrainStepKeepsDeferredBatchNormStatisticsLikeEager_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(42);
  auto make = [&](ModelPipelineOptions options, mpipe::DeferredBatchNorm& bn) {
    torch::manual_seed(43);
    auto pipe = ModelPipeline(options);
    bn = mpipe::DeferredBatchNorm(8);
    pipe->append(torch::nn::Linear(8, 8), g).append(bn, g);
    return pipe;
  };
  mpipe::DeferredBatchNorm bn_eager(nullptr), bn_graphed(nullptr);
  auto eager = make(ModelPipelineOptions(), bn_eager);
  HostCalls host;
  auto graphed = make(ModelPipelineOptions().cuda_graphs(true), bn_graphed);
  graphed->append(host, g);
  auto loss_fn = [](const torch::Tensor& y, const torch::Tensor& target) {
    return torch::mse_loss(y, target);
  };
  int64_t calls_after_capture = 0;
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({12, 8}, g) * (step + 1) + step, t = torch::randn({12, 8}, g);
    expect_close(graphed->train_step(x, t, loss_fn, mpipe::TrainStepOptions(4)),
                 eager->train_step(x, t, loss_fn, mpipe::TrainStepOptions(4)), 1e-5, "loss");
    expect_close(bn_graphed->running_mean, bn_eager->running_mean, 1e-5, "running_mean");
    expect_close(bn_graphed->running_var, bn_eager->running_var, 1e-5, "running_var");
    if (step == 1) calls_after_capture = host->calls;
  }
  EXPECT_EQ(graphed->cuda_graphs_captured(), 1u);
  EXPECT_EQ(host->calls, calls_after_capture) << "steps 2 to 4 are replays";
  EXPECT_EQ(bn_graphed->num_batches_tracked.item<int64_t>(), 5);
}

// Under autocast with mpipe::Linear a step sums its cast weights' gradients
// per step (Note [Cast gradients per step]); a graphed step does the same
// device work, so its replays give the eager step's loss and gradients bit
// for bit, with the option on and off.
TEST(CudaGraphs, StepsThatSumCastGradientsAreReplayedWithEagerResults_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (bool sum_casts : {true, false}) {
    SCOPED_TRACE(sum_casts ? "accumulate_cast_grads" : "accumulate_cast_grads(false)");
    torch::manual_seed(4);
    HostCalls host;
    auto eager = ModelPipeline(
        ModelPipelineOptions().auto_cuda_graphs(false).accumulate_cast_grads(sum_casts));
    auto graphed = ModelPipeline(
        ModelPipelineOptions().cuda_graphs(true).accumulate_cast_grads(sum_casts));
    const std::vector<torch::nn::Sequential> stages = {
        torch::nn::Sequential(mpipe::Linear(16, 32), torch::nn::ReLU()),
        torch::nn::Sequential(mpipe::Linear(32, 32), torch::nn::ReLU()),
        torch::nn::Sequential(mpipe::Linear(32, 4))};
    for (size_t i = 0; i < stages.size(); ++i) {
      auto c = copy_of(stages[i]);
      if (i == 0) c->push_back(host);
      eager->append(stages[i], g);
      graphed->append(c, g);
    }
    torch::optim::SGD opt_eager(eager->parameters(), 0.1), opt_graphed(graphed->parameters(), 0.1);
    auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) {
      return torch::mse_loss(o.to(torch::kFloat), t);
    };
    std::vector<int64_t> calls;
    for (int step = 0; step < 5; ++step) {
      const std::string what = "step " + std::to_string(step);
      auto x = torch::randn({8, 16}, g), y = torch::randn({8, 4}, g);
      prepare_grads(*eager, step);
      prepare_grads(*graphed, step);
      calls.push_back(host->calls);
      torch::Tensor want, got;
      {
        mpipe::AutocastGuard bf16(torch::kCUDA, torch::kBFloat16);
        want = eager->train_step(x, y, loss_fn, mpipe::TrainStepOptions(4));
        got = graphed->train_step(x, y, loss_fn, mpipe::TrainStepOptions(4));
      }
      expect_close(got, want, 0, what + ": loss");
      expect_same_grads(grads_of(*graphed), grads_of(*eager), 0);
      opt_eager.step();
      opt_graphed.step();
    }
    calls.push_back(host->calls);
    EXPECT_EQ(graphed->cuda_graphs_captured(), 1u);
    EXPECT_EQ(calls[5], calls[2]) << "steps 2 to 4 are replays";
  }
}

// Note [Automatic CUDA graphs] ----------------------------------------------

namespace {

/// A stage that reads a value on the host (.item()): it cannot be captured.
struct SyncsImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    return x * (x.abs().max().item<double>() >= 0.0 ? 2.0 : 3.0);
  }
  int64_t calls = 0;
};
TORCH_MODULE(Syncs);

/// The pipeline's output for `x` with automatic graphs off, from the same
/// stages (results of the eager runtime, which other tests hold to the plain
/// model).
torch::Tensor eager_forward(const std::vector<torch::nn::Sequential>& stages,
                            const torch::Tensor& x, int64_t split) {
  auto eager = ModelPipeline(ModelPipelineOptions().auto_cuda_graphs(false));
  for (const auto& s : stages) eager->append(s, x.device());
  return eager->forward(x, split);
}

}  // namespace

TEST(AutoCudaGraphs, RepeatedInferenceCallsAreReplayedWithEagerResults_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(23);
  auto automatic = ModelPipeline();  // default options
  HostCalls host;  // the last stage holds an identity that counts host calls
  std::vector<torch::nn::Sequential> stages;
  for (int i = 0; i < 3; ++i) stages.push_back(mlp_stage(16, 16));
  stages.back()->push_back(host);
  for (const auto& s : stages) automatic->append(s, g);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({12, 16}, g);
  const auto want = eager_forward(stages, x, 4);
  for (int call = 1; call <= 6; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    const int64_t before = host->calls;
    EXPECT_TRUE(torch::equal(automatic->forward(x, 4), want)) << "bit for bit";
    EXPECT_EQ(automatic->cuda_graphs_captured(), call >= 3 ? 1u : 0u) << "captured on the third";
    if (call <= 2) EXPECT_EQ(host->calls, before + 3) << "eager: 3 micro-batches";
    if (call >= 4) EXPECT_EQ(host->calls, before) << "a replay runs no host code";
  }
  // Replays take the call's seed from the CPU generator, as eager calls do.
  torch::manual_seed(5);
  eager_forward(stages, x, 4);
  const auto after_eager = torch::rand({4});
  torch::manual_seed(5);
  automatic->forward(x, 4);
  EXPECT_TRUE(torch::equal(torch::rand({4}), after_eager)) << "the CPU generator after a replay";
  // In-place updates (an optimizer's) reach the replay. (eager_forward runs
  // the same stages, so it counts host calls too: it runs first.)
  for (auto& p : automatic->parameters()) p.mul_(0.5);
  auto updated = eager_forward(stages, x, 4);
  int64_t replayed = host->calls;
  EXPECT_TRUE(torch::equal(automatic->forward(x, 4), updated));
  EXPECT_EQ(host->calls, replayed) << "after an in-place update";
  // Parameters moved to new storage: the graph is captured again.
  for (auto& p : automatic->parameters()) p.set_data(p.detach().clone() * 2);
  updated = eager_forward(stages, x, 4);
  replayed = host->calls;
  EXPECT_TRUE(torch::equal(automatic->forward(x, 4), updated));
  EXPECT_EQ(automatic->cuda_graphs_captured(), 1u);
  EXPECT_GT(host->calls, replayed) << "a new capture after the storage moved";
  // Another split and another shape: two eager runs each before a capture.
  // Split 1 makes 12 micro-batches: the replay's 8 lanes (Note [Lanes]) each
  // take one, and lanes 0-3 a second.
  const auto x2 = torch::randn({5, 16}, g);
  for (int call = 1; call <= 3; ++call) {
    EXPECT_TRUE(torch::equal(automatic->forward(x, 2), eager_forward(stages, x, 2)));
    EXPECT_TRUE(torch::equal(automatic->forward(x2, 4), eager_forward(stages, x2, 4)));
    EXPECT_TRUE(torch::equal(automatic->forward(x, 1), eager_forward(stages, x, 1)));
  }
  EXPECT_EQ(automatic->cuda_graphs_captured(), 4u);
  // Gradients on: eager, differentiable, nothing captured.
  {
    torch::AutoGradMode grad_on(true);
    for (int call = 0; call < 3; ++call) EXPECT_TRUE(automatic->forward(x, 3).requires_grad());
  }
  EXPECT_EQ(automatic->cuda_graphs_captured(), 4u);
  automatic->clear_cuda_graphs();
  EXPECT_EQ(automatic->cuda_graphs_captured(), 0u);
  // Switched off: every call eager.
  automatic->options.auto_cuda_graphs(false);
  for (int call = 0; call < 4; ++call) automatic->forward(x, 4);
  EXPECT_EQ(automatic->cuda_graphs_captured(), 0u);
}

TEST(AutoCudaGraphs, CallsThatDrawHoldStateOrCannotBeCapturedStayEager_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(24);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({8, 16}, g);
  {  // Dropout in training mode draws: replays would draw other masks.
    torch::nn::Sequential drop(torch::nn::Linear(16, 16), torch::nn::Dropout(0.5));
    auto pipe = ModelPipeline();
    pipe->append(mlp_stage(16, 16), g).append(drop, g);
    torch::Tensor previous;
    for (int call = 0; call < 5; ++call) {
      const auto y = pipe->forward(x, 2);
      if (previous.defined()) EXPECT_FALSE(torch::equal(y, previous)) << "new masks every call";
      previous = y;
    }
    EXPECT_EQ(pipe->cuda_graphs_captured(), 0u) << "a call that draws";
    pipe->eval();  // no draws in eval mode: captured
    for (int call = 0; call < 4; ++call) pipe->forward(x, 2);
    EXPECT_EQ(pipe->cuda_graphs_captured(), 1u) << "the same stages in eval mode";
  }
  {  // A stateful stage: state carries from call to call, as without graphs.
    torch::manual_seed(25);
    Leaky a(16), b(16);
    torch::manual_seed(25);
    Leaky a2(16), b2(16);
    auto automatic = ModelPipeline();
    auto eager = ModelPipeline(ModelPipelineOptions().auto_cuda_graphs(false));
    automatic->append(a, g).append(b, g);
    eager->append(a2, g).append(b2, g);
    for (int call = 0; call < 5; ++call) {
      EXPECT_TRUE(torch::equal(automatic->forward(x, 2), eager->forward(x, 2))) << "call " << call;
    }
    EXPECT_EQ(automatic->cuda_graphs_captured(), 0u) << "a stateful stage";
  }
  {  // A stage that synchronises: its capture fails unseen, and it stays eager.
    Syncs syncs;
    auto pipe = ModelPipeline();
    auto first = mlp_stage(16, 16);
    pipe->append(first, g).append(syncs, g);
    const auto want = first->forward(x) * 2.0;
    for (int call = 0; call < 6; ++call) {
      expect_close(pipe->forward(x, 8), want, 1e-6, "call " + std::to_string(call));
    }
    EXPECT_EQ(pipe->cuda_graphs_captured(), 0u);
    EXPECT_EQ(syncs->calls, 6 + 2) << "6 eager calls, the capture's warm-up and its try";
  }
  {  // A timeline, or memory tracking: every call eager.
    for (int which = 0; which < 2; ++which) {
      auto pipe = ModelPipeline(
          ModelPipelineOptions().record_timeline(which == 0).track_memory(which == 1));
      pipe->append(mlp_stage(16, 16), g).append(mlp_stage(16, 16), g);
      for (int call = 0; call < 4; ++call) pipe->forward(x, 2);
      EXPECT_EQ(pipe->cuda_graphs_captured(), 0u) << (which == 0 ? "timeline" : "memory");
    }
  }
}

// A stage switched to training mode on its own (the pipeline's flag
// unchanged), here a BatchNorm, which updates its running statistics in every
// call: such calls run eagerly, each updating them once, as without graphs.
TEST(AutoCudaGraphs, AStageWithBuffersInTrainingModeRunsEagerly_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(26);
  torch::nn::BatchNorm1d bn(16);
  torch::nn::Sequential norm(torch::nn::Linear(16, 16), bn);
  auto first = mlp_stage(16, 16);
  auto pipe = ModelPipeline();
  pipe->append(first, g).append(norm, g);
  pipe->eval();
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({8, 16}, g);
  for (int call = 0; call < 4; ++call) pipe->forward(x, 4);
  EXPECT_EQ(pipe->cuda_graphs_captured(), 1u) << "eval mode: replayed";
  norm->train();  // this stage alone: batch statistics, running statistics updated
  for (int call = 0; call < 4; ++call) {
    const int64_t before = bn->num_batches_tracked.item<int64_t>();
    const auto got = pipe->forward(x, 4);
    EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), before + 2) << "once per micro-batch";
    const auto h = first->forward(x);
    const auto want = torch::cat({torch::batch_norm(norm[0]->as<torch::nn::Linear>()->forward(h.narrow(0, 0, 4)),
                                                    bn->weight, bn->bias, {}, {}, true, 0.1, 1e-5, false),
                                  torch::batch_norm(norm[0]->as<torch::nn::Linear>()->forward(h.narrow(0, 4, 4)),
                                                    bn->weight, bn->bias, {}, {}, true, 0.1, 1e-5, false)});
    expect_close(got, want, 1e-5, "batch statistics, call " + std::to_string(call));
  }
  EXPECT_EQ(pipe->cuda_graphs_captured(), 1u) << "no graph of the training-mode stage";
}

// Note [Automatic graphs of training steps] ------------------------------------

namespace {

/// Two pipelines of equal stages on `g`: default options (automatic graphs)
/// and automatic graphs off; the first's stage 0 ends in `host`.
std::pair<ModelPipeline, ModelPipeline> auto_and_eager(const std::vector<torch::nn::Sequential>& stages,
                                                       const torch::Device& g, HostCalls host) {
  auto automatic = ModelPipeline();
  auto eager = ModelPipeline(ModelPipelineOptions().auto_cuda_graphs(false));
  for (size_t i = 0; i < stages.size(); ++i) {
    auto c = copy_of(stages[i]);
    if (i == 0) c->push_back(host);
    automatic->append(c, g);
    eager->append(stages[i], g);
  }
  return {automatic, eager};
}

}  // namespace

// With default options a repeated training step is captured at its fourth
// call (two eager runs, the warm-up, the capture) and replayed from then on,
// with the eager step's loss and gradients bit for bit: fp32, and bf16
// autocast with mpipe::Linear summing its cast gradients; every schedule.
TEST(AutoCudaGraphs, RepeatedTrainingStepsAreReplayedWithEagerResults_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (bool bf16 : {false, true}) {
    for (auto schedule : all_schedules()) {
      SCOPED_TRACE(std::string(bf16 ? "bf16, " : "fp32, ") + schedule_name(schedule));
      torch::manual_seed(27);
      std::vector<torch::nn::Sequential> stages;
      for (int i = 0; i < 3; ++i) {
        if (bf16) {
          stages.emplace_back(mpipe::Linear(16, 16), torch::nn::GELU());
        } else {
          stages.push_back(mlp_stage(16, 16));
        }
      }
      HostCalls host;
      auto pipes = auto_and_eager(stages, g, host);
      auto& automatic = pipes.first;
      auto& eager = pipes.second;
      torch::optim::SGD opt_auto(automatic->parameters(), 0.1), opt_eager(eager->parameters(), 0.1);
      auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) {
        return torch::mse_loss(o.to(torch::kFloat), t);
      };
      const auto options = schedule_options(schedule, 4, 3);
      std::vector<int64_t> calls;
      for (int step = 0; step < 7; ++step) {
        const std::string what = "step " + std::to_string(step);
        auto x = torch::randn({12, 16}, g), t = torch::randn({12, 16}, g);
        prepare_grads(*automatic, step);
        prepare_grads(*eager, step);
        calls.push_back(host->calls);
        torch::Tensor got, want;
        {
          c10::optional<mpipe::AutocastGuard> cast;
          if (bf16) cast.emplace(torch::kCUDA, torch::kBFloat16);
          got = automatic->train_step(x, t, loss_fn, options);
          want = eager->train_step(x, t, loss_fn, options);
        }
        expect_close(got, want, 0, what + ": loss");
        expect_same_grads(grads_of(*automatic), grads_of(*eager), 0);
        EXPECT_EQ(automatic->cuda_graphs_captured(), step >= 3 ? 1u : 0u) << what;
        opt_auto.step();
        opt_eager.step();
      }
      calls.push_back(host->calls);
      for (int step = 0; step < 4; ++step) {
        EXPECT_EQ(calls[step + 1] - calls[step], 3) << "step " << step << " ran its host code";
      }
      EXPECT_EQ(calls[7], calls[4]) << "steps 4 to 6 are replays";
      // Another loss function is another graph: its first steps run eagerly.
      auto other = [](const torch::Tensor& o, const torch::Tensor& t) {
        return (o.to(torch::kFloat) - t).abs().mean();
      };
      const int64_t before = host->calls;
      auto x = torch::randn({12, 16}, g), t = torch::randn({12, 16}, g);
      {
        c10::optional<mpipe::AutocastGuard> cast;
        if (bf16) cast.emplace(torch::kCUDA, torch::kBFloat16);
        expect_close(automatic->train_step(x, t, other, options),
                     eager->train_step(x, t, other, options), 0, "another loss");
      }
      EXPECT_EQ(host->calls - before, 3) << "another loss function ran eagerly";
    }
  }
}

// constant_train_step starts and ends from reset state, so stateful neurons
// do not keep it from being replayed.
TEST(AutoCudaGraphs, ConstantTrainStepsOfNeuronsAreReplayedWithEagerResults_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(28);
  auto automatic = ModelPipeline();
  auto eager = ModelPipeline(ModelPipelineOptions().auto_cuda_graphs(false));
  HostCalls host;
  for (int i = 0; i < 3; ++i) {
    auto stages = firing_stages();
    eager->append(stages.first, g);
    if (i == 0) stages.second->push_back(host);
    automatic->append(stages.second, g);
  }
  torch::optim::SGD opt_auto(automatic->parameters(), 0.05), opt_eager(eager->parameters(), 0.05);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& labels) {
    return torch::cross_entropy_loss(out / 6, labels);
  };
  std::vector<int64_t> calls;
  for (int step = 0; step < 6; ++step) {
    auto x = torch::rand({8, 32}, g) * 2;
    auto labels = torch::randint(0, 32, {8}, torch::TensorOptions(g).dtype(torch::kLong));
    zero_grads(*automatic);
    zero_grads(*eager);
    calls.push_back(host->calls);
    expect_close(automatic->constant_train_step(x, 6, labels, loss_fn),
                 eager->constant_train_step(x, 6, labels, loss_fn), 0,
                 "step " + std::to_string(step) + ": loss");
    expect_same_grads(grads_of(*automatic), grads_of(*eager), 0);
    opt_auto.step();
    opt_eager.step();
  }
  calls.push_back(host->calls);
  EXPECT_EQ(automatic->cuda_graphs_captured(), 1u);
  EXPECT_EQ(calls[4] - calls[3], 6) << "step 3 captured (T = 6)";
  EXPECT_EQ(calls[6], calls[4]) << "steps 4 and 5 are replays";
}

// Steps a replay could not repeat exactly stay eager: dropout draws, stateful
// modules in train_step, checkpointing, an input that needs its gradient. A
// gradient the caller kept from a replayed step is never written over: the
// key runs eagerly from then on.
TEST(AutoCudaGraphs, StepsThatCannotBeReplayedExactlyStayEager_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(29);
  const auto x = torch::randn({8, 16}, g), t = torch::randn({8, 16}, g);
  {  // Dropout in training mode.
    auto pipe = ModelPipeline();
    pipe->append(mlp_stage(16, 16), g)
        .append(torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Dropout(0.5)), g);
    for (int step = 0; step < 6; ++step) pipe->train_step(x, t, mse, mpipe::TrainStepOptions(2));
    EXPECT_EQ(pipe->cuda_graphs_captured(), 0u) << "a step that draws";
  }
  {  // A stateful module in train_step: its state carries on, as without graphs.
    auto pipe = ModelPipeline();
    pipe->append(mlp_stage(16, 16), g).append(Leaky(16), g);
    for (int step = 0; step < 6; ++step) {
      mpipe::reset_states(*pipe);  // no state held when the step starts
      pipe->train_step(x, t, mse, mpipe::TrainStepOptions(2));
    }
    EXPECT_EQ(pipe->cuda_graphs_captured(), 0u) << "a stateful module";
  }
  {  // Checkpointing, and an input that requires grad.
    auto pipe = ModelPipeline(ModelPipelineOptions().checkpoint(mpipe::Checkpoint::Always));
    pipe->append(mlp_stage(16, 16), g).append(mlp_stage(16, 16), g);
    for (int step = 0; step < 6; ++step) pipe->train_step(x, t, mse, mpipe::TrainStepOptions(2));
    EXPECT_EQ(pipe->cuda_graphs_captured(), 0u) << "checkpointing";
    auto plain = ModelPipeline();
    plain->append(mlp_stage(16, 16), g).append(mlp_stage(16, 16), g);
    const auto xg = x.clone().requires_grad_();
    for (int step = 0; step < 6; ++step) plain->train_step(xg, t, mse, mpipe::TrainStepOptions(2));
    EXPECT_EQ(plain->cuda_graphs_captured(), 0u) << "an input that needs its gradient";
    EXPECT_TRUE(xg.grad().defined());
  }
  {  // A kept gradient.
    HostCalls host;
    auto pipes = auto_and_eager({mlp_stage(16, 16), mlp_stage(16, 16)}, g, host);
    auto& automatic = pipes.first;
    auto& eager = pipes.second;
    for (int step = 0; step < 5; ++step) {
      zero_grads(*automatic);
      zero_grads(*eager);
      automatic->train_step(x, t, mse, mpipe::TrainStepOptions(2));
      eager->train_step(x, t, mse, mpipe::TrainStepOptions(2));
    }
    ASSERT_EQ(automatic->cuda_graphs_captured(), 1u);
    std::vector<torch::Tensor> kept, copies;
    for (const auto& p : automatic->parameters()) {
      kept.push_back(p.grad());
      copies.push_back(p.grad().clone());
    }
    for (int step = 0; step < 2; ++step) {
      zero_grads(*automatic);
      zero_grads(*eager);
      const int64_t before = host->calls;
      const auto x2 = torch::randn({8, 16}, g);
      expect_close(automatic->train_step(x2, t, mse, mpipe::TrainStepOptions(2)),
                   eager->train_step(x2, t, mse, mpipe::TrainStepOptions(2)), 0, "after keeping");
      expect_same_grads(grads_of(*automatic), grads_of(*eager), 0);
      EXPECT_EQ(host->calls - before, 4) << "step " << step << " after keeping ran eagerly";
    }
    for (size_t k = 0; k < kept.size(); ++k) {
      EXPECT_TRUE(torch::equal(kept[k], copies[k])) << "the kept gradient " << k << " is unchanged";
    }
    EXPECT_EQ(automatic->cuda_graphs_captured(), 0u);
  }
}
