#pragma once

// Small pieces the training examples share: device lists, timing, progress
// text, learning-rate schedules.

#include "fashion_mnist.h"

#include <mpipe/device.h>
#include <mpipe/distributed.h>
#include <mpipe/job_checkpoints.h>
#include <mpipe/model_pipeline.h>

#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <cstdint>
#include <functional>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace examples {

/// Devices for `n_stages` stages from a --devices flag:
///   "auto": all visible GPUs (stage i on GPU i % count), else the CPU;
///   "cpu";  "cuda": all visible GPUs;
///   a comma-separated list such as "cuda:0,cuda:1,cpu", used cyclically.
inline std::vector<torch::Device> stage_devices(const std::string& spec, int64_t n_stages) {
  std::vector<std::string> names;
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  if (spec == "auto" || spec == "cuda") {
    if (gpus == 0 && spec == "cuda") {
      throw std::runtime_error("--devices cuda: no CUDA device is visible; use --devices cpu");
    }
    for (int64_t i = 0; i < std::max<int64_t>(gpus, 1); ++i) {
      names.push_back(gpus > 0 ? "cuda:" + std::to_string(i) : "cpu");
    }
  } else {
    std::stringstream in(spec);
    for (std::string item; std::getline(in, item, ',');) {
      if (!item.empty()) names.push_back(item);
    }
  }
  if (names.empty()) throw std::runtime_error("--devices: no device in \"" + spec + "\"");
  std::vector<torch::Device> out;
  for (int64_t i = 0; i < n_stages; ++i) {
    out.push_back(mpipe::resolve_device(names[static_cast<size_t>(i) % names.size()]));
  }
  return out;
}

/// Across processes: the group when the program was started as several ranks
/// (WORLD_SIZE > 1: mpipe-launch -n N or torchrun); else undefined (one process).
inline mpipe::distributed::ProcessGroup group_from_env() {
  const char* world = std::getenv("WORLD_SIZE");
  if (world == nullptr || std::atoll(world) <= 1) return {};
  return mpipe::distributed::init_from_env();
}

/// Whether this process appends stage `s` of `n`: all of them in one
/// process, its range of them across processes.
inline bool holds_stage(const mpipe::distributed::ProcessGroup& group, int64_t s, int64_t n) {
  if (!group.defined()) return true;
  const auto range = group.stage_range(n);
  return s >= range.first && s < range.second;
}

/// Whether this process reports results: the one process, or the last rank.
inline bool reports(const mpipe::distributed::ProcessGroup& group) {
  return !group.defined() || group.is_last();
}

inline std::string device_list(const std::vector<torch::Device>& devices) {
  std::string s;
  for (size_t i = 0; i < devices.size(); ++i) s += (i ? ", " : "") + devices[i].str();
  return "[" + s + "]";
}

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// "1h02m", "3m05s", "42s".
inline std::string format_duration(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s % 3600) / 60);
  } else if (s >= 60) {
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%lds", s);
  }
  return buf;
}

/// Cosine annealing from `base_lr` to 0 over `total_steps`, set on every
/// group of an optimizer whose options type is `Options` (SGDOptions, ...).
template <typename Options>
void set_cosine_lr(torch::optim::Optimizer& opt, double base_lr, int64_t step,
                   int64_t total_steps) {
  const double lr = 0.5 * base_lr *
                    (1 + std::cos(M_PI * static_cast<double>(step) /
                                  static_cast<double>(std::max<int64_t>(total_steps, 1))));
  for (auto& group : opt.param_groups()) static_cast<Options&>(group.options()).lr(lr);
}

// Note [Averaged weights]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A model that still moves step to step, and overfits late in training, ends
// where its last steps left it: its final accuracy is one noisy sample of
// the last epochs. An exponential moving average of the weights, evaluated
// instead of them, averages that noise out. BatchNorm's running statistics
// are averaged too (they belong to the weights they were measured with);
// integer buffers (the batch count) are copied. Early on the average follows
// the weights closely: its decay is min(decay, (1 + n) / (10 + n)) after n
// updates, so the first epochs' evaluations are not of the initial weights.
// Across processes each rank averages its own stages.

