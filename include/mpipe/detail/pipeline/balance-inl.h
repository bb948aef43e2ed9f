#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/balance.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <map>

#include <cmath>
#include <limits>
#include <numeric>

namespace mpipe {
namespace balance {

}  // namespace balance
namespace detail {

MPIPE_FUNC void check_costs(const std::vector<double>& costs, const char* who) {
  for (size_t i = 0; i < costs.size(); ++i) {
    TORCH_CHECK(std::isfinite(costs[i]) && costs[i] >= 0, "mpipe::balance::", who, ": cost of layer ",
                i, " must be finite and >= 0, got ", costs[i]);
  }
}

}  // namespace detail
namespace balance {

MPIPE_FUNC std::vector<int64_t> partition(const std::vector<double>& costs, int64_t n_blocks) {
  detail::check_costs(costs, "partition");
  const auto n_layers = static_cast<int64_t>(costs.size());
  TORCH_CHECK(n_blocks >= 1, "mpipe::balance::partition: need at least one block, got ", n_blocks);
  TORCH_CHECK(n_layers >= n_blocks, "mpipe::balance::partition: ", n_layers,
              " layer(s) cannot fill ", n_blocks, " non-empty blocks");
  std::vector<double> prefix(static_cast<size_t>(n_layers) + 1, 0.0);
  for (int64_t i = 0; i < n_layers; ++i) prefix[i + 1] = prefix[i] + costs[i];
  auto sum = [&](int64_t a, int64_t b) { return prefix[b] - prefix[a]; };  // layers [a, b)
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: smallest largest-block sum splitting layers [0, i) into k blocks;
  // cut[k][i]: where the last of those blocks starts.
  std::vector<std::vector<double>> best(static_cast<size_t>(n_blocks) + 1,
                                        std::vector<double>(static_cast<size_t>(n_layers) + 1, inf));
  std::vector<std::vector<int64_t>> cut(best.size(),
                                        std::vector<int64_t>(static_cast<size_t>(n_layers) + 1, 0));
  best[0][0] = 0;
  for (int64_t k = 1; k <= n_blocks; ++k) {
    for (int64_t i = k; i <= n_layers - (n_blocks - k); ++i) {
      // Scanning j downwards and keeping strict improvements makes the last
      // block as short as possible, so earlier blocks are the longest.
      for (int64_t j = i - 1; j >= k - 1; --j) {
        const double candidate = std::max(best[k - 1][j], sum(j, i));
        if (candidate < best[k][i]) {
          best[k][i] = candidate;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> sizes(static_cast<size_t>(n_blocks));
  for (int64_t k = n_blocks, i = n_layers; k >= 1; --k) {
    sizes[k - 1] = i - cut[k][i];
    i = cut[k][i];
  }
  return sizes;
}

MPIPE_FUNC ModelPipeline from_sequential(const torch::nn::Sequential& layers,
                                         const std::vector<DeviceArg>& devices,
                                         const std::vector<int64_t>& sizes,
                                         ModelPipelineOptions options) {
  const auto n_layers = static_cast<int64_t>(layers->size());
  TORCH_CHECK(sizes.size() == devices.size(), "mpipe::balance::from_sequential: ", sizes.size(),
              " stage size(s) for ", devices.size(), " device(s); give one size per device");
  TORCH_CHECK(!sizes.empty(), "mpipe::balance::from_sequential: no stages asked for");
  int64_t total = 0;
  for (size_t s = 0; s < sizes.size(); ++s) {
    TORCH_CHECK(sizes[s] > 0, "mpipe::balance::from_sequential: stage ", s,
                " must hold at least one layer, got ", sizes[s]);
    total += sizes[s];
  }
  TORCH_CHECK(total == n_layers, "mpipe::balance::from_sequential: the stage sizes add up to ",
              total, " layers, but the Sequential has ", n_layers);
  ModelPipeline pipe(options);
  auto it = layers->begin();
  for (size_t s = 0; s < sizes.size(); ++s) {
    torch::nn::Sequential stage;
    for (int64_t l = 0; l < sizes[s]; ++l, ++it) stage->push_back(*it);
    pipe->append(stage, devices[s]);
  }
  return pipe;
}

MPIPE_FUNC ModelPipeline from_sequential(const torch::nn::Sequential& layers,
                                         const std::vector<DeviceArg>& devices,
                                         const std::vector<std::string>& cut_before,
                                         ModelPipelineOptions options) {
  const auto children = layers->named_children();
  std::string all;
  for (const auto& c : children) all += (all.empty() ? "" : ", ") + c.key();
  TORCH_CHECK(cut_before.size() + 1 == devices.size(), "mpipe::balance::from_sequential: ",
              cut_before.size(), " cut(s) for ", devices.size(),
              " device(s); name one layer fewer than devices (the layers: ", all, ")");
  std::vector<int64_t> sizes;
  int64_t start = 0;
  for (const std::string& name : cut_before) {
    int64_t at = -1;
    for (size_t l = 0; l < children.size(); ++l) {
      if (children[l].key() == name) at = static_cast<int64_t>(l);
    }
    TORCH_CHECK(at >= 0, "mpipe::balance::from_sequential: no layer named '", name,
                "' to cut before (the layers: ", all, ")");
    TORCH_CHECK(at > start, "mpipe::balance::from_sequential: the cut before '", name,
                "' leaves stage ", sizes.size(), " empty; name the layers in order, not the first"
                " (the layers: ", all, ")");
    sizes.push_back(at - start);
    start = at;
  }
  sizes.push_back(static_cast<int64_t>(children.size()) - start);
  return from_sequential(layers, devices, sizes, std::move(options));
}

}  // namespace balance
namespace detail {

/// Saves parameters' gradients and buffers of `m` and puts them back, and
/// resets stateful modules, when it goes out of scope.
class KeepAsItWas {
 public:
  explicit KeepAsItWas(torch::nn::Module& m) : module_(m) {
    for (const auto& p : m.named_parameters()) {
      grads_[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : at::Tensor();
    }
    for (const auto& b : m.named_buffers()) buffers_[b.key()] = b.value().clone();
  }
  ~KeepAsItWas() {
    c10::NoGradGuard no_grad;
    for (auto& p : module_.named_parameters()) p.value().mutable_grad() = grads_[p.key()];
    for (auto& b : module_.named_buffers()) b.value().copy_(buffers_[b.key()]);
    reset_states(module_);
  }

 private:
  torch::nn::Module& module_;
  std::map<std::string, at::Tensor> grads_, buffers_;
};

MPIPE_FUNC c10::Device device_of(const torch::nn::Sequential& layers) {
  const auto params = layers->parameters();
  return params.empty() ? c10::Device(c10::kCPU) : params.front().device();
}

}  // namespace detail
namespace balance {

MPIPE_FUNC std::vector<double> profile_time(torch::nn::Sequential layers, const at::Tensor& sample,
                                            int64_t reps) {
  TORCH_CHECK(reps > 0, "mpipe::balance::profile_time: reps must be positive, got ", reps);
  TORCH_CHECK(sample.defined(), "mpipe::balance::profile_time: the sample is undefined");
  const c10::Device device = detail::device_of(layers);
  detail::KeepAsItWas keep(*layers);
  c10::AutoGradMode grad_on(true);
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  std::vector<double> costs;
  at::Tensor x = sample.to(device);
  for (auto it = layers->begin(); it != layers->end(); ++it) {
    std::vector<double> ms;
    at::Tensor out;
    for (int64_t r = 0; r <= reps; ++r) {  // the first run warms up
      reset_states(*layers);
      const at::Tensor in = x.detach().requires_grad_(at::isFloatingType(x.scalar_type()));
      sync();
      const auto t0 = std::chrono::steady_clock::now();
      out = it->forward(in);
      if (out.requires_grad()) out.backward(at::ones_like(out));
      sync();
      if (r > 0) {
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                         .count());
      }
    }
    std::sort(ms.begin(), ms.end());
    costs.push_back(ms[ms.size() / 2]);
    x = out.detach();
  }
  return costs;
}

}  // namespace balance
namespace detail {
/// Per layer: its parameters' bytes times (1 + optimizer_state_scale) when
/// `parameters`, plus its output's bytes for `sample`.
MPIPE_FUNC std::vector<double> profile_bytes(torch::nn::Sequential layers, const at::Tensor& sample,
                                             double optimizer_state_scale, bool parameters);
}  // namespace detail
namespace balance {

MPIPE_FUNC std::vector<double> profile_memory(torch::nn::Sequential layers,
                                              const at::Tensor& sample,
                                              double optimizer_state_scale) {
  TORCH_CHECK(optimizer_state_scale >= 0,
              "mpipe::balance::profile_memory: optimizer_state_scale must be >= 0, got ",
              optimizer_state_scale);
  return detail::profile_bytes(std::move(layers), sample, optimizer_state_scale, true);
}

MPIPE_FUNC std::vector<double> profile_activations(torch::nn::Sequential layers,
                                                   const at::Tensor& sample) {
  return detail::profile_bytes(std::move(layers), sample, 0, false);
}

}  // namespace balance
namespace detail {
/// Each size positive and all of them together n_layers.
MPIPE_FUNC void check_stage_sizes(const char* who, size_t n_layers,
                                  const std::vector<int64_t>& sizes) {
  int64_t total = 0;
  for (size_t b = 0; b < sizes.size(); ++b) {
    TORCH_CHECK(sizes[b] > 0, "mpipe::balance::", who, ": stage ", b,
                " must hold at least one layer, got ", sizes[b]);
    total += sizes[b];
  }
  TORCH_CHECK(total == static_cast<int64_t>(n_layers), "mpipe::balance::", who,
              ": the stages hold ", total, " layer(s), the values are of ", n_layers);
}
}  // namespace detail
namespace balance {

MPIPE_FUNC schedules::Costs stage_costs(const std::vector<double>& layer_times,
                                        const std::vector<int64_t>& sizes, double scale) {
  detail::check_costs(layer_times, "stage_costs");
  TORCH_CHECK(std::isfinite(scale) && scale >= 0,
              "mpipe::balance::stage_costs: scale must be finite and >= 0, got ", scale);
  detail::check_stage_sizes("stage_costs", layer_times.size(), sizes);
  schedules::Costs costs;
  size_t at = 0;
  for (int64_t n : sizes) {
    double t = 0;
    for (int64_t k = 0; k < n; ++k) t += layer_times[at++];
    t *= scale;
    costs.push_back({t / 3, t / 3, t / 3, 0});
  }
  return costs;
}

MPIPE_FUNC std::vector<double> stage_sums(const std::vector<double>& layer_values,
                                          const std::vector<int64_t>& sizes, double scale) {
  detail::check_costs(layer_values, "stage_sums");
  TORCH_CHECK(std::isfinite(scale) && scale >= 0,
              "mpipe::balance::stage_sums: scale must be finite and >= 0, got ", scale);
  detail::check_stage_sizes("stage_sums", layer_values.size(), sizes);
  std::vector<double> sums;
  size_t at = 0;
  for (int64_t n : sizes) {
    double v = 0;
    for (int64_t k = 0; k < n; ++k) v += layer_values[at++];
    sums.push_back(v * scale);
  }
  return sums;
}

}  // namespace balance
namespace detail {
MPIPE_FUNC std::vector<double> profile_bytes(torch::nn::Sequential layers, const at::Tensor& sample,
                                             double optimizer_state_scale, bool parameters) {
  const c10::Device device = device_of(layers);
  KeepAsItWas keep(*layers);
  c10::NoGradGuard no_grad;
  std::vector<double> costs;
  at::Tensor x = sample.to(device);
  for (auto it = layers->begin(); it != layers->end(); ++it) {
    double bytes = 0;
    for (const auto& p : it->ptr()->parameters()) {
      if (!parameters) break;
      bytes += static_cast<double>(p.numel() * p.element_size()) * (1 + optimizer_state_scale);
    }
    x = it->forward(x);
    bytes += static_cast<double>(x.numel() * x.element_size());
    costs.push_back(bytes);
  }
  return costs;
}
}  // namespace detail
namespace balance {

MPIPE_FUNC ModelPipeline balanced(const torch::nn::Sequential& layers,
                                  const std::vector<DeviceArg>& devices,
                                  const std::vector<double>& costs, ModelPipelineOptions options) {
  TORCH_CHECK(costs.size() == layers->size(), "mpipe::balance::balanced: ", costs.size(),
              " cost(s) for ", layers->size(), " layer(s)");
  return from_sequential(layers, devices,
                         partition(costs, static_cast<int64_t>(devices.size())), options);
}

}  // namespace balance
}  // namespace mpipe
