#pragma once

// Small pieces the training examples share: device lists, timing, progress
// text, learning-rate schedules.

#include <mpipe/device.h>

#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
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
  const int64_t gpus = mpipe::cuda_device_count();
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

}  // namespace examples
