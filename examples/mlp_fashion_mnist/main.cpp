// A deep MLP classifier on Fashion-MNIST, split into pipeline stages and trained
// with ModelPipelineImpl::train_step under a chosen schedule (GPipe, 1F1B, ZB-H1, Auto)
// and checkpointing mode. See README.md.
//
//   stage 0: Flatten, Linear(784, H), DeferredBatchNorm, ReLU, Dropout
//   stage 1, 2: Linear(H, H), DeferredBatchNorm, ReLU, Dropout
//   stage 3: Linear(H, 10)

#include "fashion_mnist.h"
#include "training.h"

#include <mpipe/balance.h>
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
#include <memory>

namespace {

struct Config {
  examples::CommonFlags common;
  int64_t epochs = 0;  // 0: 12 on GPU, 2 with --quick / on CPU
  int64_t batch_size = 256;
  int64_t split = 64;
  int64_t hidden = 1024;
  double lr = 1e-3;
  double dropout = 0.2;
  std::string schedule = "1F1B";  // mpipe::to_string's name of a Schedule
  std::string checkpoint = "never";
  std::string balance = "none";  // none: the fixed 4-stage split; time or memory: balanced
  std::string precision = "fp32";  // fp32, bf16 or fp16 (autocast over fp32 weights)
  bool grad_scaler = false;        // loss scaling (always on with fp16)
  mpipe::distributed::ProcessGroup group;  // across processes: this rank's group
};

mpipe::ModelPipeline build_model(const Config& cfg, const std::vector<torch::Device>& devices,
                                 const torch::Tensor& sample) {
  namespace nn = torch::nn;
  auto block = [&](int64_t in) {
    return nn::Sequential(nn::Linear(in, cfg.hidden), mpipe::DeferredBatchNorm(cfg.hidden),
                          nn::ReLU(), nn::Dropout(cfg.dropout));
  };
  const auto checkpoint = cfg.checkpoint == "always"        ? mpipe::Checkpoint::Always
                          : cfg.checkpoint == "except-last" ? mpipe::Checkpoint::ExceptLast
                                                            : mpipe::Checkpoint::Never;
  const auto options = mpipe::ModelPipelineOptions()
                           .worker_threads(!cfg.common.inline_host)
                           .checkpoint(checkpoint)
                           .process_group(cfg.group);
  if (cfg.balance != "none") {
    if (cfg.group.defined()) {
      throw std::runtime_error("--balance splits the model in one process; across processes "
                               "each rank holds its range of the fixed 4-stage split");
    }
    // The same layers as one Sequential, split by measured cost (mpipe/balance.h).
    nn::Sequential layers{nn::Flatten()};
    layers->extend(*block(28 * 28));
    layers->extend(*block(cfg.hidden));
    layers->extend(*block(cfg.hidden));
    layers->push_back(nn::Linear(cfg.hidden, 10));
    layers->to(devices.front());  // profile on the device type the stages run on
    const auto costs = cfg.balance == "time"
                           ? mpipe::balance::profile_time(layers, sample)
                           : mpipe::balance::profile_memory(layers, sample, /*Adam=*/2.0);
    auto pipe = mpipe::balance::balanced(
        layers, std::vector<mpipe::DeviceArg>(devices.begin(), devices.end()), costs, options);
    std::string sizes;
    for (size_t j = 0; j < pipe->size(); ++j) {
      const auto stage = std::dynamic_pointer_cast<nn::SequentialImpl>(pipe->stage(j));
      sizes += (j ? ", " : "") + std::to_string(stage ? stage->size() : 0);
    }
    std::printf("balanced by %s: layers per stage [%s]\n", cfg.balance.c_str(), sizes.c_str());
    return pipe;
  }
  nn::Sequential first{nn::Flatten()};
  first->extend(*block(28 * 28));
  // Every stage is built on every rank (the same random draws), and each
  // rank appends its own range of them.
  const std::vector<nn::Sequential> stages{first, block(cfg.hidden), block(cfg.hidden),
                                           nn::Sequential(nn::Linear(cfg.hidden, 10))};
  mpipe::ModelPipeline pipe(options);
  for (int64_t s = 0; s < 4; ++s) {
    if (examples::holds_stage(cfg.group, s, 4)) {
      pipe->append(stages[static_cast<size_t>(s)], devices[static_cast<size_t>(s)]);
    }
  }
  return pipe;
}

double evaluate(mpipe::ModelPipeline& pipe, const examples::Dataset& test, int64_t split) {
  torch::NoGradGuard no_grad;
  pipe->eval();
  auto correct = torch::zeros({}, torch::TensorOptions(pipe->output_device()).dtype(torch::kLong));
  for (int64_t start = 0; start < test.size(); start += 1000) {
    const int64_t n = std::min<int64_t>(1000, test.size() - start);
    auto logits = pipe->forward(test.images.narrow(0, start, n), split);
    if (!logits.defined()) continue;  // a rank before the last
    correct += logits.argmax(1).eq(test.labels.narrow(0, start, n)).sum();
  }
  pipe->train();
  return static_cast<double>(correct.item<int64_t>()) / static_cast<double>(test.size());
}

int run(Config cfg) {
  examples::CommonFlags& common = cfg.common;
  const auto devices = examples::stage_devices(common.devices, 4);
  const bool cuda = devices.front().is_cuda() || devices.back().is_cuda();
  if (common.quick) {
    cfg.hidden = 256;
    if (common.train_limit == 0) common.train_limit = 6000;
    if (common.test_limit == 0) common.test_limit = 2000;
  }
  if (cfg.epochs == 0) cfg.epochs = common.quick || !cuda ? 2 : 12;
  torch::manual_seed(common.seed);
  if (cuda) torch::cuda::manual_seed_all(common.seed);

  examples::Dataset train, test;
  if (!examples::load_data(common, devices.front(), devices.back(), train, test)) {
    return examples::kSkipExitCode;
  }
  // Standardise with the training set's statistics.
  const double mean = train.images.mean().item<double>(), std = train.images.std().item<double>();
  for (auto* ds : {&train, &test}) ds->images = (ds->images - mean) / std;

  if (cfg.precision == "fp16" && !cuda) {
    throw std::runtime_error("--precision fp16 needs CUDA stages (CPU autocast is bf16 only)");
  }
  // Mixed precision: autocast reaches every stage; fp16 needs loss scaling. A
  // scope per step, as in PyTorch: autocast caches the weights' casts for the
  // scope's life, and the optimizer changes the weights between steps.
  auto precision_scope = [&]() -> std::unique_ptr<mpipe::AutocastGuard> {
    if (cfg.precision == "fp32") return nullptr;
    return std::make_unique<mpipe::AutocastGuard>(
        devices.front().type(), cfg.precision == "fp16" ? torch::kHalf : torch::kBFloat16);
  };
  cfg.group = examples::group_from_env();
  const bool report = examples::reports(cfg.group);
  auto pipe = build_model(cfg, devices, train.images.narrow(0, 0, cfg.split));
  mpipe::Schedule schedule = mpipe::Schedule::OneFOneB;
  for (auto s : {mpipe::Schedule::GPipe, mpipe::Schedule::OneFOneB, mpipe::Schedule::ZeroBubbleH1,
                 mpipe::Schedule::Auto}) {
    if (cfg.schedule == mpipe::to_string(s)) schedule = s;  // the flag holds the library's name
  }
  std::printf("mpipe %s mlp_fashion_mnist: 4 stages on %s%s, hidden %lld, %lld train / %lld "
              "test images, batch %lld in micro-batches of %lld, schedule %s, checkpoint %s, %s%s\n",
              MPIPE_VERSION_STRING, examples::device_list(devices).c_str(),
              cfg.group.defined() ? (" across " + std::to_string(cfg.group.world_size()) +
                                     " processes").c_str()
                                  : "",
              static_cast<long long>(cfg.hidden), static_cast<long long>(train.size()),
              static_cast<long long>(test.size()), static_cast<long long>(cfg.batch_size),
              static_cast<long long>(cfg.split), cfg.schedule.c_str(), cfg.checkpoint.c_str(),
              cfg.precision.c_str(), cfg.grad_scaler || cfg.precision == "fp16" ? " + loss scaling" : "");

  torch::optim::Adam opt(pipe->parameters(), torch::optim::AdamOptions(cfg.lr));
  // Every rank skips the same steps: the group joins the inf/NaN checks.
  mpipe::GradScaler scaler(mpipe::GradScalerOptions()
                               .enabled(cfg.grad_scaler || cfg.precision == "fp16")
                               .process_group(cfg.group));
  int64_t skipped = 0;
  auto loss_fn = [](const torch::Tensor& logits, const torch::Tensor& labels) {
    return torch::nn::functional::cross_entropy(logits, labels);
  };
  const int64_t steps_per_epoch = (train.size() + cfg.batch_size - 1) / cfg.batch_size;
  const int64_t total_steps = steps_per_epoch * cfg.epochs;
  int64_t step = 0;
  // --resume: the epoch, its order and its running sum where the checkpoint
  // left them (Note [Resuming the examples] in training.h).
  const auto checkpoints = examples::job_checkpoints(common, *pipe, opt, &scaler);
  const auto resumed = examples::resume(common, checkpoints.get(), report);
  const auto place = examples::EpochPlace::from(resumed);
  step = place.step;
  const int64_t first_epoch = place.epoch, first_start = place.start;
  torch::Tensor order_state = place.order_state;
  if (resumed) skipped = resumed->integer("skipped");
  double last = 0, train_seconds = 0;
  const auto t_start = examples::Clock::now();
  for (int64_t epoch = first_epoch; epoch <= cfg.epochs; ++epoch) {
    const auto t_epoch = examples::Clock::now();
    const bool resuming = resumed && epoch == first_epoch;
    if (!resuming) order_state = torch::Tensor();
    auto order = examples::epoch_order(train.size(), order_state);
    auto order_in = order.to(devices.front()), order_out = order.to(devices.back());
    auto loss_sum = resuming ? resumed->tensor("loss_sum").to(devices.back())
                             : torch::zeros({}, torch::TensorOptions(devices.back()));
    for (int64_t start = resuming ? first_start : 0; start < train.size();
         start += cfg.batch_size, ++step) {
      const int64_t n = std::min(cfg.batch_size, train.size() - start);
      auto x = train.images.index_select(0, order_in.narrow(0, start, n));
      auto y = train.labels.index_select(0, order_out.narrow(0, start, n));
      examples::set_cosine_lr<torch::optim::AdamOptions>(opt, cfg.lr, step, total_steps);
      opt.zero_grad();
      const bool recorded = examples::begin_recorded_step(pipe, common, step);
      at::Tensor loss;
      {
        const auto autocast = precision_scope();
        loss = pipe->train_step(
            x, y, loss_fn,
            mpipe::TrainStepOptions(cfg.split).schedule(schedule).loss_scale(scaler.get_scale()));
      }
      if (loss.defined()) loss_sum += loss * n;  // the last rank's, across processes
      if (recorded) examples::end_recorded_step(pipe, common);
      skipped += scaler.step(opt) ? 0 : 1;  // opt.step() unless a gradient overflowed
      scaler.update();
      examples::checkpoint_if_due(common, checkpoints.get(), step + 1, total_steps, [&] {
        examples::Position at;
        examples::EpochPlace{step + 1, epoch, start + cfg.batch_size, order_state}.put(at);
        at.set("skipped", skipped);
        at.set("loss_sum", loss_sum);
        return at;
      });
    }
    const double mean_loss = loss_sum.item<double>() / train.size();
    if (scaler.is_enabled() && report) {
      std::printf("loss scale %g, %lld steps skipped so far\n", scaler.get_scale(),
                  static_cast<long long>(skipped));
    }
    const double epoch_train_s = examples::seconds_since(t_epoch);
    train_seconds += epoch_train_s;
    double train_acc = 0;
    {
      const auto autocast = precision_scope();
      train_acc = evaluate(pipe, train, cfg.split);
      last = evaluate(pipe, test, cfg.split);
    }
    if (report) {
      examples::print_epoch(epoch, cfg.epochs, mean_loss, train_acc, last, train.size(),
                            epoch_train_s, examples::seconds_since(t_start));
    }
  }
  std::filesystem::create_directories(common.out);
  std::string path = common.out + "/mlp_fashion_mnist.pt";
  if (cfg.group.defined()) path = cfg.group.rank_path(path);  // each rank its stages
  torch::save(pipe, path);
  if (!report) {
    std::printf("weights of this rank's stages saved to %s\n", path.c_str());
    return 0;
  }
  std::printf("final test accuracy %.2f%%; %s of training; weights saved to %s\n", 100 * last,
              examples::format_duration(train_seconds).c_str(), path.c_str());
  return examples::accuracy_exit_code(last, common.min_accuracy);
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  cfg.common.out = "mlp_fashion_mnist_out";
  CLI::App app{"Train a pipelined MLP on Fashion-MNIST with GPipe or 1F1B"};
  app.add_option("--epochs", cfg.epochs, "epochs (default: 12 on GPU, 2 on CPU or --quick)");
  app.add_option("-b,--batch-size", cfg.batch_size, "batch size")->check(CLI::PositiveNumber);
  app.add_option("--split", cfg.split, "micro-batch rows")->check(CLI::PositiveNumber);
  app.add_option("--hidden", cfg.hidden, "hidden units per layer")->check(CLI::PositiveNumber);
  app.add_option("--lr", cfg.lr, "Adam learning rate (cosine-annealed to 0)");
  app.add_option("--dropout", cfg.dropout, "dropout probability");
  app.add_option("--schedule", cfg.schedule, "GPipe, 1F1B, ZB-H1 or Auto (any case)")
      ->transform(CLI::IsMember({"GPipe", "1F1B", "ZB-H1", "Auto"}, CLI::ignore_case));
  app.add_option("--checkpoint", cfg.checkpoint, "never, except-last or always")
      ->check(CLI::IsMember({"never", "except-last", "always"}));
  app.add_option("--balance", cfg.balance,
                 "none (a fixed split), or split the layers into 4 stages by profiled time or "
                 "memory (with Adam's state)")
      ->check(CLI::IsMember({"none", "time", "memory"}));
  app.add_option("--precision", cfg.precision,
                 "fp32, bf16 (autocast) or fp16 (autocast with loss scaling; CUDA only)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_flag("--grad-scaler", cfg.grad_scaler, "scale the loss (mpipe::GradScaler) at any precision");
  examples::add_common_flags(app, cfg.common,
                             "a brief run: hidden 256, 6000 train / 2000 test images");
  CLI11_PARSE(app, argc, argv);
  return examples::run_guarded([&] { return run(cfg); });
}