/// An exponential moving average of a module's parameters and floating-point
/// buffers, on their devices (Note [Averaged weights]).
class WeightAverage {
 public:
  WeightAverage(const torch::nn::Module& module, double decay) : decay_(decay) {
    if (!(decay > 0 && decay < 1)) {
      throw std::invalid_argument("the weight average's decay must be in (0, 1), got " +
                                  std::to_string(decay));
    }
    live_ = module.parameters();
    for (const auto& b : module.buffers()) live_.push_back(b);
    torch::NoGradGuard no_grad;
    for (const auto& t : live_) average_.push_back(t.detach().clone());
  }

  /// After each optimizer step.
  void update() {
    torch::NoGradGuard no_grad;
    ++updates_;
    const double d = std::min(decay_, (1.0 + updates_) / (10.0 + updates_));
    for (size_t k = 0; k < live_.size(); ++k) {
      if (live_[k].is_floating_point()) {
        average_[k].lerp_(live_[k], 1 - d);
      } else {
        average_[k].copy_(live_[k]);
      }
    }
  }

  /// The average and its number of updates, for a job checkpoint's data
  /// position (Note [Resuming the examples]).
  std::vector<torch::Tensor> average() const { return average_; }
  int64_t updates() const { return updates_; }
  /// Puts back what average() and updates() gave.
  void restore(const std::vector<torch::Tensor>& average, int64_t updates) {
    if (average.size() != average_.size()) {
      throw std::runtime_error("the checkpoint's weight average holds " +
                               std::to_string(average.size()) + " tensors, this model " +
                               std::to_string(average_.size()) + " (saved with another --ema?)");
    }
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < average_.size(); ++k) average_[k].copy_(average[k]);
    updates_ = updates;
  }

  /// While it lives, the module holds the average (for evaluation and saving);
  /// its own weights come back at the end.
  class Applied {
   public:
    explicit Applied(WeightAverage* avg) : avg_(avg) {
      if (avg_) avg_->swap();
    }
    ~Applied() {
      if (avg_) avg_->swap();
    }
    Applied(const Applied&) = delete;
    Applied& operator=(const Applied&) = delete;

   private:
    WeightAverage* avg_;
  };

 private:
  void swap() {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < live_.size(); ++k) {
      const auto held = live_[k].clone();
      live_[k].copy_(average_[k]);
      average_[k].copy_(held);
    }
  }

  double decay_;
  int64_t updates_ = 0;
  std::vector<torch::Tensor> live_, average_;
};

/// Flags every training example takes.
struct CommonFlags {
  std::string devices = "auto";
  std::string data = kDefaultFashionMnistDir;
  std::string out;
  uint64_t seed = 0;
  int64_t train_limit = 0;
  int64_t test_limit = 0;
  double min_accuracy = -1;
  bool quick = false;
  bool inline_host = false;
  bool skip_if_no_data = false;
  std::string timeline;  // path prefix: PREFIX.json and PREFIX.svg of one step
  bool memory_report = false;
  bool resume = false;           // from the newest job checkpoint in <out>/checkpoints
  int64_t checkpoint_every = 0;  // steps between job checkpoints; 0: none
};

