#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/snn/monitor.h"

#include <ATen/core/Tensor.h>

#include <cstdio>

namespace mpipe {
namespace snn {

MPIPE_FUNC FiringRateMonitor::FiringRateMonitor(torch::nn::Module& model) {
  for (const auto& item : model.named_modules()) {
    if (auto neuron = std::dynamic_pointer_cast<NeuronBase>(item.value())) {
      neuron->clear_spike_count();
      neuron->count_spikes(true, this);
      neurons_.emplace_back(item.key().empty() ? "(model)" : item.key(), std::move(neuron));
    }
  }
}

MPIPE_FUNC FiringRateMonitor::~FiringRateMonitor() {
  for (auto& n : neurons_) n.second->count_spikes(false, this);  // unless a newer monitor counts
}

MPIPE_FUNC std::vector<FiringRateMonitor::LayerRate> FiringRateMonitor::rates() const {
  std::vector<LayerRate> out;
  for (const auto& n : neurons_) {
    LayerRate r;
    r.name = n.first;
    const auto count = n.second->spike_count();
    r.spikes = count.first.defined() ? count.first.item<double>() : 0.0;
    r.elements = count.second;
    r.rate = r.elements > 0 ? r.spikes / static_cast<double>(r.elements) : 0.0;
    out.push_back(r);
  }
  return out;
}

MPIPE_FUNC void FiringRateMonitor::reset() {
  for (auto& n : neurons_) n.second->clear_spike_count();
}

MPIPE_FUNC std::string FiringRateMonitor::to_string() const {
  std::string s;
  for (const auto& r : rates()) {
    char line[64];
    std::snprintf(line, sizeof line, "  %.4f", r.rate);
    s += r.name + line + "\n";
  }
  return s;
}

}  // namespace snn
}  // namespace mpipe
