#pragma once

// The transformer_lm example's model in the benchmarks: what each layer
// costs per micro-batch, and schedules::simulate's prediction of a training
// step on D devices from those costs (bench/README.md, "lm").

#include "model.h"  // examples/transformer_lm/model.h

#include <mpipe/autocast.h>
#include <mpipe/balance.h>
#include <mpipe/schedule.h>
#include <mpipe/simulate.h>
#include <mpipe/training.h>

#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

namespace lm_bench {

/// One layer's time per micro-batch, ms: forward, its backward, and the
/// backward's two passes (zero-bubble schedules split them): the input's
/// gradient, timed on its own, and the weights' gradients, the rest.
struct LayerCost {
  double forward = 0;
  double backward = 0;
  double backward_input = 0;
  double backward_weight = 0;
};

/// Median ms per call of `reps` back-to-back calls of `fn`, over `rounds`
/// rounds (`sync` before and after each round): a layer's throughput when
/// one thread launches it without waiting, max(host, device) per call.
inline double ms_per_call(const std::function<void()>& fn, const std::function<void()>& sync,
                          int reps = 10, int rounds = 7) {
  fn();  // warm-up
  std::vector<double> t;
  for (int r = 0; r < rounds; ++r) {
    sync();
    const auto start = std::chrono::steady_clock::now();
    for (int k = 0; k < reps; ++k) fn();
    sync();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                    .count() / reps);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Each of `layers`' layers timed on one micro-batch `x` (token ids) with
/// targets `y`: forward alone, then forward and backward (the last layer's
/// backward starts from lm_loss), under bf16 autocast when `bf16`.
inline std::vector<LayerCost> measure_layers(const transformer_lm::Layers& layers,
                                             const torch::Tensor& x, const torch::Tensor& y,
                                             bool bf16, const std::function<void()>& sync) {
  std::vector<LayerCost> out;
  auto scope = [&] {
    return bf16 ? std::make_unique<mpipe::AutocastGuard>(x.device().type(), torch::kBFloat16)
                : nullptr;
  };
  torch::Tensor h = x;  // the layer's input
  for (int64_t i = 0; i < layers.size(); ++i) {
    torch::nn::Sequential one;
    layers.push(one, i);
    const bool last = i + 1 == layers.size();
    const torch::Tensor in = i == 0 ? h : h.detach().requires_grad_();
    torch::Tensor probe;
    {
      const auto cast = scope();
      torch::NoGradGuard no_grad;
      probe = one->forward(in);
    }
    const torch::Tensor grad = last ? torch::Tensor() : torch::ones_like(probe);
    LayerCost c;
    c.forward = ms_per_call([&] {
      const auto cast = scope();
      one->forward(in);
    }, sync);
    const double both = ms_per_call([&] {
      torch::Tensor out;
      {
        const auto cast = scope();
        out = one->forward(in);
      }
      if (last) {
        transformer_lm::lm_loss(out, y).backward();
      } else {
        out.backward(grad);
      }
    }, sync);
    c.backward = std::max(0.0, both - c.forward);
    // The input's pass on its own (autograd computes only what leads to the
    // input); the weights' pass is the rest, as the runtime's split backward
    // computes it from the input pass's gradients (Note [Split backward]).
    auto pass = [&](const std::vector<torch::Tensor>& wrt) {
      return ms_per_call([&] {
        torch::Tensor out;
        {
          const auto cast = scope();
          out = one->forward(in);
        }
        if (last) out = transformer_lm::lm_loss(out, y);
        torch::autograd::grad({out}, wrt, {last ? torch::Tensor() : grad});
      }, sync) - c.forward;
    };
    c.backward_input = in.requires_grad() ? std::min(c.backward, std::max(0.0, pass({in}))) : 0.0;
    c.backward_weight = c.backward - c.backward_input;
    out.push_back(c);
    h = probe;
  }
  for (auto& p : layers.all()->parameters()) p.mutable_grad() = torch::Tensor();
  return out;
}

/// Stage sizes (layers per stage) that even out the stages' forward and
/// backward time (mpipe::balance::partition), for `n_stages` stages.
inline std::vector<int64_t> split_of(const std::vector<LayerCost>& costs, int64_t n_stages) {
  std::vector<double> per_layer;
  for (const auto& c : costs) per_layer.push_back(c.forward + c.backward);
  return mpipe::balance::partition(per_layer, n_stages);
}

/// The stages' costs for schedules::simulate: n_stages balanced stages (split_of),
/// each task plus the runtime's `host` cost, backwards split (I and W as
/// measured) or whole (B = I + W, one task).
inline mpipe::schedules::Costs stage_costs_of(const std::vector<LayerCost>& costs, int64_t n_stages,
                                              bool split, double host, double transfer) {
  const auto sizes = split_of(costs, n_stages);
  mpipe::schedules::Costs stage_costs;
  size_t at = 0;
  for (int64_t s = 0; s < n_stages; ++s) {
    mpipe::schedules::StageCost sc{0, 0, 0, transfer};
    double f = 0, b = 0, bi = 0, bw = 0;
    for (int64_t k = 0; k < sizes[static_cast<size_t>(s)]; ++k, ++at) {
      f += costs[at].forward;
      b += costs[at].backward;
      bi += costs[at].backward_input;
      bw += costs[at].backward_weight;
    }
    sc.forward = f + host;
    if (split) {  // two tasks
      sc.backward_input = bi + host;
      sc.backward_weight = bw + host;
    } else {  // one task, B = backward_input + backward_weight
      sc.backward_input = b / 2 + host / 2;
      sc.backward_weight = b / 2 + host / 2;
    }
    stage_costs.push_back(sc);
  }
  return stage_costs;
}

/// The stages `schedule` runs on `devices` devices: 2 per device for the
/// interleaved and V-shaped ones, else 1.
inline int64_t stages_of(mpipe::Schedule schedule, int64_t devices) {
  const bool two = schedule == mpipe::Schedule::Interleaved1F1B ||
                   schedule == mpipe::Schedule::ZeroBubbleV ||
                   schedule == mpipe::Schedule::DualPipeV;
  return two ? 2 * devices : devices;
}

/// schedules::simulate's step time, ms, of `schedule` with `m` micro-batches
/// on `devices` devices (interleaved, ZB-V, DualPipeV: 2 stages per device),
/// from the layers' costs, plus `host` ms per task (the runtime's cost per
/// stage call) and `transfer` ms per hand-off between stages. The
/// zero-bubble schedules' split backward costs its two passes as
/// measure_layers gives them, the others the whole backward.
/// Undefined (negative) when there are fewer layers than stages.
inline double predict_ms(const std::vector<LayerCost>& costs, int64_t devices,
                         mpipe::Schedule schedule, int64_t m, double host, double transfer) {
  const int64_t v = schedule == mpipe::Schedule::Interleaved1F1B ? 2 : 1;
  const int64_t n_stages = stages_of(schedule, devices);
  if (n_stages > static_cast<int64_t>(costs.size())) return -1;
  const bool split = schedule == mpipe::Schedule::ZeroBubbleH1 ||
                     schedule == mpipe::Schedule::Tailored ||
                     schedule == mpipe::Schedule::ZeroBubbleV ||
                     schedule == mpipe::Schedule::DualPipeV;
  const auto stage_costs = stage_costs_of(costs, n_stages, split, host, transfer);
  if (schedule == mpipe::Schedule::Tailored) {  // built for these costs
    const auto options = mpipe::TrainStepOptions(1).schedule(schedule).stage_costs(stage_costs);
    return mpipe::choose_schedule(m, n_stages, options).candidates.back().time;
  }
  const auto programs = mpipe::programs_for(schedule, m, n_stages, v);
  return mpipe::schedules::makespan(programs, stage_costs);
}

}  // namespace lm_bench