/// The flags of every example: --devices, --data, --out, --seed, --quick, --skip-if-no-data.
inline void add_run_flags(CLI::App& app, CommonFlags& f, const std::string& quick_help,
                          const std::string& data_help, const std::string& out_help,
                          bool resumable = true) {
  app.add_option("--devices", f.devices,
                 "auto (all GPUs, else CPU), cpu, cuda, or a list such as cuda:0,cuda:1,cpu");
  app.add_option("--data", f.data, data_help);
  app.add_option("--out", f.out, out_help);
  app.add_option("--seed", f.seed, "random seed");
  app.add_flag("--quick", f.quick, quick_help);
  app.add_flag("--skip-if-no-data", f.skip_if_no_data,
               "exit 77 (a skip for ctest) when the data set is not installed");
  if (!resumable) return;
  app.add_flag("--resume", f.resume,
               "continue from the newest whole job checkpoint in OUT/checkpoints, if there is "
               "one (else start afresh): bit for bit where the saved run would have gone");
  app.add_option("--checkpoint-every", f.checkpoint_every,
                 "save a job checkpoint (weights, optimizer, random generators, the place in "
                 "the data) into OUT/checkpoints every K training steps and after the last; "
                 "0 (the default): none")
      ->check(CLI::NonNegativeNumber);
}

// Note [Resuming the examples]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// --checkpoint-every K saves an mpipe::JobCheckpoints checkpoint into
// OUT/checkpoints every K steps and after the last one; --resume continues from
// the newest whole one there, or starts afresh when there is none, so one
// command line serves the first start and every restart (mpipe-launch
// --max-restarts, torchrun). The library saves the stages, the optimizer, the
// GradScaler and the random generators; the loop's own place travels as the
// checkpoint's data position, a pickled dictionary (Position): the step, the
// epoch's running sums, and the CPU generator's state where the epoch drew its
// order (epoch_order), from which a resumed epoch draws the same order again.
// The continuation then makes every draw and every sum the uninterrupted run
// made: the same losses, accuracies and weights, bit for bit.

/// The loop's place in a job checkpoint: named ints, doubles and tensors,
/// pickled (Note [Resuming the examples]).
class Position {
 public:
  Position() = default;
  /// From the bytes bytes() made.
  explicit Position(const std::string& bytes)
      : values_(torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toGenericDict()) {}
  std::string bytes() const {
    const std::vector<char> b = torch::jit::pickle_save(c10::IValue(values_));
    return std::string(b.begin(), b.end());
  }
  /// Tensors are kept on the CPU; tensor() gives them back there.
  void set(const std::string& key, const c10::IValue& value) {
    if (value.isTensor()) {
      values_.insert_or_assign(key, value.toTensor().cpu());
    } else if (value.isTensorList()) {
      std::vector<torch::Tensor> on_cpu;
      for (const auto& t : value.toTensorVector()) on_cpu.push_back(t.cpu());
      values_.insert_or_assign(key, on_cpu);
    } else {
      values_.insert_or_assign(key, value);
    }
  }
  int64_t integer(const std::string& key) const { return at(key).toInt(); }
  double real(const std::string& key) const { return at(key).toDouble(); }
  torch::Tensor tensor(const std::string& key) const { return at(key).toTensor(); }
  std::vector<torch::Tensor> tensors(const std::string& key) const { return at(key).toTensorVector(); }
  std::vector<double> reals(const std::string& key) const { return at(key).toDoubleVector(); }

 private:
  c10::IValue at(const std::string& key) const {
    const auto it = values_.find(key);
    if (it == values_.end()) {
      throw std::runtime_error("the job checkpoint's data position has no '" + key +
                               "': it was saved by another program");
    }
    return it->value();
  }
  c10::impl::GenericDict values_{c10::StringType::get(), c10::AnyType::get()};
};

/// Where an epoch loop stands, as both Fashion-MNIST examples save it: the
/// steps done, the epoch, the first example of its next batch and the CPU
/// generator's state its order was drawn from (epoch_order).
struct EpochPlace {
  int64_t step = 0, epoch = 1, start = 0;
  torch::Tensor order_state;

  /// The saved place, or the start of training.
  static EpochPlace from(const std::optional<Position>& resumed) {
    EpochPlace p;
    if (resumed) {
      p.step = resumed->integer("step");
      p.epoch = resumed->integer("epoch");
      p.start = resumed->integer("start");
      p.order_state = resumed->tensor("order_state");
    }
    return p;
  }
  void put(Position& at) const {
    at.set("step", step);
    at.set("epoch", epoch);
    at.set("start", start);
    at.set("order_state", order_state);
  }
};

