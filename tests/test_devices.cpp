// Devices: how device spellings resolve and which are refused, and stage
// placement: forward-type calls with stages on the GPU, on
// the GPU and the CPU mixed, and on several GPUs, against the plain model;
// moves and loads that keep each stage on its device; and overlap of stages
// on one GPU, each on its own stream. GPU tests end in _CUDA (one GPU) or
// _MultiCUDA (two or more) and skip themselves elsewhere.

#include "common.h"

#ifdef MPIPE_TEST_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

#include <chrono>
#include <cstdio>

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
void check_forward_transparent(const std::vector<torch::Device>& devices, bool threads,
                               int64_t lanes = 1) {
  torch::manual_seed(7);
  const int64_t width = 8, batch = 12;
  std::vector<torch::nn::Sequential> stages;
  auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads).lanes(lanes));
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

TEST(Placement, ForwardAllStagesOnOneGpu_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (bool threads : {true, false}) check_forward_transparent({g, g, g, g}, threads);
}

TEST(Placement, LanesGiveThePlainModelsResults_CUDA) {
  // Note [Lanes]: outputs and gradients as the plain model's, whichever lane
  // each micro-batch ran on; a stage with buffers keeps one stream.
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0"), c(torch::kCPU);
  for (bool threads : {true, false}) {
    for (int64_t lanes : {2, 3}) {
      SCOPED_TRACE("lanes " + std::to_string(lanes));
      check_forward_transparent({g, g, g, g}, threads, lanes);
      check_forward_transparent({c, g, g, c}, threads, lanes);
    }
  }
  for (bool graphs : {false, true}) {  // a stage with buffers beside stateless ones; graphed
    SCOPED_TRACE(graphs ? "graphed" : "eager");
    torch::manual_seed(12);
    auto first = mlp_stage(16, 16), last = mlp_stage(16, 16);
    torch::nn::Sequential norm(torch::nn::Linear(16, 16), torch::nn::BatchNorm1d(16));
    norm->eval();
    auto pipe = ModelPipeline(ModelPipelineOptions().lanes(4).cuda_graphs(graphs));
    pipe->append(first, g).append(norm, g).append(last, g);
    const auto x = torch::randn({40, 16}, g);
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> parts;
    for (int64_t i = 0; i < 10; ++i) {
      parts.push_back(last->forward(norm->forward(first->forward(x.narrow(0, 4 * i, 4)))));
    }
    const auto want = torch::cat(parts);
    for (int call = 0; call < 3; ++call) expect_close(pipe->forward(x, 4), want, 1e-6, "lanes 4");
    if (graphs) EXPECT_EQ(pipe->cuda_graphs_captured(), 1u);
  }
}

TEST(Placement, ConstantForwardAllStagesOnOneGpu_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (bool threads : {true, false}) check_constant_forward_transparent({g, g, g}, threads);
}

TEST(Placement, MixedCpuAndGpuStages_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0"), c(torch::kCPU);
  for (bool threads : {true, false}) {
    check_forward_transparent({c, g, c, g}, threads);
    check_forward_transparent({g, c, g, g}, threads);
    check_constant_forward_transparent({g, c, g}, threads);
  }
}

