#pragma once

#include "mpipe/detail/config.h"

// The parts of a training step besides its run: the loss of the last stage's
// outputs, the checks of TrainStepOptions (schedules and given programs), and
// the gradient all-reduce across data-parallel replicas.

#include "mpipe/model_pipeline.h"
#include "mpipe/schedule.h"
#include "mpipe/simulate.h"
#include "mpipe/training.h"
#include "mpipe/detail/distributed/remote.h"
#include "mpipe/detail/runtime/errors.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace mpipe {
namespace detail {

/// loss_fn(out, target), its errors marked as the loss function's (and as
/// `method`'s, when the executor does not name the call itself).
MPIPE_FUNC at::Tensor call_loss(const LossFunction& loss_fn, const at::Tensor& out,
                                const at::Tensor& target, const char* method = nullptr) {
  std::string what;
  try {
    return loss_fn(out, target);
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
  } catch (const std::exception& e) {
    what = e.what();
  }
  TORCH_CHECK(false, method ? c10::str("mpipe::ModelPipeline::", method, ": ") : std::string(),
              "the loss function failed: ", what);
}

/// The loss of the last stage's outputs `out`: one output in, one value out
/// (0-dim). `method` prefixes the messages when the caller does not name the
/// call itself (the executor does).
MPIPE_FUNC at::Tensor scalar_loss(const LossFunction& loss_fn, const Tensors& out,
                                  const at::Tensor& target, const char* method = nullptr) {
  const std::string prefix =
      method ? c10::str("mpipe::ModelPipeline::", method, ": ") : std::string();
  TORCH_CHECK(out.size() == 1, prefix, "the last stage returned ", out.size(),
              " tensors; loss_fn takes one");
  at::Tensor loss = call_loss(loss_fn, out[0], target, method);
  TORCH_CHECK(loss.defined() && loss.numel() == 1, prefix,
              "the loss function must return one value, got ",
              loss.defined() ? "shape " + c10::str(loss.sizes()) : std::string("undefined"),
              loss.defined() ? "; reduce it, e.g. with .mean() or .sum()" : "");
  return loss.reshape({});
}

/// CallInfo::schedule of a step that runs TrainStepOptions::programs.
constexpr int64_t kGivenPrograms = -1;

/// A fingerprint of `programs`, so that ranks can check they were given the same.
MPIPE_FUNC int64_t fingerprint(const std::vector<schedules::Program>& programs) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over every operation's fields
  auto mix = [&](int64_t v) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ull;
  };
  for (size_t r = 0; r < programs.size(); ++r) {
    mix(-1 - static_cast<int64_t>(r));
    for (const auto& op : programs[r]) {
      mix(static_cast<int64_t>(op.kind));
      mix(op.micro_batch);
      mix(op.stage);
    }
  }
  return static_cast<int64_t>(h & 0x7fffffffffffffffull) | 1;  // never 0 (no programs)
}

/// TrainStepOptions::programs, refused unless they run this step: every
/// operation once, one worker per stage, no cycle (schedules::simulate).
MPIPE_FUNC void check_programs(const std::vector<schedules::Program>& programs, int64_t n_stages,
                               int64_t n_micro) {
  try {
    schedules::validate(programs, n_stages, n_micro, /*backward=*/true);
    schedules::simulate(programs);
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, "mpipe::ModelPipeline::train_step: TrainStepOptions::programs "
                      "cannot run this step of ", n_micro, " micro-batch(es) over ", n_stages,
                      " stages: ", e.what_without_backtrace());
  }
}