/// --resume / --checkpoint-every: the job's checkpoints in OUT/checkpoints,
/// or null when neither flag asks for them.
inline std::unique_ptr<mpipe::JobCheckpoints> job_checkpoints(const CommonFlags& f,
                                                              mpipe::ModelPipelineImpl& pipe,
                                                              torch::optim::Optimizer& opt,
                                                              mpipe::GradScaler* scaler = nullptr) {
  if (!f.resume && f.checkpoint_every == 0) return nullptr;
  return std::make_unique<mpipe::JobCheckpoints>(f.out + "/checkpoints", pipe, opt, scaler);
}

/// With --resume, the saved place of the newest whole checkpoint (the
/// generators and the model are loaded); nullopt: start afresh.
inline std::optional<Position> resume(const CommonFlags& f, mpipe::JobCheckpoints* checkpoints,
                                      bool report) {
  if (!f.resume || checkpoints == nullptr) return std::nullopt;
  const auto resumed = checkpoints->resume();
  if (!resumed) {
    if (report) std::printf("no job checkpoint in %s/checkpoints: starting afresh\n", f.out.c_str());
    return std::nullopt;
  }
  if (report) {
    std::printf("resumed from step %lld (%s)\n", static_cast<long long>(resumed->step),
                resumed->directory.c_str());
  }
  return Position(resumed->data_position);
}

/// After `steps_done` of `total` steps: if a checkpoint is due, saves one
/// with the place `position()` gives.
inline void checkpoint_if_due(const CommonFlags& f, mpipe::JobCheckpoints* checkpoints,
                              int64_t steps_done, int64_t total,
                              const std::function<Position()>& position) {
  if (checkpoints == nullptr || f.checkpoint_every == 0) return;
  if (steps_done % f.checkpoint_every == 0 || steps_done == total) {
    checkpoints->save(steps_done, position().bytes());
  }
}

/// An epoch's order of `n` examples, drawn from the CPU generator; `state`
/// is set to where the generator stood before the draw. Given a defined
/// `state` (a resumed epoch's), the same order is drawn again from it, and
/// the CPU generator is left alone (Note [Resuming the examples]).
inline torch::Tensor epoch_order(int64_t n, torch::Tensor& state) {
  if (state.defined()) {
    at::Generator from = at::make_generator<at::CPUGeneratorImpl>();
    from.set_state(state);
    return torch::randperm(n, from, torch::TensorOptions(torch::kLong));
  }
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    state = cpu.get_state();
  }
  return torch::randperm(n, torch::TensorOptions(torch::kLong));
}

/// add_run_flags for the Fashion-MNIST examples, and their own flags; with
/// `full` false, without --resume, --checkpoint-every, --timeline and
/// --memory-report (for a program that offers none of them).
inline void add_common_flags(CLI::App& app, CommonFlags& f, const std::string& quick_help,
                             bool full = true) {
  add_run_flags(app, f, quick_help, "folder with the Fashion-MNIST IDX files (.gz or not)",
                "folder for the trained weights", full);
  app.add_option("--train-limit", f.train_limit, "use the first N training images (0: all)");
  app.add_option("--test-limit", f.test_limit, "use the first N test images (0: all)");
  app.add_option("--min-accuracy", f.min_accuracy,
                 "exit 1 if the final test accuracy (a fraction) is below this");
  app.add_flag("--inline", f.inline_host, "issue all stages from the caller's thread");
  if (!full) return;
  app.add_option("--timeline", f.timeline,
                 "record the second training step's tasks; write PREFIX.json (Chrome trace) and "
                 "PREFIX.svg (Gantt chart)");
  app.add_flag("--memory-report", f.memory_report,
               "print the per-device memory report after the second training step");
}

