// GPU tests: names end in _CUDA (one GPU) or _MultiCUDA (two or more) and skip
// themselves elsewhere. On a one-GPU machine all CUDA stages sit on cuda:0,
// each with its own stream.

#include "common.h"

#include <mpipe/snn.h>

#ifdef MPIPE_TEST_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

#include <chrono>
#include <iostream>
#include <map>
#include <sstream>

using namespace mpipe_test;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// Builds stages and the matching pipeline on `devices`, runs forward with
/// several splits and input devices, and compares output and gradients with
/// the plain model.
void check_forward_transparent(const std::vector<torch::Device>& devices, bool threads) {
  torch::manual_seed(7);
  const int64_t width = 8, batch = 12;
  std::vector<torch::nn::Sequential> stages;
  auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
  for (auto& d : devices) {
    stages.push_back(mlp_stage(width, width));
    stages.back()->to(torch::kDouble);
    pipe->append(stages.back(), d);
  }
  for (torch::Device input_device : {torch::Device(torch::kCPU), devices.front(), devices.back()}) {
    for (int64_t split : {1, 5, 12}) {
      SCOPED_TRACE("input on " + input_device.str() + ", split " + std::to_string(split));
      auto x = torch::randn({batch, width}, torch::kDouble).to(input_device);
      expect_transparent(
          *pipe, x,
          [&](const torch::Tensor& in) {
            auto y = pipe->forward(in, split);
            EXPECT_EQ(y.device(), pipe->output_device());
            return y;
          },
          [&](const torch::Tensor& in) { return plain_forward(stages, devices, in); });
    }
  }
}

void check_constant_forward_transparent(const std::vector<torch::Device>& devices, bool threads) {
  torch::manual_seed(8);
  const int64_t width = 6;
  std::vector<Leaky> stages;
  auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
  for (size_t i = 0; i < devices.size(); ++i) {
    stages.emplace_back(width, 0.2 + 0.15 * static_cast<double>(i));
    stages.back()->to(torch::kDouble);
    pipe->append(stages.back(), devices[i]);
  }
  for (int64_t T : {1, 3, 7}) {
    for (bool reduce : {true, false}) {
      SCOPED_TRACE("T " + std::to_string(T) + " reduce " + std::to_string(reduce));
      auto x = torch::randn({4, width}, torch::kDouble).to(devices.front());
      auto reset = [&] {
        for (auto& s : stages) s->reset_state();
      };
      expect_transparent(
          *pipe, x,
          [&](const torch::Tensor& in) {
            reset();
            return pipe->constant_forward(in, T, reduce);
          },
          [&](const torch::Tensor& in) {
            reset();
            std::vector<torch::Tensor> outs;
            for (int64_t t = 0; t < T; ++t) outs.push_back(plain_forward(stages, devices, in));
            return reduce ? torch::stack(outs).sum(0) : torch::cat(outs, 0);
          });
    }
  }
}

}  // namespace

TEST(Cuda, ForwardAllStagesOnOneGpu_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (bool threads : {true, false}) check_forward_transparent({g, g, g, g}, threads);
}

TEST(Cuda, ConstantForwardAllStagesOnOneGpu_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (bool threads : {true, false}) check_constant_forward_transparent({g, g, g}, threads);
}

TEST(Cuda, MixedCpuAndGpuStages_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0"), c(torch::kCPU);
  for (bool threads : {true, false}) {
    check_forward_transparent({c, g, c, g}, threads);
    check_forward_transparent({g, c, g, g}, threads);
    check_constant_forward_transparent({g, c, g}, threads);
  }
}

TEST(Cuda, DevicesAndMoves_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const int64_t n = mpipe::cuda_device_count();
  auto pipe = ModelPipeline();
  pipe->append(torch::nn::Linear(3, 3), 0).append(torch::nn::Linear(3, 3), "0");
  pipe->append(torch::nn::Linear(3, 3), "cuda:0");
  EXPECT_EQ(pipe->device(1), torch::Device("cuda:0"));
  MPIPE_EXPECT_ERROR(pipe->append(torch::nn::Linear(3, 3), static_cast<int>(n)), "stage 3",
                     "beyond the CUDA device count", "only " + std::to_string(n));
  pipe->to(torch::Device("cuda:0"), torch::kDouble);  // already there: allowed
  pipe->to(torch::kCUDA);
  for (auto& p : pipe->parameters()) {
    EXPECT_EQ(p.device(), torch::Device("cuda:0"));
    EXPECT_EQ(p.scalar_type(), torch::kDouble);
  }
  MPIPE_EXPECT_ERROR(pipe->to(torch::kCPU), "placement", "stage 0 is on cuda:0");
  for (auto& p : pipe->parameters()) EXPECT_EQ(p.device(), torch::Device("cuda:0"));
}