/// TrainStepOptions' values against this pipeline; bad ones throw
/// c10::ValueError, as check_programs does.
MPIPE_FUNC void check_schedule(const TrainStepOptions& step, int64_t n_stages) {
  const int64_t v = step.virtual_stages();
  const bool interleaved =
      step.schedule() == Schedule::Interleaved1F1B || step.schedule() == Schedule::Auto;
  TORCH_CHECK_VALUE(v >= 1, "mpipe::ModelPipeline::train_step: virtual_stages must be >= 1, got ",
                    v);
  TORCH_CHECK_VALUE(v == 1 || interleaved, "mpipe::ModelPipeline::train_step: virtual_stages=", v,
                    " applies to Schedule::Interleaved1F1B and Schedule::Auto, not ",
                    to_string(step.schedule()));
  TORCH_CHECK_VALUE(n_stages % v == 0, "mpipe::ModelPipeline::train_step: virtual_stages=", v,
                    " must divide the stage count, ", n_stages, " (stage s runs on worker s % (",
                    "n_stages / virtual_stages))");
  const auto& costs = step.stage_costs();
  TORCH_CHECK_VALUE(costs.size() <= 1 || static_cast<int64_t>(costs.size()) == n_stages,
                    "mpipe::ModelPipeline::train_step: stage_costs has ", costs.size(),
                    " entries for ", n_stages, " stages (give one, or one per stage)");
  for (size_t s = 0; s < costs.size(); ++s) {
    const auto& c = costs[s];
    TORCH_CHECK_VALUE(c.forward >= 0 && c.backward_input >= 0 && c.backward_weight >= 0 &&
                          c.transfer >= 0,
                      "mpipe::ModelPipeline::train_step: stage_costs[", s,
                      "] has a negative or NaN cost (forward ", c.forward, ", backward_input ",
                      c.backward_input, ", backward_weight ", c.backward_weight, ", transfer ",
                      c.transfer, ")");
  }
  const auto& bytes = step.activation_bytes();
  TORCH_CHECK_VALUE(bytes.empty() || static_cast<int64_t>(bytes.size()) == n_stages,
                    "mpipe::ModelPipeline::train_step: activation_bytes has ", bytes.size(),
                    " entries for ", n_stages, " stages");
  for (size_t s = 0; s < bytes.size(); ++s) {
    TORCH_CHECK_VALUE(bytes[s] >= 0, "mpipe::ModelPipeline::train_step: activation_bytes[", s,
                      "] must be >= 0, got ", bytes[s]);
  }
  TORCH_CHECK_VALUE(step.memory_limit() >= 0,
                    "mpipe::ModelPipeline::train_step: memory_limit must be >= 0 (0: no limit), "
                    "got ", step.memory_limit());
}

/// A label per stage: stages on one device share it.
MPIPE_FUNC std::vector<int64_t> device_labels(const std::vector<c10::Device>& devices) {
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

MPIPE_FUNC void check_grad_mode(const char* method) {
  TORCH_CHECK(c10::GradMode::is_enabled() && !c10::InferenceMode::is_enabled(),
              "mpipe::ModelPipeline::", method, ": gradients are off (NoGradGuard or "
              "InferenceMode is active); a training step needs them");
}

/// A training step's loss function, checked where the loss is taken (the
/// last rank across processes).
MPIPE_FUNC void check_loss_fn(const char* method, const LossFunction& loss_fn) {
  TORCH_CHECK(static_cast<bool>(loss_fn), "mpipe::ModelPipeline::", method, ": loss_fn is empty");
}

// Note [Data parallel replicas]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With GroupOptions::replicas R > 1, each replica trains on its own batch
// and, after the step, what the step added to each parameter's gradient is
// summed across the R replicas of its stage (one c10d allreduce per device
// and dtype, on the group of those replicas), then divided by R for
// LossReduction::Mean: the gradients of one step on the R batches together
// (as many rows each). Gradients accumulated before the step are kept out of
// the sum, so accumulation over several steps stays exact. The last ranks'
// losses are reduced the same way.
class ReplicaGradients {
 public:
  ReplicaGradients(std::vector<at::Tensor> params, detail::RemoteCall* remote)
      : remote_(remote && remote->group().replicas() > 1 ? remote : nullptr) {
    if (!remote_) return;
    params_ = std::move(params);
    for (const auto& p : params_) {
      before_.push_back(p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
    }
  }

  void reduce(bool mean, at::Tensor& loss) {
    if (!remote_) return;
    std::vector<at::Tensor> added;
    for (size_t k = 0; k < params_.size(); ++k) {
      at::Tensor& p = params_[k];
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);  // every replica sends one
      at::Tensor g = p.grad();
      if (before_[k].defined()) g.sub_(before_[k]);
      added.push_back(g);
    }
    if (loss.defined()) added.push_back(loss);
    detail::allreduce_replicas(remote_->group(), added, mean);
    for (size_t k = 0; k < params_.size(); ++k) {
      if (before_[k].defined()) params_[k].grad().add_(before_[k]);
    }
  }

 private:
  detail::RemoteCall* remote_;
  std::vector<at::Tensor> params_, before_;
};

}  // namespace detail

}  // namespace mpipe
