// A convolutional spiking network trained on Fashion-MNIST with
// mpipe::ModelPipeline::constant_train_step over T time steps. See README.md.
//
//   {Conv3x3(C)-BN-IF-MaxPool2} x 2 -> Linear(C*49, H)-IF -> Linear(H, 10)
//
// (with --dropout, an snn::Dropout before each Linear layer)
//
// The image is fed directly (the first Conv-BN-IF layer encodes it as
// spikes), or, with --poisson, as Poisson spike frames through
// sequence_forward. With --time-chunk K the stages are multi-step and take K
// time steps per call. The output layer is a Linear readout without neurons:
// its mean over the T steps gives the logits of a cross-entropy loss (labels
// smoothed) and the prediction. With --loss mse it is followed by IF neurons,
// whose firing rate is the prediction, and the loss is the MSE between the
// rate and the one-hot label.

#include "fashion_mnist.h"
#include "plot.h"
#include "training.h"

#include <mpipe/autocast.h>
#include <mpipe/mpipe.h>
#include <mpipe/snn.h>

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/padding.h>
#include <torch/nn/modules/pooling.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <vector>

namespace {

struct Config {
  examples::CommonFlags common;
  int64_t epochs = 0;  // 0: 60 on GPU, 4 on CPU (2 with --quick)
  int64_t batch_size = 128;
  int64_t time_steps = 0;  // 0: 8 on GPU, 4 on CPU
  double lr = 0.1;
  double momentum = 0.9;
  double weight_decay = 0;  // SGD's L2 penalty on the conv and linear weights
  double label_smoothing = 0.1;  // the loss's target: (1 - e) one-hot + e / 10
  double erase = 0.5;            // probability of random erasing per training image
  double ema = 0;           // decay of the evaluated weight average; 0: the weights themselves
  double dropout = 0;       // snn::Dropout before each Linear layer; 0: none
  // BatchNorm's training statistics in multi-step stages: "chunk", over the
  // T*N rows of a time chunk (SpikingJelly's), or "step", each step's own.
  std::string bn_stats = "chunk";
  int64_t channels = 128;
  int64_t hidden = 2048;
  std::string eval_path;
  int64_t test_batch = 1000;
  bool quick_on_cpu = false;
  bool no_tf32 = false;
  // Multi-step stages fed K steps per call; -1: the pipeline's choice on a
  // GPU, single-step stages on the CPU; 0: single-step stages.
  int64_t time_chunk = -1;
  int64_t micro_batches = 0;  // of the time-step calls; 0: the pipeline's choice
  bool no_augment = false;  // augmentation is on for full runs, off with --quick
  int64_t crop_pad = 0;     // 0: flips only
  bool poisson = false;
  std::string precision = "fp32";
  std::string fc_neuron = "if";  // the fully connected layers' neurons: if or lif
  std::string conv_neuron = "if";  // the conv blocks' neurons: if or plif
  // mse: the output layer spikes, the loss is the MSE of its firing rates;
  // ce: the output layer is a plain Linear read out as logits (their mean
  // over T), the loss is the cross-entropy.
  std::string loss = "ce";
  mpipe::distributed::ProcessGroup group;  // across processes: this rank's group
};

mpipe::ModelPipeline build_model(const Config& cfg, const std::vector<torch::Device>& devices) {
  namespace nn = torch::nn;
  namespace snn = mpipe::snn;
  const bool multi = cfg.time_chunk != 0;
  const auto mode = multi ? snn::StepMode::Multi : snn::StepMode::Single;
  const auto neuron =
      snn::IFNodeOptions().surrogate(snn::Surrogate::atan()).detach_reset(true).step_mode(mode);
  const int64_t c = cfg.channels;
  // PLIF: a learnable time constant per conv block (Fang et al. 2021).
  snn::SpikingConvBlockOptions::Neuron conv_neuron = neuron;
  if (cfg.conv_neuron == "plif") {
    conv_neuron = snn::ParametricLIFNodeOptions().surrogate(snn::Surrogate::atan()).detach_reset(true).step_mode(mode);
  }
  // Conv3x3 (no bias), BatchNorm (statistics over a multi-step chunk's T*N
  // rows, or per time step with --bn-stats step and in single-step mode),
  // IF, MaxPool2.
  const bool per_step = cfg.bn_stats == "step";
  nn::Sequential conv1(snn::SpikingConvBlock(
      snn::SpikingConvBlockOptions(1, c).pool(2).neuron(conv_neuron).step_batch_stats(per_step)));
  nn::Sequential conv2(snn::SpikingConvBlock(
      snn::SpikingConvBlockOptions(c, c).pool(2).neuron(conv_neuron).step_batch_stats(per_step)));
  nn::Sequential fc1, fc2;
  nn::Flatten flatten;
  nn::Linear linear1(nn::LinearOptions(c * 7 * 7, cfg.hidden).bias(false));
  nn::Linear linear2(nn::LinearOptions(cfg.hidden, 10).bias(false));
  // One mask per image for all T steps (Note [Dropout across time steps]).
  if (cfg.dropout > 0) {
    fc1->push_back(snn::Dropout(snn::DropoutOptions(cfg.dropout).step_mode(mode)));
    fc2->push_back(snn::Dropout(snn::DropoutOptions(cfg.dropout).step_mode(mode)));
  }
  if (multi) {  // [k, N, ...] per call: the stateless layers on [k*N, ...]
    fc1->push_back(snn::SeqToANN(flatten, linear1));
    fc2->push_back(snn::SeqToANN(linear2));
  } else {
    fc1->push_back(flatten);
    fc1->push_back(linear1);
    fc2->push_back(linear2);
  }
  // LIF (tau 2) in the fully connected part, or IF as in the conv blocks.
  const auto lif = snn::LIFNodeOptions().surrogate(snn::Surrogate::atan()).detach_reset(true).step_mode(mode);
  for (auto* fc : {&fc1, &fc2}) {
    if (fc == &fc2 && cfg.loss == "ce") break;  // the readout: no neuron
    if (cfg.fc_neuron == "lif") {
      (*fc)->push_back(snn::LIFNode(lif));
    } else {
      (*fc)->push_back(snn::IFNode(neuron));
    }
  }
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions()
                                .worker_threads(!cfg.common.inline_host)
                                .step_mode(mode)
                                .time_chunk(std::max<int64_t>(cfg.time_chunk, 0))
                                .time_micro_batches(cfg.micro_batches)
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

/// Random erasing (Zhong et al. 2017): with probability `p` an image gets a
/// rectangle of 2-40 % of its area (less where the aspect ratio, 0.3-3.3,
/// makes a side longer than the image's), set to 0.
torch::Tensor erase(const torch::Tensor& x, double p) {
  const int64_t n = x.size(0), h = x.size(2), w = x.size(3);
  const auto u = torch::rand({n, 5, 1, 1}, x.options());  // all draws at once, on the device
  const auto area = (0.02 + 0.38 * u.select(1, 0)) * static_cast<double>(h * w);
  const auto ratio = torch::exp(std::log(0.3) + (std::log(3.3) - std::log(0.3)) * u.select(1, 1));
  const auto eh = torch::sqrt(area * ratio).round().clamp(1, h);
  const auto ew = torch::sqrt(area / ratio).round().clamp(1, w);
  const auto y0 = (u.select(1, 2) * (h - eh + 1)).floor();
  const auto x0 = (u.select(1, 3) * (w - ew + 1)).floor();
  const auto rows = torch::arange(h, x.options()).view({1, h, 1});
  const auto cols = torch::arange(w, x.options()).view({1, 1, w});
  const auto inside = (rows >= y0) & (rows < y0 + eh) & (cols >= x0) & (cols < x0 + ew) &
                      (u.select(1, 4) < p);
  return x.masked_fill(inside.unsqueeze(1), 0);
}

/// Random crops (the image shifted by up to `pad` pixels each way, zeros
/// shifted in) and horizontal flips of a batch [N, 1, 28, 28], on its device.
torch::Tensor augment(const torch::Tensor& x, int64_t pad) {
  const int64_t n = x.size(0), h = x.size(2), w = x.size(3);
  const auto opts = torch::TensorOptions(x.device()).dtype(torch::kLong);
  torch::Tensor out = x;
  if (pad > 0) {
    namespace F = torch::nn::functional;
    const auto padded = F::pad(x, F::PadFuncOptions({pad, pad, pad, pad}));
    const auto dy = torch::randint(0, 2 * pad + 1, {n, 1, 1}, opts);
    const auto dx = torch::randint(0, 2 * pad + 1, {n, 1, 1}, opts);
    const auto rows = torch::arange(h, opts).view({1, h, 1}) + dy;
    const auto cols = torch::arange(w, opts).view({1, 1, w}) + dx;
    const auto batch = torch::arange(n, opts).view({n, 1, 1});
    out = padded.select(1, 0).index({batch, rows, cols}).unsqueeze(1);
  }
  const auto flip = torch::rand({n, 1, 1, 1}, x.options()) < 0.5;
  return torch::where(flip, out.flip({3}), out);
}

/// Poisson spike frames [T, N, ...] of images with intensities in [0, 1].
torch::Tensor poisson_frames(const torch::Tensor& x, int64_t T) {
  std::vector<int64_t> shape{T};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  // A dense copy per step: each frame gets its own draws.
  return mpipe::snn::poisson_encode(x.unsqueeze(0).expand(shape).contiguous());
}

/// The spikes of the output layer summed over the T steps: the image held
/// for T steps (constant_forward), or its Poisson frames (sequence_forward).
torch::Tensor summed_output(mpipe::ModelPipeline& pipe, const torch::Tensor& x, const Config& cfg) {
  if (cfg.poisson) return pipe->sequence_forward(poisson_frames(x, cfg.time_steps), true);
  return pipe->constant_forward(x, cfg.time_steps);
}

/// Autocast for --precision bf16 on the stages' device type; nothing for fp32.
std::unique_ptr<mpipe::AutocastGuard> precision_scope(const Config& cfg, const torch::Device& d) {
  if (cfg.precision != "bf16") return nullptr;
  return std::make_unique<mpipe::AutocastGuard>(d.type(), torch::kBFloat16);
}

/// What the first line says of the recipe beyond the defaults' settings.
std::string recipe_extras(const Config& cfg, bool multi_step) {
  std::string out;
  char buf[96];
  auto add = [&](const char* format, double value) {
    std::snprintf(buf, sizeof buf, format, value);
    out += buf;
  };
  if (multi_step) out += ", BatchNorm per " + cfg.bn_stats;
  if (cfg.conv_neuron == "plif") out += ", PLIF conv neurons";
  if (cfg.loss == "ce") out += ", Linear readout and cross-entropy";
  if (cfg.label_smoothing > 0) add(", label smoothing %g", cfg.label_smoothing);
  if (cfg.weight_decay > 0) add(", weight decay %g", cfg.weight_decay);
  if (cfg.dropout > 0) add(", dropout %g", cfg.dropout);
  if (cfg.ema > 0) add(", weights averaged (EMA %g)", cfg.ema);
  return out;
}

/// The loss of the output's mean over T steps [N, 10]: with --loss mse the
/// MSE between the firing rates and the one-hot labels, with --loss ce the
/// cross-entropy of the logits; either with the labels smoothed by
/// --label-smoothing.
torch::Tensor loss_of(const torch::Tensor& mean, const torch::Tensor& labels, const Config& cfg) {
  const double e = cfg.label_smoothing;
  if (cfg.loss == "ce") {
    namespace F = torch::nn::functional;
    return F::cross_entropy(mean, labels, F::CrossEntropyFuncOptions().label_smoothing(e));
  }
  // (1 - e) one-hot + e / 10
  const auto target = torch::full_like(mean, e / mean.size(1))
                          .scatter_(1, labels.unsqueeze(1), 1 - e + e / mean.size(1));
  return torch::mse_loss(mean, target);
}

struct Evaluation {
  double accuracy = 0;  // fraction
  double loss = 0;      // loss_of's mean
};

/// Accuracy and loss of `pipe` on `test` (on the last rank; 0 on the others).
Evaluation evaluate(mpipe::ModelPipeline& pipe, const examples::Dataset& test, const Config& cfg) {
  torch::NoGradGuard no_grad;
  pipe->eval();
  torch::Tensor correct = torch::zeros({}, torch::kLong).to(pipe->output_device());
  torch::Tensor loss = torch::zeros({}).to(pipe->output_device());
  for (int64_t start = 0; start < test.size(); start += cfg.test_batch) {
    const int64_t n = std::min(cfg.test_batch, test.size() - start);
    auto x = test.images.narrow(0, start, n);
    auto y = test.labels.narrow(0, start, n);
    torch::Tensor sum;
    {
      const auto precision = precision_scope(cfg, pipe->device(0));
      sum = summed_output(pipe, x, cfg);
    }
    mpipe::reset_states(*pipe);
    if (!sum.defined()) continue;  // a rank before the last
    const auto mean = mpipe::snn::rate_from_sum(sum, cfg.time_steps).to(torch::kFloat);
    correct += mpipe::snn::predict(mean).eq(y).sum();
    loss += loss_of(mean, y, cfg) * n;
  }
  pipe->train();
  const auto size = static_cast<double>(test.size());
  return {static_cast<double>(correct.item<int64_t>()) / size, loss.item<double>() / size};
}

/// --eval: loads `path` into `pipe`, which must have the layers the file
/// has. torch::load fills the layers a model has and ignores the others, so
/// weights saved with the spiking output (--loss mse, the default before
/// 2026-12-07) would otherwise load into the readout without a word.
void load_same_model(mpipe::ModelPipeline& pipe, const std::string& path) {
  const char* hint = ": give --eval the model flags it was trained with (--loss, --conv-neuron, "
                     "--fc-neuron, --channels, --hidden, --dropout; weights saved before "
                     "2026-12-07 need --loss mse)";
  try {
    torch::load(pipe, path);
  } catch (const c10::Error& e) {
    throw std::runtime_error(path + " does not fit this model (" + e.what_without_backtrace() + ")" + hint);
  }
  torch::serialize::InputArchive archive, stages;
  archive.load_from(path);
  if (!archive.try_read("stages", stages)) return;
  for (size_t k = 0; k < pipe->size(); ++k) {
    torch::serialize::InputArchive saved, extra;
    const auto layers = pipe->named_children()["stages"]->children()[k]->children().size();
    if (stages.try_read(std::to_string(k), saved) && saved.try_read(std::to_string(layers), extra)) {
      throw std::runtime_error(path + " has more layers in stage " + std::to_string(k) +
                               " than this model (" + std::to_string(layers) + ")" + hint);
    }
  }
}

/// accuracy.svg (train and test accuracy per epoch) and loss.svg (the
/// training loss and the test loss per epoch) in `dir`.
void write_plots(const std::string& dir, const Config& cfg, double train_seconds, double last,
                 const std::vector<double>& train_acc, const std::vector<double>& test_acc,
                 const std::vector<double>& train_loss, const std::vector<double>& test_loss) {
  char title[200];
  std::snprintf(title, sizeof title, "snn_fashion_mnist, seed %lld: final test accuracy %.2f %% after %s of training",
                static_cast<long long>(cfg.common.seed), 100 * last,
                examples::format_duration(train_seconds).c_str());
  examples::write_line_plot(dir + "/accuracy.svg", title,
                            {{"train accuracy", "#d62728", train_acc}, {"test accuracy", "#1f77b4", test_acc}},
                            "epoch", /*percent=*/true, std::nullopt, 1.0);
  std::snprintf(title, sizeof title, "snn_fashion_mnist, seed %lld: %s per epoch",
                static_cast<long long>(cfg.common.seed),
                cfg.loss == "ce" ? "cross-entropy of the readout" : "MSE of the firing rates");
  examples::write_line_plot(dir + "/loss.svg", title,
                            {{"training loss", "#d62728", train_loss}, {"test loss", "#1f77b4", test_loss}},
                            "epoch", /*percent=*/false, 0.0);
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
  if (cfg.epochs == 0) cfg.epochs = common.quick ? 2 : (cuda ? 60 : 4);
  if (cfg.time_steps == 0) cfg.time_steps = cuda && !common.quick ? 8 : 4;
  // On the CPU single-step stages measured faster for this model (README.md).
  if (cfg.time_chunk < 0 && !cuda) cfg.time_chunk = 0;
  const bool augmenting = !cfg.no_augment && !common.quick;
  if (cfg.precision != "fp32" && cfg.precision != "bf16") {
    throw std::runtime_error("--precision must be fp32 or bf16, got " + cfg.precision);
  }
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
  if (cfg.poisson && cfg.group.defined()) {
    throw std::runtime_error("--poisson trains through sequence_forward, whose backward does not "
                             "cross processes; run it in one process");
  }
  auto pipe = build_model(cfg, devices);
  const bool multi_step = cfg.time_chunk != 0;  // BatchNorm statistics matter only there
  std::printf("mpipe %s snn_fashion_mnist: 4 stages on %s%s, T=%lld, %lld train / %lld test "
              "images, batch %lld, channels %lld, hidden %lld, %s FC neurons, %s, %s, %s, %s%s%s\n",
              MPIPE_VERSION_STRING, examples::device_list(devices).c_str(),
              cfg.group.defined() ? (" across " + std::to_string(cfg.group.world_size()) +
                                     " processes").c_str()
                                  : "",
              static_cast<long long>(cfg.time_steps), static_cast<long long>(train.size()),
              static_cast<long long>(test.size()), static_cast<long long>(cfg.batch_size),
              static_cast<long long>(cfg.channels), static_cast<long long>(cfg.hidden),
              cfg.fc_neuron == "lif" ? "LIF" : "IF", cfg.time_chunk > 0   ? ("time chunks of " + std::to_string(cfg.time_chunk)).c_str()
              : cfg.time_chunk < 0 ? "time chunks of the pipeline's choice"
                                   : "single-step stages",
              cfg.poisson ? "Poisson frames" : "image held for T steps",
              augmenting ? ("crop +-" + std::to_string(cfg.crop_pad) + ", flip" +
                            (cfg.erase > 0 ? ", random erasing " + std::to_string(cfg.erase).substr(0, 4) : "")).c_str()
                         : "no augmentation",
              cfg.precision.c_str(),
              recipe_extras(cfg, multi_step).c_str(),
              common.quick ? " (quick)" : "");

  if (!cfg.eval_path.empty()) {
    load_same_model(pipe, cfg.group.defined() ? cfg.group.rank_path(cfg.eval_path) : cfg.eval_path);
    const double acc = evaluate(pipe, test, cfg).accuracy;
    if (!report) return 0;
    std::printf("test accuracy of %s: %.2f%%\n", cfg.eval_path.c_str(), 100 * acc);
    return examples::accuracy_exit_code(acc, common.min_accuracy);
  }

  // Weight decay on the conv and linear weights only: not on BatchNorm's
  // scales and shifts, nor on PLIF's time constants.
  const auto sgd = torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum);
  std::vector<torch::Tensor> decayed, undecayed;
  for (const auto& p : pipe->parameters()) (p.dim() > 1 ? decayed : undecayed).push_back(p);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decayed.empty()) {
    groups.emplace_back(decayed, std::make_unique<torch::optim::SGDOptions>(
                                     torch::optim::SGDOptions(sgd).weight_decay(cfg.weight_decay)));
  }
  if (!undecayed.empty()) {
    groups.emplace_back(undecayed, std::make_unique<torch::optim::SGDOptions>(sgd));
  }
  torch::optim::SGD opt(groups, sgd);
  // --ema: the average is what is evaluated and saved (Note [Averaged weights]).
  std::unique_ptr<examples::WeightAverage> average;
  if (cfg.ema > 0) average = std::make_unique<examples::WeightAverage>(*pipe, cfg.ema);
  const int64_t steps_per_epoch = (train.size() + cfg.batch_size - 1) / cfg.batch_size;
  const int64_t total_steps = steps_per_epoch * cfg.epochs;
  int64_t step = 0;
  double best = 0, last = 0, train_seconds = 0;
  int64_t best_epoch = 0;
  std::vector<double> train_curve, test_curve, loss_curve, test_loss_curve;
  // --resume: the epoch, its order, its running sums, the curves and the
  // weight average where the checkpoint left them (Note [Resuming the
  // examples] in training.h).
  const auto checkpoints = examples::job_checkpoints(common, *pipe, opt);
  const auto resumed = examples::resume(common, checkpoints.get(), report);
  const auto place = examples::EpochPlace::from(resumed);
  step = place.step;
  const int64_t first_epoch = place.epoch, first_start = place.start;
  torch::Tensor order_state = place.order_state;
  if (resumed) {
    best = resumed->real("best");
    best_epoch = resumed->integer("best_epoch");
    train_curve = resumed->reals("train_curve");
    test_curve = resumed->reals("test_curve");
    loss_curve = resumed->reals("loss_curve");
    test_loss_curve = resumed->reals("test_loss_curve");
    if (average) average->restore(resumed->tensors("average"), resumed->integer("average_updates"));
  }
  // Sums stay on the device: one read-back per epoch. The loss function adds
  // to `correct`, so it is one tensor for the whole run: a training step
  // replayed from a CUDA graph adds to the tensor its capture saw.
  torch::Tensor loss_sum = torch::zeros({}, torch::TensorOptions(devices.back()));
  torch::Tensor correct = torch::zeros({}, torch::TensorOptions(devices.back()).dtype(torch::kLong));
  const auto t_start = examples::Clock::now();
  for (int64_t epoch = first_epoch; epoch <= cfg.epochs; ++epoch) {
    const auto t_epoch = examples::Clock::now();
    const bool resuming = resumed && epoch == first_epoch;
    if (!resuming) order_state = torch::Tensor();
    auto order = examples::epoch_order(train.size(), order_state);
    auto order_in = order.to(devices.front());
    auto order_out = order.to(devices.back());
    loss_sum.zero_();
    correct.zero_();
    if (resuming) {
      loss_sum.copy_(resumed->tensor("loss_sum"));
      correct.copy_(resumed->tensor("correct"));
    }
    for (int64_t start = resuming ? first_start : 0; start < train.size();
         start += cfg.batch_size, ++step) {
      const int64_t n = std::min(cfg.batch_size, train.size() - start);
      auto x = train.images.index_select(0, order_in.narrow(0, start, n));
      if (augmenting) x = augment(x, cfg.crop_pad);
      if (augmenting && cfg.erase > 0) x = erase(x, cfg.erase);
      auto y = train.labels.index_select(0, order_out.narrow(0, start, n));
      examples::set_cosine_lr<torch::optim::SGDOptions>(opt, cfg.lr, step, total_steps);
      const bool recorded = examples::begin_recorded_step(pipe, common, step);
      // The loss of the output's mean over T steps (on the last stage, the
      // last rank across processes); the states are reset before and after.
      auto loss_fn = [&](const torch::Tensor& summed, const torch::Tensor& labels) {
        const auto mean = mpipe::snn::rate_from_sum(summed, cfg.time_steps);
        correct += mpipe::snn::predict(mean.detach()).eq(labels).sum();
        return loss_of(mean, labels, cfg);
      };
      opt.zero_grad();
      torch::Tensor loss;
      {
        const auto precision = precision_scope(cfg, devices.front());
        if (cfg.poisson) {  // Poisson frames: sequence_forward, then backward
          const auto sum = pipe->sequence_forward(poisson_frames(x, cfg.time_steps), true);
          if (sum.defined()) {
            loss = loss_fn(sum, y);
            loss.backward();
            loss = loss.detach();
          }
          mpipe::reset_states(*pipe);
        } else {
          loss = pipe->constant_train_step(x, cfg.time_steps, y, loss_fn);
        }
      }
      if (recorded) examples::end_recorded_step(pipe, common);
      opt.step();
      if (average) average->update();
      if (loss.defined()) loss_sum += loss * n;
      examples::checkpoint_if_due(common, checkpoints.get(), step + 1, total_steps, [&] {
        examples::Position at;
        examples::EpochPlace{step + 1, epoch, start + cfg.batch_size, order_state}.put(at);
        at.set("loss_sum", loss_sum);
        at.set("correct", correct);
        at.set("best", best);
        at.set("best_epoch", best_epoch);
        at.set("train_curve", train_curve);
        at.set("test_curve", test_curve);
        at.set("loss_curve", loss_curve);
        at.set("test_loss_curve", test_loss_curve);
        at.set("average", average ? average->average() : std::vector<torch::Tensor>());
        at.set("average_updates", average ? average->updates() : int64_t{0});
        return at;
      });
    }
    const double mean_loss = loss_sum.item<double>() / train.size();
    const double train_acc = static_cast<double>(correct.item<int64_t>()) / train.size();
    const double epoch_train_s = examples::seconds_since(t_epoch);
    train_seconds += epoch_train_s;
    Evaluation tested;
    {
      const examples::WeightAverage::Applied averaged(average.get());
      tested = evaluate(pipe, test, cfg);
    }
    last = tested.accuracy;
    train_curve.push_back(train_acc);
    test_curve.push_back(last);
    loss_curve.push_back(mean_loss);
    test_loss_curve.push_back(tested.loss);
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
  {
    const examples::WeightAverage::Applied averaged(average.get());
    torch::save(pipe, path);
  }
  if (!report) {
    std::printf("weights of this rank's stages saved to %s\n", path.c_str());
    return 0;
  }
  write_plots(common.out, cfg, train_seconds, last, train_curve, test_curve, loss_curve,
              test_loss_curve);
  std::printf("final test accuracy %.2f%% (best %.2f%% at epoch %lld); %s of training "
              "(%s with evaluation); weights saved to %s, accuracy and loss plots to "
              "%s/accuracy.svg and %s/loss.svg\n",
              100 * last, 100 * best, static_cast<long long>(best_epoch),
              examples::format_duration(train_seconds).c_str(),
              examples::format_duration(examples::seconds_since(t_start)).c_str(), path.c_str(),
              common.out.c_str(), common.out.c_str());
  return examples::accuracy_exit_code(last, common.min_accuracy);
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  cfg.common.out = "snn_fashion_mnist_out";
  CLI::App app{"Train a convolutional SNN on Fashion-MNIST through an mpipe pipeline"};
  app.add_option("--epochs", cfg.epochs, "epochs (default: 60 on GPU, 4 on CPU, 2 with --quick)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("-b,--batch-size", cfg.batch_size, "training batch size")
      ->check(CLI::PositiveNumber);
  app.add_option("-T,--time-steps", cfg.time_steps, "time steps per image (default: 8 on GPU, 4 on "
                 "CPU and with --quick)")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", cfg.lr, "SGD learning rate (cosine-annealed to 0)");
  app.add_option("--momentum", cfg.momentum, "SGD momentum");
  app.add_option("--ema", cfg.ema,
                 "evaluate and save an exponential moving average of the weights with this "
                 "decay (e.g. 0.999); 0, the default: the weights themselves")
      ->check(CLI::Range(0.0, 0.999999));
  app.add_option("--weight-decay", cfg.weight_decay,
                 "SGD weight decay (L2) of the conv and linear weights (not BatchNorm's, nor PLIF's "
                 "time constants), default 0")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--loss", cfg.loss,
                 "ce: the output layer is a Linear readout without neurons, its mean over T the "
                 "logits of a cross-entropy (default); mse: the output layer spikes (IF or LIF), "
                 "the loss is the MSE of its firing rates")
      ->check(CLI::IsMember({"mse", "ce"}));
  app.add_option("--label-smoothing", cfg.label_smoothing,
                 "the loss's target: (1 - E) one-hot + E / 10; default 0.1")
      ->check(CLI::Range(0.0, 0.5));
  app.add_option("--erase", cfg.erase,
                 "random erasing: the probability that a training image gets a zeroed rectangle "
                 "(up to 40 % of its area); default 0.5; off with --no-augment and --quick")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--dropout", cfg.dropout,
                 "drop probability of snn::Dropout (one mask for all T steps) before each "
                 "Linear layer; default 0, none")
      ->check(CLI::Range(0.0, 0.99));
  app.add_option("--bn-stats", cfg.bn_stats,
                 "BatchNorm's training statistics in multi-step stages: chunk (over the T*N "
                 "rows of a time chunk, SpikingJelly's; default) or step (each step's own)")
      ->check(CLI::IsMember({"chunk", "step"}));
  app.add_option("--channels", cfg.channels, "conv channels")->check(CLI::PositiveNumber);
  app.add_option("--hidden", cfg.hidden, "hidden units of the first linear layer")
      ->check(CLI::PositiveNumber);
  app.add_option("--eval", cfg.eval_path, "evaluate saved weights instead of training");
  app.add_option("--test-batch", cfg.test_batch, "evaluation batch size")
      ->check(CLI::PositiveNumber);
  app.add_flag("--quick-on-cpu", cfg.quick_on_cpu, "--quick when no GPU is used");
  app.add_flag("--no-tf32", cfg.no_tf32, "keep fp32 matrix products and convolutions exact");
  app.add_option("--time-chunk", cfg.time_chunk,
                 "multi-step stages fed K time steps per call; 0: single-step stages (default: "
                 "multi-step stages with the pipeline's chunk, all T steps on one GPU; "
                 "single-step stages on the CPU)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--micro-batches", cfg.micro_batches,
                 "cut each batch of the time-step calls into N micro-batches, each with its own "
                 "neuron state and batch statistics (default 0: the pipeline's choice)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--no-augment", cfg.no_augment,
               "no random crops, flips and erasing of the training images (always off with --quick)");
  app.add_option("--crop-pad", cfg.crop_pad,
                 "random crops shift the image by up to this many pixels (default 0: flips only)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--poisson", cfg.poisson,
               "feed Poisson spike frames (a new draw every step) through sequence_forward instead "
               "of holding the image for T steps");
  app.add_option("--precision", cfg.precision, "fp32, or bf16 (autocast over fp32 weights)");
  app.add_option("--fc-neuron", cfg.fc_neuron, "neurons of the fully connected layers: if or lif (tau 2)")
      ->check(CLI::IsMember({"if", "lif"}));
  app.add_option("--conv-neuron", cfg.conv_neuron,
                 "neurons of the conv blocks: if, or plif (a learnable time constant, from tau 2)")
      ->check(CLI::IsMember({"if", "plif"}));
  examples::add_common_flags(
      app, cfg.common, "a brief run for CPUs: small model, 4000 train / 2000 test images, 2 epochs");
  CLI11_PARSE(app, argc, argv);
  return examples::run_guarded([&] { return run(cfg); });
}
