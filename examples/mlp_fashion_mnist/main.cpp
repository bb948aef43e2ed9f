// A deep MLP classifier on Fashion-MNIST, split into pipeline stages and trained
// with ModelPipelineImpl::train_step under a chosen schedule (GPipe or 1F1B)
// and checkpointing mode. See README.md.
//
//   stage 0: Flatten, Linear(784, H), DeferredBatchNorm, ReLU, Dropout
//   stage 1, 2: Linear(H, H), DeferredBatchNorm, ReLU, Dropout
//   stage 3: Linear(H, 10)

#include "fashion_mnist.h"
#include "training.h"

#include <mpipe/mpipe.h>

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>

namespace {

constexpr int kSkipExitCode = 77;  // ctest's SKIP_RETURN_CODE

struct Config {
  int64_t epochs = 0;  // 0: 12 on GPU, 2 with --quick / on CPU
  int64_t batch_size = 256;
  int64_t split = 64;
  int64_t hidden = 1024;
  double lr = 1e-3;
  double dropout = 0.2;
  std::string schedule = "1f1b";
  std::string checkpoint = "never";
  std::string devices = "auto";
  std::string data = examples::kDefaultFashionMnistDir;
  std::string out = "mlp_fashion_mnist_out";
  uint64_t seed = 0;
  int64_t train_limit = 0;
  int64_t test_limit = 0;
  double min_accuracy = -1;
  bool quick = false;
  bool inline_host = false;
  bool skip_if_no_data = false;
};

mpipe::ModelPipeline build_model(const Config& cfg, const std::vector<torch::Device>& devices) {
  namespace nn = torch::nn;
  auto block = [&](int64_t in) {
    return nn::Sequential(nn::Linear(in, cfg.hidden), mpipe::DeferredBatchNorm(cfg.hidden),
                          nn::ReLU(), nn::Dropout(cfg.dropout));
  };
  nn::Sequential first{nn::Flatten()};
  first->extend(*block(28 * 28));
  const auto checkpoint = cfg.checkpoint == "always"        ? mpipe::Checkpoint::Always
                          : cfg.checkpoint == "except-last" ? mpipe::Checkpoint::ExceptLast
                                                            : mpipe::Checkpoint::Never;
  mpipe::ModelPipeline pipe(
      mpipe::ModelPipelineOptions().worker_threads(!cfg.inline_host).checkpoint(checkpoint));
  pipe->append(first, devices[0])
      .append(block(cfg.hidden), devices[1])
      .append(block(cfg.hidden), devices[2])
      .append(nn::Sequential(nn::Linear(cfg.hidden, 10)), devices[3]);
  return pipe;
}

double evaluate(mpipe::ModelPipeline& pipe, const examples::Dataset& test, int64_t split) {
  torch::NoGradGuard no_grad;
  pipe->eval();
  auto correct = torch::zeros({}, torch::TensorOptions(pipe->output_device()).dtype(torch::kLong));
  for (int64_t start = 0; start < test.size(); start += 1000) {
    const int64_t n = std::min<int64_t>(1000, test.size() - start);
    auto logits = pipe->forward(test.images.narrow(0, start, n), split);
    correct += logits.argmax(1).eq(test.labels.narrow(0, start, n)).sum();
  }
  pipe->train();
  return static_cast<double>(correct.item<int64_t>()) / static_cast<double>(test.size());
}

int run(Config cfg) {
  const auto devices = examples::stage_devices(cfg.devices, 4);
  const bool cuda = devices.front().is_cuda() || devices.back().is_cuda();
  if (cfg.quick) {
    cfg.hidden = 256;
    if (cfg.train_limit == 0) cfg.train_limit = 6000;
    if (cfg.test_limit == 0) cfg.test_limit = 2000;
  }
  if (cfg.epochs == 0) cfg.epochs = cfg.quick || !cuda ? 2 : 12;
  torch::manual_seed(cfg.seed);
  if (cuda) torch::cuda::manual_seed_all(cfg.seed);

  if (!examples::fashion_mnist_present(cfg.data) && cfg.skip_if_no_data) {
    std::printf("Fashion-MNIST not found in %s: skipped\n", cfg.data.c_str());
    return kSkipExitCode;
  }
  auto train = examples::load_fashion_mnist(cfg.data, true, cfg.train_limit);
  auto test = examples::load_fashion_mnist(cfg.data, false, cfg.test_limit);
  // Standardise with the training set's statistics.
  const double mean = train.images.mean().item<double>(), std = train.images.std().item<double>();
  for (auto* ds : {&train, &test}) {
    ds->images = ((ds->images - mean) / std).to(devices.front());
    ds->labels = ds->labels.to(devices.back());
  }

  auto pipe = build_model(cfg, devices);
  const auto schedule = cfg.schedule == "gpipe" ? mpipe::Schedule::GPipe : mpipe::Schedule::OneFOneB;
  std::printf("mpipe %s mlp_fashion_mnist: 4 stages on %s, hidden %lld, %lld train / %lld test "
              "images, batch %lld in micro-batches of %lld, schedule %s, checkpoint %s\n",
              MPIPE_VERSION_STRING, examples::device_list(devices).c_str(),
              static_cast<long long>(cfg.hidden), static_cast<long long>(train.size()),
              static_cast<long long>(test.size()), static_cast<long long>(cfg.batch_size),
              static_cast<long long>(cfg.split), cfg.schedule.c_str(), cfg.checkpoint.c_str());

  torch::optim::Adam opt(pipe->parameters(), torch::optim::AdamOptions(cfg.lr));
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& labels) {
    return torch::nn::functional::cross_entropy(logits, labels);
  };
  const int64_t steps_per_epoch = (train.size() + cfg.batch_size - 1) / cfg.batch_size;
  const int64_t total_steps = steps_per_epoch * cfg.epochs;
  int64_t step = 0;
  double last = 0, train_seconds = 0;
  const auto t_start = examples::Clock::now();
  for (int64_t epoch = 1; epoch <= cfg.epochs; ++epoch) {
    const auto t_epoch = examples::Clock::now();
    auto order = torch::randperm(train.size(), torch::TensorOptions(torch::kLong));
    auto order_in = order.to(devices.front()), order_out = order.to(devices.back());
    auto loss_sum = torch::zeros({}, torch::TensorOptions(devices.back()));
    for (int64_t start = 0; start < train.size(); start += cfg.batch_size, ++step) {
      const int64_t n = std::min(cfg.batch_size, train.size() - start);
      auto x = train.images.index_select(0, order_in.narrow(0, start, n));
      auto y = train.labels.index_select(0, order_out.narrow(0, start, n));
      examples::set_cosine_lr<torch::optim::AdamOptions>(opt, cfg.lr, step, total_steps);
      opt.zero_grad();
      loss_sum += pipe->train_step(x, y, loss_fn,
                                   mpipe::TrainStepOptions(cfg.split).schedule(schedule)) * n;
      opt.step();
    }
    const double mean_loss = loss_sum.item<double>() / train.size();
    const double epoch_train_s = examples::seconds_since(t_epoch);
    train_seconds += epoch_train_s;
    const double train_acc = evaluate(pipe, train, cfg.split);
    last = evaluate(pipe, test, cfg.split);
    const double elapsed = examples::seconds_since(t_start);
    std::printf("epoch %3lld/%lld  loss %.4f  train %.2f%%  test %.2f%%  %7.0f img/s  "
                "%5.1f s  ETA %s\n",
                static_cast<long long>(epoch), static_cast<long long>(cfg.epochs), mean_loss,
                100 * train_acc, 100 * last, train.size() / epoch_train_s, epoch_train_s,
                examples::format_duration(elapsed / epoch * (cfg.epochs - epoch)).c_str());
    std::fflush(stdout);
  }
  std::filesystem::create_directories(cfg.out);
  const std::string path = cfg.out + "/mlp_fashion_mnist.pt";
  torch::save(pipe, path);
  std::printf("final test accuracy %.2f%%; %s of training; weights saved to %s\n", 100 * last,
              examples::format_duration(train_seconds).c_str(), path.c_str());
  if (cfg.min_accuracy >= 0 && last < cfg.min_accuracy) {
    std::printf("FAILED: test accuracy %.2f%% is below --min-accuracy %.2f%%\n", 100 * last,
                100 * cfg.min_accuracy);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"Train a pipelined MLP on Fashion-MNIST with GPipe or 1F1B"};
  app.add_option("--epochs", cfg.epochs, "epochs (default: 12 on GPU, 2 on CPU or --quick)");
  app.add_option("-b,--batch-size", cfg.batch_size, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--split", cfg.split, "micro-batch rows")->check(CLI::PositiveNumber);
  app.add_option("--hidden", cfg.hidden, "hidden units per layer")->check(CLI::PositiveNumber);
  app.add_option("--lr", cfg.lr, "Adam learning rate (cosine-annealed to 0)");
  app.add_option("--dropout", cfg.dropout, "dropout probability");
  app.add_option("--schedule", cfg.schedule, "gpipe or 1f1b")
      ->check(CLI::IsMember({"gpipe", "1f1b"}));
  app.add_option("--checkpoint", cfg.checkpoint, "never, except-last or always")
      ->check(CLI::IsMember({"never", "except-last", "always"}));
  app.add_option("--devices", cfg.devices,
                 "auto (all GPUs, else CPU), cpu, cuda, or a list such as cuda:0,cuda:1,cpu");
  app.add_option("--data", cfg.data, "folder with the Fashion-MNIST IDX files (.gz or not)");
  app.add_option("--out", cfg.out, "folder for the trained weights");
  app.add_option("--seed", cfg.seed, "random seed");
  app.add_option("--train-limit", cfg.train_limit, "use the first N training images (0: all)");
  app.add_option("--test-limit", cfg.test_limit, "use the first N test images (0: all)");
  app.add_option("--min-accuracy", cfg.min_accuracy,
                 "exit 1 if the final test accuracy (a fraction) is below this");
  app.add_flag("--quick", cfg.quick, "a brief run: hidden 256, 6000 train / 2000 test images");
  app.add_flag("--inline", cfg.inline_host, "issue all stages from the caller's thread");
  app.add_flag("--skip-if-no-data", cfg.skip_if_no_data,
               "exit 77 (a skip for ctest) when the data set is not installed");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(cfg);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 2;
}
