#pragma once

// Private: a pipeline's stages and where they run, what append builds and
// every call reads (one of the PipelineParts, pipeline/session.h).

#include "mpipe/tensors.h"

#include "mpipe/detail/runtime/state_snapshot.h"

#include <c10/core/Device.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace mpipe {
namespace detail {

struct Stages {
  explicit Stages(torch::nn::ModuleList registered) : modules(std::move(registered)) {}

  torch::nn::ModuleList modules;       // the pipeline's submodule "stages"
  std::vector<StageForward> forwards;  // how each stage is called
  std::vector<c10::Device> devices;
  std::vector<std::vector<StatefulModule>> stateful;  // per stage (Note [State snapshots])

  size_t size() const { return devices.size(); }

  /// The distinct devices of this process's stages.
  int64_t distinct_devices() const {
    std::vector<c10::Device> seen;
    for (const auto& d : devices) {
      if (std::find(seen.begin(), seen.end(), d) == seen.end()) seen.push_back(d);
    }
    return static_cast<int64_t>(seen.size());
  }

  /// A label per stage: stages on one device share it.
  std::vector<int64_t> device_labels() const {
    std::vector<int64_t> labels;
    for (size_t s = 0; s < devices.size(); ++s) {
      int64_t label = static_cast<int64_t>(s);
      for (size_t q = 0; q < s; ++q) {
        if (devices[q] == devices[s]) {
          label = labels[q];
          break;
        }
      }
      labels.push_back(label);
    }
    return labels;
  }
};

}  // namespace detail
}  // namespace mpipe
