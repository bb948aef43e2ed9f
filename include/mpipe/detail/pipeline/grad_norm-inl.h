#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/grad_norm.h"
#include "mpipe/model_pipeline.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <map>
#include <string>

namespace mpipe {

MPIPE_FUNC double clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm,
                                 const distributed::ProcessGroup& group, double norm_type) {
  TORCH_CHECK(max_norm >= 0, "mpipe::clip_grad_norm: max_norm must not be negative, got ",
              max_norm);
  TORCH_CHECK(norm_type > 0, "mpipe::clip_grad_norm: norm_type must be positive (or infinity), "
              "got ", norm_type);
  const bool inf = std::isinf(norm_type);
  // One reduction and one read per device, as the gradients live there.
  std::map<std::string, std::vector<at::Tensor>> norms;
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    norms[g.device().str()].push_back(inf ? g.detach().abs().max() : g.detach().norm(norm_type));
  }
  double local = 0;
  for (const auto& d : norms) {
    const at::Tensor n = at::stack(d.second).to(at::kDouble);
    local = inf ? std::max(local, n.max().item<double>())
                : local + n.pow(norm_type).sum().item<double>();
  }
  double total = 0;
  if (inf) {
    total = group.defined() ? group.max(local) : local;
  } else {
    // Replicas hold equal gradients after a step: each stage counts once.
    const double sum = group.defined() ? group.sum(local) / static_cast<double>(group.replicas())
                                       : local;
    total = std::pow(sum, 1.0 / norm_type);
  }
  const double coef = max_norm / (total + 1e-6);
  if (std::isfinite(total) && coef < 1) {
    for (auto& g : grads) g.mul_(coef);
  }
  return total;
}

MPIPE_FUNC double clip_grad_norm(ModelPipelineImpl& pipe, double max_norm, double norm_type) {
  return clip_grad_norm(pipe.parameters(), max_norm, pipe.options.process_group(), norm_type);
}

}  // namespace mpipe
