// A deep MLP split into pipeline stages, on random data: checks the pipeline
// against the plain model, then times forward passes and training steps of
// both. See README.md beside this file.

#include <mpipe/mpipe.h>

#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

struct Config {
  std::string device = "auto";
  int64_t stages = 4;
  int64_t width = 0;  // 0: a default that suits the device
  int64_t depth = 0;
  int64_t batch = 0;
  int64_t split = 0;
  int64_t reps = 15;
  bool inline_host = false;
  uint64_t seed = 0;
};

/// Median wall time of `reps` calls of `fn` after two warm-ups, in ms; each call
/// ends when the GPU is idle.
double median_ms(int64_t reps, bool cuda, const std::function<void()>& fn) {
  auto sync = [cuda] {
    if (cuda) torch::cuda::synchronize();
  };
  for (int i = 0; i < 2; ++i) fn();
  sync();
  std::vector<double> ms;
  for (int64_t r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    sync();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"Pipelined MLP on random data: correctness check and throughput, mpipe vs plain"};
  app.add_option("--device", cfg.device, "auto (CUDA if present), cpu, or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--stages", cfg.stages, "pipeline stages")->check(CLI::PositiveNumber);
  app.add_option("--width", cfg.width, "features per layer (default: 1024 GPU, 256 CPU)");
  app.add_option("--depth", cfg.depth, "Linear+ReLU layers in all (default: 32 GPU, 8 CPU)");
  app.add_option("--batch", cfg.batch, "batch size (default: 512 GPU, 256 CPU)");
  app.add_option("--split", cfg.split, "micro-batch size (default: batch / 8)");
  app.add_option("--reps", cfg.reps, "timed repetitions (median is printed)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--inline", cfg.inline_host, "issue all stages from the caller's thread");
  app.add_option("--seed", cfg.seed, "random seed");
  CLI11_PARSE(app, argc, argv);

  const int64_t gpus = mpipe::cuda_device_count();
  const bool cuda = cfg.device == "cuda" || (cfg.device == "auto" && gpus > 0);
  if (cuda && gpus == 0) {
    std::fprintf(stderr, "--device cuda: no CUDA device is visible; use --device cpu\n");
    return 2;
  }
  if (cfg.width == 0) cfg.width = cuda ? 1024 : 256;
  if (cfg.depth == 0) cfg.depth = cuda ? 32 : 8;
  if (cfg.batch == 0) cfg.batch = cuda ? 512 : 256;
  if (cfg.split == 0) cfg.split = std::max<int64_t>(1, cfg.batch / 8);
  if (cfg.depth % cfg.stages != 0) {
    std::fprintf(stderr, "--depth (%lld) must be a multiple of --stages (%lld)\n",
                 static_cast<long long>(cfg.depth), static_cast<long long>(cfg.stages));
    return 2;
  }
  torch::manual_seed(cfg.seed);

  // Stage i goes to GPU i % gpus, or to the CPU.
  std::vector<torch::nn::Sequential> stages;
  std::vector<torch::Device> devices;
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().worker_threads(!cfg.inline_host));
  for (int64_t s = 0; s < cfg.stages; ++s) {
    torch::nn::Sequential stage;
    for (int64_t l = 0; l < cfg.depth / cfg.stages; ++l) {
      stage->push_back(torch::nn::Linear(cfg.width, cfg.width));
      stage->push_back(torch::nn::ReLU());
    }
    devices.push_back(cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(s % gpus))
                           : torch::Device(torch::kCPU));
    pipe->append(stage, devices.back());
    stages.push_back(stage);
  }
  auto plain = [&](torch::Tensor x) {
    for (size_t s = 0; s < stages.size(); ++s) x = stages[s]->forward(x.to(devices[s]));
    return x;
  };

  std::printf("mpipe %s pipelined_mlp: %lld stages on [", MPIPE_VERSION_STRING,
              static_cast<long long>(cfg.stages));
  for (size_t s = 0; s < devices.size(); ++s) std::printf("%s%s", s ? ", " : "", devices[s].str().c_str());
  std::printf("], width %lld, depth %lld, batch %lld in micro-batches of %lld, %s host\n",
              static_cast<long long>(cfg.width), static_cast<long long>(cfg.depth),
              static_cast<long long>(cfg.batch), static_cast<long long>(cfg.split),
              cfg.inline_host ? "inline" : "threaded");

  auto x = torch::randn({cfg.batch, cfg.width}, torch::Device(devices.front()));
  // Correctness: the pipeline's output equals the plain model's.
  double diff, scale;
  {
    torch::NoGradGuard no_grad;
    auto ref = plain(x);
    auto out = pipe->forward(x, cfg.split);
    diff = (out - ref).abs().max().item<double>();
    scale = ref.abs().max().item<double>();
  }
  const bool ok = diff <= 1e-4 * std::max(1.0, scale);
  std::printf("check: max |pipeline - plain| = %.3g (output scale %.3g): %s\n", diff, scale,
              ok ? "OK" : "MISMATCH");

  torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(1e-3));
  auto train_plain = [&] {
    opt.zero_grad();
    plain(x).pow(2).mean().backward();
    opt.step();
  };
  auto train_pipe = [&] {
    opt.zero_grad();
    pipe->forward(x, cfg.split).pow(2).mean().backward();
    opt.step();
  };
  double fwd_plain, fwd_pipe;
  {
    torch::NoGradGuard no_grad;
    fwd_plain = median_ms(cfg.reps, cuda, [&] { plain(x); });
    fwd_pipe = median_ms(cfg.reps, cuda, [&] { pipe->forward(x, cfg.split); });
  }
  const double train_plain_ms = median_ms(cfg.reps, cuda, train_plain);
  const double train_pipe_ms = median_ms(cfg.reps, cuda, train_pipe);
  auto rate = [&](double ms) { return cfg.batch / (ms / 1e3); };
  std::printf("%-22s %10s %14s\n", "median of runs", "ms", "samples/s");
  std::printf("%-22s %10.3f %14.0f\n", "plain forward", fwd_plain, rate(fwd_plain));
  std::printf("%-22s %10.3f %14.0f\n", "mpipe forward", fwd_pipe, rate(fwd_pipe));
  std::printf("%-22s %10.3f %14.0f\n", "plain train step", train_plain_ms, rate(train_plain_ms));
  std::printf("%-22s %10.3f %14.0f\n", "mpipe train step", train_pipe_ms, rate(train_pipe_ms));
  return ok ? 0 : 1;
}
