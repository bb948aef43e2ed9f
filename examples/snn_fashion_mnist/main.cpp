// A convolutional spiking network trained on Fashion-MNIST with
// mpipe::ModelPipeline::constant_forward over T time steps. See README.md.
//
//   {Conv3x3(C)-BN-IF-MaxPool2} x 2 -> Linear(C*49, H)-IF -> Linear(H, 10)-IF
//
// The image is fed directly; the first Conv-BN-IF layer encodes it as spikes.
// The output layer's firing rate over T steps is the prediction; the loss is
// the MSE between the rate and the one-hot label.

#include "fashion_mnist.h"
#include "training.h"

#include <mpipe/mpipe.h>
#include <mpipe/snn.h>

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <stdexcept>

namespace {

struct Config {
  examples::CommonFlags common;
  int64_t epochs = 0;  // 0: 24 on GPU, 4 on CPU (2 with --quick)
  int64_t batch_size = 128;
  int64_t time_steps = 4;
  double lr = 0.1;
  double momentum = 0.9;
  int64_t channels = 128;
  int64_t hidden = 2048;
  std::string eval_path;
  int64_t test_batch = 1000;
  bool quick_on_cpu = false;
  bool no_tf32 = false;
  mpipe::distributed::ProcessGroup group;  // across processes: this rank's group
};

mpipe::ModelPipeline build_model(const Config& cfg, const std::vector<torch::Device>& devices) {
  namespace nn = torch::nn;
  using mpipe::snn::IFNode;
  const auto neuron = mpipe::snn::IFNodeOptions()
                          .surrogate(mpipe::snn::Surrogate::atan())
                          .detach_reset(true);
  const int64_t c = cfg.channels;
  nn::Sequential conv1(nn::Conv2d(nn::Conv2dOptions(1, c, 3).padding(1).bias(false)),
                       nn::BatchNorm2d(c), IFNode(neuron), nn::MaxPool2d(2));
  nn::Sequential conv2(nn::Conv2d(nn::Conv2dOptions(c, c, 3).padding(1).bias(false)),
                       nn::BatchNorm2d(c), IFNode(neuron), nn::MaxPool2d(2));
  nn::Sequential fc1(nn::Flatten(), nn::Linear(nn::LinearOptions(c * 7 * 7, cfg.hidden).bias(false)),
                     IFNode(neuron));
  nn::Sequential fc2(nn::Linear(nn::LinearOptions(cfg.hidden, 10).bias(false)), IFNode(neuron));
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions()
                                .worker_threads(!cfg.common.inline_host)
                                .process_group(cfg.group));
  // Every rank builds every stage (the same random draws) and appends its range.
  const std::vector<nn::Sequential> stages{conv1, conv2, fc1, fc2};
  for (int64_t s = 0; s < 4; ++s) {
    if (examples::holds_stage(cfg.group, s, 4)) {
      pipe->append(stages[static_cast<size_t>(s)], devices[static_cast<size_t>(s)]);
    }
  }
  return pipe;
}

/// Test accuracy (fraction) of `pipe` on `test`.
double evaluate(mpipe::ModelPipeline& pipe, const examples::Dataset& test, const Config& cfg) {
  torch::NoGradGuard no_grad;
  pipe->eval();
  torch::Tensor correct = torch::zeros({}, torch::kLong).to(pipe->output_device());
  for (int64_t start = 0; start < test.size(); start += cfg.test_batch) {
    const int64_t n = std::min(cfg.test_batch, test.size() - start);
    auto x = test.images.narrow(0, start, n);
    auto y = test.labels.narrow(0, start, n);
    const auto sum = pipe->constant_forward(x, cfg.time_steps);
    mpipe::reset_states(*pipe);
    if (!sum.defined()) continue;  // a rank before the last
    correct += mpipe::snn::predict(mpipe::snn::rate_from_sum(sum, cfg.time_steps)).eq(y).sum();
  }
  pipe->train();
  return static_cast<double>(correct.item<int64_t>()) / static_cast<double>(test.size());
}