TEST(Cuda, LoadPutsStagesBackOnTheirDevices_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  auto pipe = ModelPipeline();
  pipe->append(torch::nn::Linear(3, 4), "cpu").append(torch::nn::Linear(4, 2), "cuda:0");
  std::stringstream buffer;
  torch::save(pipe, buffer);
  auto other = ModelPipeline();
  other->append(torch::nn::Linear(3, 4), "cpu").append(torch::nn::Linear(4, 2), "cuda:0");
  torch::load(other, buffer, torch::Device(torch::kCPU));  // mapped to one device on read
  EXPECT_EQ(other->stage(1)->parameters()[0].device(), torch::Device("cuda:0"));
  auto x = torch::randn({5, 3});
  expect_close(pipe->forward(x, 2), other->forward(x, 2), 1e-6);
}

namespace {

/// train_step against the plain model on `devices`, for both schedules and
/// every checkpointing mode.
void check_train_step(const std::vector<torch::Device>& devices) {
  torch::manual_seed(13);
  const int64_t width = 6, batch = 11;
  for (auto schedule : {mpipe::Schedule::GPipe, mpipe::Schedule::OneFOneB}) {
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
            mpipe::TrainStepOptions(3).schedule(schedule));
      }
    }
  }
}

}  // namespace

TEST(Cuda, TrainStepMatchesThePlainModel_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0"), c(torch::kCPU);
  check_train_step({g, g, g, g});
  check_train_step({c, g, c, g});
}

TEST(MultiCuda, TrainStepAcrossGpus_MultiCUDA) {
  MPIPE_REQUIRE_CUDA(2);
  const torch::Device g0("cuda:0"), g1("cuda:1");
  check_train_step({g0, g1, g0, g1});
}

TEST(Cuda, GraphedForwardMatchesEagerForward_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  torch::manual_seed(17);
  auto eager = ModelPipeline();
  auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  for (int i = 0; i < 3; ++i) {
    auto s = mlp_stage(16, 16);
    eager->append(s, "cuda:0");
    graphed->append(s, "cuda:0");  // the same modules: the same parameters
  }
  torch::NoGradGuard no_grad;
  for (int rep = 0; rep < 3; ++rep) {
    for (int64_t batch : {12, 7}) {  // two shapes: two graphs
      auto x = torch::randn({batch, 16}, torch::Device("cuda:0"));
      expect_close(graphed->forward(x, 4), eager->forward(x, 4), 1e-6, "forward");
    }
  }
  // In-place parameter updates (an optimizer's) reach the replays.
  for (auto& p : eager->parameters()) p.mul_(0.5);
  auto x = torch::randn({12, 16}, torch::Device("cuda:0"));
  expect_close(graphed->forward(x, 4), eager->forward(x, 4), 1e-6, "after an update");
  // With gradients on, the call runs eagerly and is differentiable.
  torch::AutoGradMode grad_on(true);
  EXPECT_TRUE(graphed->forward(x, 4).requires_grad());
}

TEST(Cuda, GraphedSpikingCallsMatchEagerCalls_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  torch::manual_seed(18);
  auto eager = ModelPipeline();
  auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  std::vector<mpipe::snn::LIFNode> neurons;
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
  for (int rep = 0; rep < 3; ++rep) {
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
}

namespace {

/// A deep copy of a Sequential, for a second pipeline with equal parameters.
torch::nn::Sequential copy_of(const torch::nn::Sequential& s) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s->clone()));
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