/// The training step --timeline and --memory-report look at: the second, so
/// that one-off start-up costs stay out of the picture.
constexpr int64_t kRecordedStep = 1;

/// Turns recording on for step `step` if it is the recorded one and a flag
/// asks for it; returns whether it did.
inline bool begin_recorded_step(mpipe::ModelPipeline& pipe, const CommonFlags& f, int64_t step) {
  if (step != kRecordedStep || (f.timeline.empty() && !f.memory_report)) return false;
  pipe->options.record_timeline(!f.timeline.empty()).track_memory(f.memory_report);
  return true;
}

/// Turns recording off again and writes or prints what it recorded.
inline void end_recorded_step(mpipe::ModelPipeline& pipe, const CommonFlags& f) {
  pipe->options.record_timeline(false).track_memory(false);
  if (!f.timeline.empty()) {
    const mpipe::Timeline t = pipe->timeline();
    const auto folder = std::filesystem::path(f.timeline).parent_path();
    if (!folder.empty()) std::filesystem::create_directories(folder);
    t.save_chrome_trace(f.timeline + ".json");
    t.save_svg(f.timeline + ".svg");
    std::printf("timeline of training step %lld (%s): %zu tasks in %.2f ms, bubble %.1f %% "
                "measured, %.1f %% by the schedule; wrote %s.json and %s.svg\n",
                static_cast<long long>(kRecordedStep + 1), t.method.c_str(), t.tasks.size(),
                t.makespan_ms(), 100 * t.bubble_fraction(), 100 * t.schedule_bubble,
                f.timeline.c_str(), f.timeline.c_str());
  }
  if (f.memory_report) std::printf("%s", pipe->memory_report().to_string().c_str());
}

constexpr int kSkipExitCode = 77;  // ctest's SKIP_RETURN_CODE

/// Both splits of Fashion-MNIST, images on `input_device`, labels on
/// `label_device`; false (after saying so) when the data are missing and
/// --skip-if-no-data was given.
inline bool load_data(const CommonFlags& f, torch::Device input_device, torch::Device label_device,
                      Dataset& train, Dataset& test) {
  if (f.skip_if_no_data && !fashion_mnist_present(f.data)) {
    std::printf("Fashion-MNIST not found in %s: skipped\n", f.data.c_str());
    return false;
  }
  train = load_fashion_mnist(f.data, true, f.train_limit);
  test = load_fashion_mnist(f.data, false, f.test_limit);
  for (Dataset* ds : {&train, &test}) {
    ds->images = ds->images.to(input_device);
    ds->labels = ds->labels.to(label_device);
  }
  return true;
}

/// The progress line of one epoch, with the ETA from the mean epoch so far.
inline void print_epoch(int64_t epoch, int64_t epochs, double loss, double train_acc,
                        double test_acc, int64_t images, double epoch_seconds,
                        double elapsed_seconds) {
  std::printf("epoch %3lld/%lld  loss %.4f  train %.2f%%  test %.2f%%  %7.0f img/s  %5.1f s  "
              "ETA %s\n",
              static_cast<long long>(epoch), static_cast<long long>(epochs), loss,
              100 * train_acc, 100 * test_acc, static_cast<double>(images) / epoch_seconds,
              epoch_seconds,
              format_duration(elapsed_seconds / static_cast<double>(epoch) *
                              static_cast<double>(epochs - epoch))
                  .c_str());
  std::fflush(stdout);
}

/// 1 (with a message) if `accuracy` is below --min-accuracy, else 0.
inline int accuracy_exit_code(double accuracy, double min_accuracy) {
  if (min_accuracy < 0 || accuracy >= min_accuracy) return 0;
  std::printf("FAILED: test accuracy %.2f%% is below --min-accuracy %.2f%%\n", 100 * accuracy,
              100 * min_accuracy);
  return 1;
}

/// Runs an example's body; an exception becomes a message and exit code 2.
inline int run_guarded(const std::function<int()>& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 2;
}

}  // namespace examples