int run(Config cfg) {
  examples::CommonFlags& common = cfg.common;
  const auto devices = examples::stage_devices(common.devices, 4);
  const bool cuda = devices.front().is_cuda() || devices.back().is_cuda();
  if (cfg.quick_on_cpu && !cuda) common.quick = true;
  if (common.quick) {
    cfg.channels = 16;
    cfg.hidden = 256;
    cfg.batch_size = 64;
    if (common.train_limit == 0) common.train_limit = 4000;
    if (common.test_limit == 0) common.test_limit = 2000;
    cfg.test_batch = std::min<int64_t>(cfg.test_batch, 250);  // large CPU batches are slower
  }
  if (cfg.epochs == 0) cfg.epochs = common.quick ? 2 : (cuda ? 24 : 4);
  torch::manual_seed(common.seed);
  if (cuda) {
    torch::cuda::manual_seed_all(common.seed);
    at::globalContext().setBenchmarkCuDNN(true);
    at::globalContext().setAllowTF32CuBLAS(!cfg.no_tf32);
    at::globalContext().setAllowTF32CuDNN(!cfg.no_tf32);
  }

  // The whole data set lives on the first stage's device; labels where the output is.
  examples::Dataset train, test;
  if (!examples::load_data(common, devices.front(), devices.back(), train, test)) {
    return examples::kSkipExitCode;
  }

  cfg.group = examples::group_from_env();
  const bool report = examples::reports(cfg.group);
  auto pipe = build_model(cfg, devices);
  std::printf("mpipe %s snn_fashion_mnist: 4 stages on %s%s, T=%lld, %lld train / %lld test "
              "images, batch %lld, channels %lld, hidden %lld%s\n",
              MPIPE_VERSION_STRING, examples::device_list(devices).c_str(),
              cfg.group.defined() ? (" across " + std::to_string(cfg.group.world_size()) +
                                     " processes").c_str()
                                  : "",
              static_cast<long long>(cfg.time_steps), static_cast<long long>(train.size()),
              static_cast<long long>(test.size()), static_cast<long long>(cfg.batch_size),
              static_cast<long long>(cfg.channels), static_cast<long long>(cfg.hidden),
              common.quick ? " (quick)" : "");

  if (!cfg.eval_path.empty()) {
    torch::load(pipe, cfg.group.defined() ? cfg.group.rank_path(cfg.eval_path) : cfg.eval_path);
    const double acc = evaluate(pipe, test, cfg);
    if (!report) return 0;
    std::printf("test accuracy of %s: %.2f%%\n", cfg.eval_path.c_str(), 100 * acc);
    return examples::accuracy_exit_code(acc, common.min_accuracy);
  }

  torch::optim::SGD opt(pipe->parameters(),
                        torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum));
  const int64_t steps_per_epoch = (train.size() + cfg.batch_size - 1) / cfg.batch_size;
  const int64_t total_steps = steps_per_epoch * cfg.epochs;
  int64_t step = 0;
  double best = 0, last = 0, train_seconds = 0;
  int64_t best_epoch = 0;
  const auto t_start = examples::Clock::now();
  for (int64_t epoch = 1; epoch <= cfg.epochs; ++epoch) {
    const auto t_epoch = examples::Clock::now();
    auto order = torch::randperm(train.size(), torch::TensorOptions(torch::kLong));
    auto order_in = order.to(devices.front());
    auto order_out = order.to(devices.back());
    // Sums stay on the device: one read-back per epoch.
    torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions(devices.back()));
    torch::Tensor correct = torch::zeros({}, torch::TensorOptions(devices.back()).dtype(torch::kLong));
    for (int64_t start = 0; start < train.size(); start += cfg.batch_size, ++step) {
      const int64_t n = std::min(cfg.batch_size, train.size() - start);
      auto x = train.images.index_select(0, order_in.narrow(0, start, n));
      auto y = train.labels.index_select(0, order_out.narrow(0, start, n));
      examples::set_cosine_lr<torch::optim::SGDOptions>(opt, cfg.lr, step, total_steps);
      const bool recorded = examples::begin_recorded_step(pipe, common, step);
      // The loss of the firing rates over T steps (on the last stage, the
      // last rank across processes); the states are reset before and after.
      auto loss_fn = [&](const torch::Tensor& spike_sum, const torch::Tensor& labels) {
        const auto rate = mpipe::snn::rate_from_sum(spike_sum, cfg.time_steps);
        correct += mpipe::snn::predict(rate.detach()).eq(labels).sum();
        return mpipe::snn::rate_mse_loss(rate, labels);
      };
      opt.zero_grad();
      const auto loss = pipe->constant_train_step(x, cfg.time_steps, y, loss_fn);
      if (recorded) examples::end_recorded_step(pipe, common);
      opt.step();
      if (loss.defined()) loss_sum += loss * n;
    }
    const double mean_loss = loss_sum.item<double>() / train.size();
    const double train_acc = static_cast<double>(correct.item<int64_t>()) / train.size();
    const double epoch_train_s = examples::seconds_since(t_epoch);
    train_seconds += epoch_train_s;
    last = evaluate(pipe, test, cfg);
    if (last > best) {
      best = last;
      best_epoch = epoch;
    }
    if (report) {
      examples::print_epoch(epoch, cfg.epochs, mean_loss, train_acc, last, train.size(),
                            epoch_train_s, examples::seconds_since(t_start));
    }
  }

  std::filesystem::create_directories(common.out);
  std::string path = common.out + "/snn_fashion_mnist.pt";
  if (cfg.group.defined()) path = cfg.group.rank_path(path);  // each rank its stages
  torch::save(pipe, path);
  if (!report) {
    std::printf("weights of this rank's stages saved to %s\n", path.c_str());
    return 0;
  }
  std::printf("final test accuracy %.2f%% (best %.2f%% at epoch %lld); %s of training "
              "(%s with evaluation); weights saved to %s\n",
              100 * last, 100 * best, static_cast<long long>(best_epoch),
              examples::format_duration(train_seconds).c_str(),
              examples::format_duration(examples::seconds_since(t_start)).c_str(), path.c_str());
  return examples::accuracy_exit_code(last, common.min_accuracy);
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  cfg.common.out = "snn_fashion_mnist_out";
  CLI::App app{"Train a convolutional SNN on Fashion-MNIST through an mpipe pipeline"};
  app.add_option("--epochs", cfg.epochs, "epochs (default: 24 on GPU, 4 on CPU, 2 with --quick)");
  app.add_option("-b,--batch-size", cfg.batch_size, "training batch size")
      ->check(CLI::PositiveNumber);
  app.add_option("-T,--time-steps", cfg.time_steps, "time steps per image")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", cfg.lr, "SGD learning rate (cosine-annealed to 0)");
  app.add_option("--momentum", cfg.momentum, "SGD momentum");
  app.add_option("--channels", cfg.channels, "conv channels")->check(CLI::PositiveNumber);
  app.add_option("--hidden", cfg.hidden, "hidden units of the first linear layer")
      ->check(CLI::PositiveNumber);
  app.add_option("--eval", cfg.eval_path, "evaluate saved weights instead of training");
  app.add_option("--test-batch", cfg.test_batch, "evaluation batch size")
      ->check(CLI::PositiveNumber);
  app.add_flag("--quick-on-cpu", cfg.quick_on_cpu, "--quick when no GPU is used");
  app.add_flag("--no-tf32", cfg.no_tf32, "keep fp32 matrix products and convolutions exact");
  examples::add_common_flags(
      app, cfg.common, "a brief run for CPUs: small model, 4000 train / 2000 test images, 2 epochs");
  CLI11_PARSE(app, argc, argv);
  return examples::run_guarded([&] { return run(cfg); });
}