TEST(Placement, DevicesAndMoves_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const int64_t n = static_cast<int64_t>(torch::cuda::device_count());
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

TEST(Placement, LoadPutsStagesBackOnTheirDevices_CUDA) {
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

TEST(Placement, TimeStepCallsEqualAPlainLoopOnTheGpuAndMixed_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0"), c(torch::kCPU);
  const int64_t T = 4;
  for (const auto& devices : std::vector<std::vector<torch::Device>>{{g, g, g}, {g, c, g}, {c, g, c}}) {
    for (bool threads : {true, false}) {
      SCOPED_TRACE(std::string(threads ? "threads" : "inline") + ", stages on " +
                   devices[0].str() + " " + devices[1].str() + " " + devices[2].str());
      torch::manual_seed(51);
      std::vector<Leaky> stages{Leaky(5, 0.6), Leaky(5, 0.3), Leaky(5, 0.8)};
      auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
      for (size_t j = 0; j < 3; ++j) pipe->append(stages[j], devices[j]);
      pipe->to(torch::kDouble);
      auto step = [&](torch::Tensor y) {  // one time step of the plain model
        for (size_t j = 0; j < 3; ++j) y = stages[j](y.to(devices[j]));
        return y;
      };
      auto reset = [&] { mpipe::reset_states(*pipe); };
      const auto opts = torch::TensorOptions().dtype(torch::kDouble).device(devices[0]);
      auto xs = torch::randn({T, 3, 5}, opts);
      for (bool reduce : {false, true}) {
        SCOPED_TRACE(reduce ? "reduce" : "no reduce");
        reset();
        expect_transparent(
            *pipe, xs,
            [&](const torch::Tensor& xi) {
              auto y = pipe->sequence_forward(xi, reduce);
              reset();
              return y;
            },
            [&](const torch::Tensor& xi) {
              std::vector<torch::Tensor> ys;
              for (int64_t t = 0; t < T; ++t) ys.push_back(step(xi[t]));
              reset();
              return reduce ? torch::stack(ys).sum(0) : torch::stack(ys);
            },
            1e-10);
        auto x = torch::randn({3, 5}, opts);
        expect_transparent(
            *pipe, x,
            [&](const torch::Tensor& xi) {
              auto y = pipe->constant_forward(xi, T, reduce);
              reset();
              return y;
            },
            [&](const torch::Tensor& xi) {
              std::vector<torch::Tensor> ys;
              for (int64_t t = 0; t < T; ++t) ys.push_back(step(xi));
              reset();
              return reduce ? torch::stack(ys).sum(0) : torch::cat(ys);
            },
            1e-10);
      }
      // constant_train_step against the plain loop: loss, input and parameter gradients.
      auto x = torch::randn({3, 5}, opts);
      auto target = torch::randn({3, 5}, torch::TensorOptions().dtype(torch::kDouble).device(devices[2]));
      auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& t) {
        return (out / 4 - t).pow(2).mean();
      };
      auto x1 = x.clone().requires_grad_();
      auto loss = pipe->constant_train_step(x1, T, target, loss_fn);
      auto pipe_grads = grads_of(*pipe);
      zero_grads(*pipe);
      reset();
      auto x2 = x.clone().requires_grad_();
      torch::Tensor out;
      for (int64_t t = 0; t < T; ++t) out = t == 0 ? step(x2) : out + step(x2);
      auto loss2 = loss_fn(out, target);
      loss2.backward();
      reset();
      expect_close(loss, loss2, 1e-10, "loss");
      expect_close(x1.grad(), x2.grad(), 1e-10, "grad of x");
      expect_same_grads(pipe_grads, grads_of(*pipe), 1e-10);
      zero_grads(*pipe);
    }
  }
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

TEST(Placement, StagesOverlapOnOneGpuAndTheHostDoesNotWait_CUDA) {
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

TEST(Placement, ConstantForwardOverlaps_CUDA) {
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

TEST(Placement, ForwardAcrossGpus_MultiCUDA) {
  MPIPE_REQUIRE_CUDA(2);
  const torch::Device g0("cuda:0"), g1("cuda:1"), c(torch::kCPU);
  for (bool threads : {true, false}) {
    check_forward_transparent({g0, g1, g0, g1}, threads);
    check_forward_transparent({g1, c, g0}, threads);
  }
}

TEST(Placement, ConstantForwardAcrossGpus_MultiCUDA) {
  MPIPE_REQUIRE_CUDA(2);
  const torch::Device g0("cuda:0"), g1("cuda:1");
  for (bool threads : {true, false}) check_constant_forward_transparent({g0, g1, g1, g0}, threads);
}

// ---------------------------------------------------------------------------
// Devices: how device spellings resolve, and the errors for bad ones.

TEST(Devices, SpellingsResolve) {
  EXPECT_EQ(mpipe::resolve_device("cpu"), torch::Device(torch::kCPU));
  EXPECT_EQ(mpipe::resolve_device(torch::kCPU), torch::Device(torch::kCPU));
  EXPECT_EQ(mpipe::resolve_device(torch::Device("cpu")), torch::Device(torch::kCPU));
  if (static_cast<int64_t>(torch::cuda::device_count()) > 0) {
    EXPECT_EQ(mpipe::resolve_device("0"), torch::Device("cuda:0"));
    EXPECT_EQ(mpipe::resolve_device(0), torch::Device("cuda:0"));
    EXPECT_EQ(mpipe::resolve_device("cuda:0"), torch::Device("cuda:0"));
    EXPECT_TRUE(mpipe::resolve_device("cuda").has_index());
  }
}

TEST(Devices, BadDevicesAreRefusedClearly) {
  MPIPE_EXPECT_ERROR(mpipe::resolve_device("gpu0"), "unknown device string \"gpu0\"",
                     "\"cuda:<index>\"");
  MPIPE_EXPECT_ERROR(mpipe::resolve_device(""), "unknown device string");
  MPIPE_EXPECT_ERROR(mpipe::resolve_device(-1), "must be >= 0, got -1");
  MPIPE_EXPECT_ERROR(mpipe::resolve_device("meta"), "not supported");
  const int64_t n = static_cast<int64_t>(torch::cuda::device_count());
  MPIPE_EXPECT_ERROR(mpipe::resolve_device(static_cast<int>(n) + 7), "CUDA");
  MPIPE_EXPECT_ERROR(mpipe::resolve_device("cuda:" + std::to_string(n + 3)), "CUDA");
  MPIPE_EXPECT_ERROR(mpipe::resolve_device(std::to_string(n + 1)), "CUDA");

  // append names the stage, and leaves the pipeline as it was.
  auto pipe = ModelPipeline();
  pipe->append(torch::nn::Linear(2, 2), "cpu");
  MPIPE_EXPECT_ERROR(pipe->append(torch::nn::Linear(2, 2), "cuda:" + std::to_string(n + 3)),
                     "append: stage 1", "CUDA");
  MPIPE_EXPECT_ERROR(pipe->append(torch::nn::Linear(2, 2), "bogus:1"), "stage 1",
                     "unknown device string");
  EXPECT_EQ(pipe->size(), 1u);
  EXPECT_EQ(pipe->forward(torch::randn({3, 2}), 1).sizes(), (torch::IntArrayRef{3, 2}));
}

TEST(Devices, CpuOnlyLibTorchRefusesCuda) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA is available here";
  // Either LibTorch has no CUDA at all, or it has CUDA but sees no device.
  MPIPE_EXPECT_ERROR(mpipe::resolve_device("cuda:0"), "CUDA", "\"cpu\"");
  MPIPE_EXPECT_ERROR(mpipe::resolve_device("0"), "CUDA");
  MPIPE_EXPECT_ERROR(mpipe::resolve_device(torch::kCUDA), "CUDA");
}