TEST(Cuda, GraphedTrainStepMatchesEagerSteps_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (auto schedule : {mpipe::Schedule::GPipe, mpipe::Schedule::OneFOneB}) {
    torch::manual_seed(19);
    auto eager = ModelPipeline();
    auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
    for (int i = 0; i < 3; ++i) {
      auto s = mlp_stage(16, 16);
      auto c = copy_of(s);
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
    const auto options = mpipe::TrainStepOptions(4).schedule(schedule);
    for (int step = 0; step < 7; ++step) {
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
    for (int rep = 0; rep < 3; ++rep) {  // warm-up, capture, replay
      auto x = torch::randn({12, 16}, g), t = torch::randn({12, 16}, g);
      expect_close(graphed->train_step(x, t, loss_fn, options),
                   eager->train_step(x, t, loss_fn, options), 1e-5, "frozen stage 0: loss");
      expect_same_grads(grads_of(*graphed), grads_of(*eager), 1e-5);
      EXPECT_FALSE(graphed->named_parameters()["stages.0.0.weight"].grad().defined());
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
      auto x = torch::randn({12, 16}, g), t = torch::randn({12, 16}, g);
      auto x1 = x.clone().requires_grad_(), x2 = x.clone().requires_grad_();
      expect_close(graphed->train_step(x1, t, loss_fn, options),
                   eager->train_step(x2, t, loss_fn, options), 1e-5, "input grad: loss");
      expect_close(x1.grad(), x2.grad(), 1e-5, "grad of the input");
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

TEST(Cuda, GraphedConstantTrainStepMatchesEagerSteps_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  torch::manual_seed(20);
  auto eager = ModelPipeline();
  auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  for (int i = 0; i < 4; ++i) {
    torch::nn::Linear fc(32, 32);
    {
      torch::NoGradGuard no_grad;  // strong enough that every layer fires
      fc->weight.mul_(3);
      fc->bias.fill_(1.2);
    }
    // Equal weights, separate modules (neurons are not Cloneable).
    auto fc_copy = std::dynamic_pointer_cast<torch::nn::LinearImpl>(fc->clone());
    eager->append(torch::nn::Sequential(fc, mpipe::snn::LIFNode()), g);
    graphed->append(torch::nn::Sequential(torch::nn::Linear(fc_copy), mpipe::snn::LIFNode()), g);
  }
  torch::optim::SGD opt_eager(eager->parameters(), 0.05);
  torch::optim::SGD opt_graphed(graphed->parameters(), 0.05);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& labels) {
    return torch::cross_entropy_loss(out / 6, labels);
  };
  for (int step = 0; step < 5; ++step) {
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
}

TEST(Cuda, FusedNeuronKernelMatchesTheATenPath_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  using mpipe::snn::IFNodeOptions;
  using mpipe::snn::LIFNodeOptions;
  using mpipe::snn::Surrogate;
  const torch::Device g("cuda:0");
  torch::manual_seed(21);
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    for (int variant = 0; variant < 5; ++variant) {
      SCOPED_TRACE("dtype " + std::string(c10::toString(dtype)) + ", variant " +
                   std::to_string(variant));
      auto make = [&](bool fused) -> torch::nn::AnyModule {
        switch (variant) {
          case 0: return torch::nn::AnyModule(mpipe::snn::LIFNode(LIFNodeOptions().fused(fused)));
          case 1:
            return torch::nn::AnyModule(mpipe::snn::LIFNode(
                LIFNodeOptions().v_reset(std::nullopt).surrogate(Surrogate::atan()).fused(fused)));
          case 2:
            return torch::nn::AnyModule(mpipe::snn::LIFNode(
                LIFNodeOptions().decay_input(false).detach_reset(true).v_reset(-0.25).fused(
                    fused)));
          case 3:
            return torch::nn::AnyModule(
                mpipe::snn::IFNode(IFNodeOptions().v_threshold(0.75).fused(fused)));
          default:
            return torch::nn::AnyModule(mpipe::snn::IFNode(
                IFNodeOptions().v_reset(std::nullopt).detach_reset(true).surrogate(
                    Surrogate::atan(3.0)).fused(fused)));
        }
      };
      const int64_t T = 8;
      auto w = torch::randn({T, 64, 33}, torch::TensorOptions(g).dtype(dtype));
      auto run = [&](bool fused, torch::Tensor& grad) {
        auto node = make(fused);
        auto wg = w.clone().requires_grad_();
        std::vector<torch::Tensor> out;
        for (int64_t t = 0; t < T; ++t) out.push_back(node.forward(wg[t] * 1.3));
        auto spikes = torch::stack(out);
        auto weights = torch::arange(1, T + 1, torch::TensorOptions(g).dtype(dtype)).view({T, 1, 1});
        (spikes * weights).sum().backward();
        grad = wg.grad();
        return spikes;
      };
      torch::Tensor g_fused, g_aten;
      auto s_fused = run(true, g_fused);
      auto s_aten = run(false, g_aten);
      EXPECT_GT(s_aten.sum().item<double>(), 0.0) << "the test should make some spikes";
      expect_close(s_fused, s_aten, 0.0, "spikes");
      expect_close(g_fused, g_aten, dtype == torch::kDouble ? 1e-10 : 1e-4, "gradients");
    }
  }
}

TEST(Cuda, TimelineAndMemoryReportOnTheGpu_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  auto pipe = ModelPipeline(ModelPipelineOptions().record_timeline(true).track_memory(true));
  for (int j = 0; j < 4; ++j) pipe->append(mlp_stage(256, 256, 4), g);
  auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
  auto x = torch::randn({512, 256}, g);
  pipe->train_step(x, torch::zeros({512, 1}, g), loss_fn, 64);
  const mpipe::Timeline t = pipe->timeline();
  ASSERT_EQ(t.tasks.size(), 64u);  // 8 micro-batches x 4 stages x (F, B)
  std::map<std::pair<int64_t, int64_t>, mpipe::TimelineTask> f;
  for (const auto& task : t.tasks) {
    EXPECT_EQ(task.device, g);
    EXPECT_GE(task.start_ms, 0.0);
    EXPECT_LE(task.start_ms, task.end_ms);
    if (task.kind == mpipe::TaskKind::Forward) f[{task.stage, task.item}] = task;
  }
  for (const auto& kv : f) {  // device times follow the data flow
    if (kv.first.first > 0) {
      EXPECT_GE(kv.second.start_ms, f.at({kv.first.first - 1, kv.first.second}).end_ms);
    }
  }
  EXPECT_GT(t.bubble_fraction(), 0.0);
  EXPECT_LT(t.bubble_fraction(), 1.0);
  const auto report = pipe->memory_report();
  ASSERT_EQ(report.devices.size(), 1u);
  const auto& d = report.devices[0];
  EXPECT_EQ(d.stages, 4);
  EXPECT_GT(d.allocated_before_bytes, 0);
  EXPECT_GT(d.call_peak_bytes(), 0) << "activations were allocated during the step";
  std::cout << report.to_string();
}

TEST(Cuda, NeuronStateFollowsTheInputAcrossDevices_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  mpipe::snn::LIFNode node;
  auto x = torch::full({2, 3}, 0.8);
  auto a = node(x);                                 // v on the CPU
  auto b = node(x.to(torch::Device("cuda:0")));     // v moves to cuda:0
  EXPECT_TRUE(b.is_cuda());
  EXPECT_TRUE(node->membrane_potentials()[0].is_cuda());
  // Same as two steps on the CPU.
  mpipe::snn::LIFNode ref;
  ref(x);
  expect_close(b, ref(x), 0.0);
  expect_close(a, torch::zeros({2, 3}), 0.0);
}

#ifdef MPIPE_TEST_WITH_CUDA

namespace {

/// A stage whose GPU time is a one-thread spin kernel of `cycles` clock cycles:
/// it occupies one SM slot, so stages on separate streams can only finish
/// early if the GPU really runs them at the same time.
struct SpinImpl : torch::nn::Module {
  explicit SpinImpl(int64_t cycles) : cycles(cycles) {}
  torch::Tensor forward(const torch::Tensor& x) {
    at::cuda::sleep(cycles);
    return x + 1;
  }
  int64_t cycles;
};
TORCH_MODULE(Spin);

/// Cycles for a spin of about `ms` milliseconds on this GPU.
int64_t calibrate_spin(double ms) {
  const int64_t probe = 1000000;
  at::cuda::sleep(probe);  // warm up
  torch::cuda::synchronize();
  auto t0 = Clock::now();
  for (int i = 0; i < 10; ++i) at::cuda::sleep(probe);
  torch::cuda::synchronize();
  const double per_probe = ms_since(t0) / 10;
  return static_cast<int64_t>(probe * ms / per_probe);
}

}  // namespace

TEST(Cuda, StagesOverlapOnOneGpuAndTheHostDoesNotWait_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const int64_t n_stages = 4, n_micro = 8;
  const int64_t cycles = calibrate_spin(2.0);
  std::vector<Spin> spins;
  for (int64_t i = 0; i < n_stages; ++i) spins.emplace_back(cycles);
  auto x = torch::zeros({n_micro, 1}, torch::Device("cuda:0"));

  // The same 32 spins one after another on one stream.
  torch::cuda::synchronize();
  auto t0 = Clock::now();
  for (int64_t i = 0; i < n_micro; ++i) {
    auto h = x.narrow(0, i, 1);
    for (auto& s : spins) h = s(h);
  }
  torch::cuda::synchronize();
  const double serial_ms = ms_since(t0);

  for (bool threads : {true, false}) {
    SCOPED_TRACE(threads ? "worker threads" : "inline");
    auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
    for (auto& s : spins) pipe->append(s, "cuda:0");
    pipe->forward(x, 1);  // warm-up (worker start, stream pool)
    torch::cuda::synchronize();
    t0 = Clock::now();
    auto y = pipe->forward(x, 1);
    const double host_ms = ms_since(t0);
    torch::cuda::synchronize();
    const double pipe_ms = ms_since(t0);
    std::printf("[overlap] serial %.1f ms, pipelined %.1f ms (ideal %.1f), forward returned "
                "after %.2f ms\n",
                serial_ms, pipe_ms, serial_ms * (n_micro + n_stages - 1) / (n_micro * n_stages),
                host_ms);
    expect_close(y, x + n_stages, 0.0);
    // Fill-drain ideal is 11/32 = 0.34 of serial; without concurrent streams it is 1.
    EXPECT_LT(pipe_ms, 0.6 * serial_ms) << "stages did not run concurrently";
    // The host only queued work: it returned long before the GPU finished.
    EXPECT_LT(host_ms, 0.5 * pipe_ms) << "forward blocked the host";
  }
}

TEST(Cuda, ConstantForwardOverlaps_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const int64_t n_stages = 4, T = 8;
  const int64_t cycles = calibrate_spin(2.0);
  auto pipe = ModelPipeline();
  for (int64_t i = 0; i < n_stages; ++i) pipe->append(Spin(cycles), "cuda:0");
  auto x = torch::zeros({2, 1}, torch::Device("cuda:0"));
  pipe->constant_forward(x, 2);
  torch::cuda::synchronize();
  auto t0 = Clock::now();
  auto y = pipe->constant_forward(x, T, true);
  torch::cuda::synchronize();
  const double pipe_ms = ms_since(t0);
  const double serial_ms = 2.0 * n_stages * T;
  std::printf("[overlap] constant_forward %.1f ms for %.0f ms of spins\n", pipe_ms, serial_ms);
  expect_close(y, torch::full({2, 1}, static_cast<double>(n_stages * T)), 0.0);
  EXPECT_LT(pipe_ms, 0.6 * serial_ms);
}

#endif  // MPIPE_TEST_WITH_CUDA

TEST(MultiCuda, ForwardAcrossGpus_MultiCUDA) {
  MPIPE_REQUIRE_CUDA(2);
  const torch::Device g0("cuda:0"), g1("cuda:1"), c(torch::kCPU);
  for (bool threads : {true, false}) {
    check_forward_transparent({g0, g1, g0, g1}, threads);
    check_forward_transparent({g1, c, g0}, threads);
  }
}

TEST(MultiCuda, ConstantForwardAcrossGpus_MultiCUDA) {
  MPIPE_REQUIRE_CUDA(2);
  const torch::Device g0("cuda:0"), g1("cuda:1");
  for (bool threads : {true, false}) check_constant_forward_transparent({g0, g1, g1, g0}, threads);
}
