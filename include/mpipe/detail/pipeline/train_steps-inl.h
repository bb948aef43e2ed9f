#pragma once

#include "mpipe/detail/config.h"

// The training steps: train_step (per-stage programs of forwards and
// backwards, Note [Training runtime]) and constant_train_step (an SNN's T
// time steps, then one backward).

#include "mpipe/detail/pipeline/pipeline_state.h"

#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/backward_scope.h"
#include "mpipe/detail/runtime/rng.h"
#include "mpipe/detail/runtime/scatter.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>

namespace mpipe {

using detail::CallSpec;
using detail::GraphKey;

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
              loss.defined() ? "shape " + c10::str(loss.sizes()) : std::string("undefined"));
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

MPIPE_FUNC void check_schedule(const TrainStepOptions& step, int64_t n_stages) {
  const int64_t v = step.virtual_stages();
  const bool interleaved =
      step.schedule() == Schedule::Interleaved1F1B || step.schedule() == Schedule::Auto;
  TORCH_CHECK(v >= 1, "mpipe::ModelPipeline::train_step: virtual_stages must be >= 1, got ", v);
  TORCH_CHECK(v == 1 || interleaved, "mpipe::ModelPipeline::train_step: virtual_stages=", v,
              " applies to Schedule::Interleaved1F1B and Schedule::Auto, not ",
              to_string(step.schedule()));
  TORCH_CHECK(n_stages % v == 0, "mpipe::ModelPipeline::train_step: virtual_stages=", v,
              " must divide the stage count, ", n_stages, " (stage s runs on worker s % (",
              "n_stages / virtual_stages))");
  const auto& costs = step.stage_costs();
  TORCH_CHECK(costs.size() <= 1 || static_cast<int64_t>(costs.size()) == n_stages,
              "mpipe::ModelPipeline::train_step: stage_costs has ", costs.size(),
              " entries for ", n_stages, " stages (give one, or one per stage)");
  for (size_t s = 0; s < costs.size(); ++s) {
    const auto& c = costs[s];
    TORCH_CHECK(c.forward >= 0 && c.backward_input >= 0 && c.backward_weight >= 0 &&
                    c.transfer >= 0,
                "mpipe::ModelPipeline::train_step: stage_costs[", s,
                "] has a negative or NaN cost (forward ", c.forward, ", backward_input ",
                c.backward_input, ", backward_weight ", c.backward_weight, ", transfer ",
                c.transfer, ")");
  }
  const auto& bytes = step.activation_bytes();
  TORCH_CHECK(bytes.empty() || static_cast<int64_t>(bytes.size()) == n_stages,
              "mpipe::ModelPipeline::train_step: activation_bytes has ", bytes.size(),
              " entries for ", n_stages, " stages");
  for (size_t s = 0; s < bytes.size(); ++s) {
    TORCH_CHECK(bytes[s] >= 0, "mpipe::ModelPipeline::train_step: activation_bytes[", s,
                "] must be >= 0, got ", bytes[s]);
  }
  TORCH_CHECK(step.memory_limit() >= 0, "mpipe::ModelPipeline::train_step: memory_limit must be "
              ">= 0 (0: no limit), got ", step.memory_limit());
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

MPIPE_FUNC void ModelPipelineImpl::State::check_checkpointable(const char* method) const {
  for (size_t j = 0; j < stateful.size(); ++j) {
    for (const auto& m : stateful[j]) {
      TORCH_CHECK(m.state->supports_state_snapshots(), "mpipe::ModelPipeline::", method,
                  ": stage ", j, " holds a stateful module without state snapshots: ", m.name,
                  ". Checkpointing runs a stage again in backward and must start that module "
                  "from the state its forward saw; implement supports_state_snapshots(), "
                  "save_state() and load_state() (Note [State snapshots] in mpipe/state.h), "
                  "or use Checkpoint::Never");
    }
  }
}

MPIPE_FUNC bool ModelPipelineImpl::State::step_graphable(const at::Tensor& x,
                                                         const at::Tensor& target) const {
  if (x.requires_grad() || (self.is_training() && self.options.checkpoint() != Checkpoint::Never)) {
    return false;  // input gradients leave the graph; a recompute is not captured
  }
  if (target.defined() && target.device() != x.device()) return false;
  // graphable()'s rules apart from grad mode (it also refuses while a timeline
  // is recorded).
  c10::NoGradGuard no_grad;
  return graphable(x);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::run_step(
    const GraphKey& key, bool graphable_call, const at::Tensor& x, const at::Tensor& target,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>& eager) {
  if (graphable_call && self.options.cuda_graphs() && step_graphable(x, target)) {
    detail::PlainDraws plain;  // a replay draws what its capture drew (Note [Random draws])
    struct Flag {  // graphed steps keep autograd's accumulation (Note [Cast gradients per step])
      bool& on;
      explicit Flag(bool& f) : on(f) { on = true; }
      ~Flag() { on = false; }
    } graphed{in_graphed_step};
    at::Tensor loss = detail::run_graphed_step(
        *graphs, key.str(), {x, target}, self.parameters(),
        [&](const std::vector<at::Tensor>& in) { return eager(in[0], in[1], /*threaded=*/false); },
        [this] { reset_states(self); });
    if (loss.defined()) {
      reset_states(self);  // Note [CUDA graphs]: state does not outlive a graphed call
      return loss;
    }
  }
  return eager(x, target, self.options.worker_threads());
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::step_items(
    const std::vector<Input>& inputs, const std::vector<Input>& in, const at::Tensor& y,
    const LossFunction& loss_fn, const detail::CallInfo& info, bool threaded,
    detail::RemoteCall* remote, double loss_scale, const std::vector<schedules::Program>* given) {
  const int64_t rows = info.rows, batch = info.batch;
  const bool mean = info.reduction == static_cast<int64_t>(LossReduction::Mean);
  const bool first = !remote || remote->first();
  const bool last_rank = !remote || remote->last();
  std::vector<bool> requires_grad;
  bool any_grad = false;
  for (const auto& x : inputs) {
    requires_grad.push_back(first && x.tensor.requires_grad());
    any_grad |= first && x.tensor.requires_grad();
  }
  CallSpec spec;
  spec.method = "train_step";
  spec.item_name = "micro-batch";
  spec.training = true;
  spec.micro_batched = true;
  spec.accumulate_cast_grads = self.options.accumulate_cast_grads() && !in_graphed_step;
  spec.remote = remote;
  spec.n_items = info.n_items;
  if (info.schedule == detail::kGivenPrograms) {
    TORCH_INTERNAL_ASSERT(given != nullptr);
    spec.schedule = "given programs";
    spec.programs = *given;
  } else {
    const auto schedule = static_cast<Schedule>(info.schedule);
    spec.schedule = to_string(schedule);
    spec.programs = programs_for(schedule, spec.n_items, executor.n_total(), info.virtual_stages);
  }
  spec.source = [&](int64_t i) { return detail::micro_batch(in, i, rows, batch); };
  spec.target = [&](int64_t i) {
    return Tensors{y.narrow(0, i * rows, std::min(rows, batch - i * rows))};
  };
  const bool scaled = loss_scale != 1.0;
  std::vector<at::Tensor> unscaled(scaled ? static_cast<size_t>(info.n_items) : 0);
  spec.loss = [&](int64_t i, const Tensors& out, const Tensors& tgt) {
    at::Tensor loss = detail::scalar_loss(loss_fn, out, tgt[0]);
    if (mean) loss = loss * (static_cast<double>(std::min(rows, batch - i * rows)) / batch);
    if (scaled) {  // backward from the scaled loss; the step returns the loss itself
      unscaled[static_cast<size_t>(i)] = loss.detach();
      loss = loss * loss_scale;
    }
    return loss;
  };
  spec.checkpoint = self.is_training() ? self.options.checkpoint() : Checkpoint::Never;
  spec.stateful = &stateful;
  spec.input_requires_grad = requires_grad;
  spec.caller_tensors = detail::tensors_of(in);
  if (y.defined()) spec.caller_tensors.push_back(y);
  detail::ReplicaGradients replicas(self.parameters(),
                                              remote);  // data parallelism: what this step adds
  execute(spec, threaded);
  at::Tensor loss_sum;
  if (last_rank) {  // the step's loss, on the last stage's stream, summed in micro-batch order
    c10::OptionalStreamGuard last_stage(executor.compute_stream(devices.size() - 1));
    for (const auto& l : scaled ? unscaled : spec.losses) {
      loss_sum = loss_sum.defined() ? loss_sum + l : l;
    }
  }
  executor.join();  // the caller's streams wait for the sum too (and a graph capture joins it)
  // Parameter gradients and the loss are used on the caller's streams now.
  for (size_t j = 0; j < devices.size(); ++j) {
    for (const auto& p : stages->ptr(j)->parameters()) detail::record_on_current(p.grad());
  }
  if (loss_sum.defined()) detail::record_on_current(loss_sum);
  if (any_grad) {  // the inputs' gradients, through the caller's own graph
    std::vector<at::Tensor> roots, grads;
    for (size_t k = 0; k < inputs.size(); ++k) {
      if (!requires_grad[k]) continue;
      std::vector<at::Tensor> parts;
      at::Tensor sum;
      for (int64_t i = 0; i < spec.n_items; ++i) {
        const at::Tensor mb = detail::micro_batch(in, i, rows, batch)[k];  // a copy: the vector is a temporary
        at::Tensor g = spec.input_grads[static_cast<size_t>(i)][k];
        if (!g.defined()) g = at::zeros_like(mb);
        detail::record_on_current(g);
        g = g.to(inputs[k].tensor.device());
        if (inputs[k].batched) {
          parts.push_back(g);
        } else {
          sum = sum.defined() ? sum + g : g;
        }
      }
      roots.push_back(inputs[k].tensor);
      grads.push_back(inputs[k].batched ? at::cat(parts, 0) : sum);
    }
    detail::NoAutocast no_autocast;  // the caller's graph: the engine's threads
    torch::autograd::backward(roots, grads);
  }
  replicas.reduce(mean, loss_sum);
  return loss_sum;
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::train_step(const std::vector<Input>& inputs,
                                                           const at::Tensor& target,
                                                           const LossFunction& loss_fn,
                                                           const TrainStepOptions& step,
                                                           bool graphable_call) {
  // The call's description from the inputs and options (the first rank's,
  // across processes), checked.
  auto describe = [&] {
    detail::CallInfo c;
    c.batch = detail::split_batch("train_step", inputs);
    detail::check_split("train_step", step.split_size());
    const int64_t n_stages = executor.n_total();
    const bool given = !step.programs().empty();
    if (!given) detail::check_schedule(step, n_stages);
    TORCH_CHECK(std::isfinite(step.loss_scale()) && step.loss_scale() > 0,
                "mpipe::ModelPipeline::train_step: loss_scale must be positive and finite, got ",
                step.loss_scale());
    c.rows = step.split_size();
    c.n_items = (c.batch - 1) / c.rows + 1;  // not (batch + rows - 1) / rows: rows may be huge
    c.virtual_stages = step.virtual_stages();
    c.reduction = static_cast<int64_t>(step.reduction());
    if (given) {
      detail::check_programs(step.programs(), n_stages, c.n_items);
      c.schedule = detail::kGivenPrograms;
      c.programs = detail::fingerprint(step.programs());
      return c;
    }
    std::vector<int64_t> labels;
    if (distributed()) {  // every process its own device, apart from this rank's stages
      const auto mine = detail::device_labels(devices);
      for (int64_t s = 0; s < n_stages; ++s) {
        const int64_t local = s - executor.first_stage();
        labels.push_back(local >= 0 && local < static_cast<int64_t>(devices.size())
                             ? executor.first_stage() + mine[static_cast<size_t>(local)]
                             : s);
      }
    } else {
      labels = detail::device_labels(devices);
    }
    c.schedule = static_cast<int64_t>(
        step.schedule() == Schedule::Auto ? choose_schedule(c.n_items, n_stages, step, labels).schedule
                                          : step.schedule());
    return c;
  };
  auto check_target = [&](int64_t batch) {
    TORCH_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == batch,
                "mpipe::ModelPipeline::train_step: the target needs the input's batch size (",
                batch, ") along dim 0, got ",
                target.defined() ? "shape " + c10::str(target.sizes()) : std::string("undefined"));
    TORCH_CHECK(static_cast<bool>(loss_fn), "mpipe::ModelPipeline::train_step: loss_fn is empty");
  };
  auto detach = [](const std::vector<Input>& in) {
    std::vector<Input> detached;
    for (const auto& x : in) {
      Input d(x.tensor.detach());
      d.batched = x.batched;
      detached.push_back(d);
    }
    return detached;
  };
  if (distributed()) {
    return guarded("train_step", [&] {
      return across("train_step", [&](detail::RemoteCall& call) {
        detail::check_grad_mode("train_step");
        if (self.is_training() && self.options.checkpoint() != Checkpoint::Never) {
          check_checkpointable("train_step");
        }
        const auto info = agree(call, "train_step", describe);
        if (call.last()) check_target(info.batch);
        if (!call.first()) {  // the first rank's programs, or none, on every rank
          const bool given = info.schedule == detail::kGivenPrograms;
          TORCH_CHECK(given == !step.programs().empty() &&
                          (!given || detail::fingerprint(step.programs()) == info.programs),
                      "mpipe::ModelPipeline::train_step: rank ", call.group().rank(), "'s "
                      "TrainStepOptions::programs differ from the first rank's (",
                      given ? "given there" : "none there", "); every rank passes the same");
          if (given) detail::check_programs(step.programs(), executor.n_total(), info.n_items);
        }
        const std::vector<Input> none;
        return step_items(call.first() ? inputs : none, call.first() ? detach(inputs) : none,
                          call.last() ? target.detach() : at::Tensor(), loss_fn, info,
                          self.options.worker_threads(), &call, step.loss_scale(),
                          &step.programs());
      });
    });
  }
  const detail::CallInfo info = [&] {
    auto c = describe();
    check_target(c.batch);
    detail::check_grad_mode("train_step");
    return c;
  }();
  bool any_grad = false;
  for (const auto& in : inputs) any_grad |= in.tensor.requires_grad();
  return guarded("train_step", [&] {
    if (self.is_training() && self.options.checkpoint() != Checkpoint::Never) {
      check_checkpointable("train_step");
    }
    const std::vector<Input> detached = detach(inputs);
    // A scaled step runs eagerly: the scale changes as training goes.
    const bool graphed = graphable_call && inputs.size() == 1 && !any_grad &&
                         step.loss_scale() == 1.0 && step.programs().empty();
    if (!graphed) {
      return step_items(inputs, detached, target.detach(), loss_fn, info,
                        self.options.worker_threads(), nullptr, step.loss_scale(),
                        &step.programs());
    }
    GraphKey key;
    key.method = "train_step";
    key.items = info.rows;
    key.schedule = static_cast<int>(step.schedule());
    key.reduction = static_cast<int>(step.reduction());
    key.input_sizes = inputs[0].tensor.sizes().vec();
    key.input_dtype = inputs[0].tensor.scalar_type();
    key.target_sizes = target.sizes().vec();
    key.target_dtype = target.scalar_type();
    key.training = self.is_training();
    return run_step(key, graphed, detached[0].tensor, target.detach(),
                    [&](const at::Tensor& x, const at::Tensor& y, bool threaded) {
                      Input d(x);
                      return step_items({d}, {d}, y, loss_fn, info, threaded, nullptr);
                    });
  });
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::constant_train_step(
    const std::vector<Input>& inputs, int64_t T, const at::Tensor& target,
    const LossFunction& loss_fn, int64_t chunk, bool graphable_call) {
  if (!distributed()) {
    detail::batch_size("constant_train_step", inputs, 0);
    TORCH_CHECK(T > 0, "mpipe::ModelPipeline::constant_train_step: T (the number of time steps) "
                "must be positive, got ", T);
    TORCH_CHECK(static_cast<bool>(loss_fn),
                "mpipe::ModelPipeline::constant_train_step: loss_fn is empty");
  }
  detail::check_grad_mode("constant_train_step");
  std::vector<bool> batched;
  for (const auto& in : inputs) batched.push_back(in.batched);
  // One step of this rank's stages: constant_forward's call with the loss of
  // the summed outputs backpropagated chunk by chunk (Note [Chained backward]).
  auto step = [&](const Tensors& in, const at::Tensor& y, int64_t n_steps, int64_t k,
                  bool threaded, detail::RemoteCall* remote) {
    const Tensors loss = run_constant(
        "constant_train_step", in, n_steps, /*reduce=*/true, k, threaded, remote, batched,
        [&](const Tensors& outs) { return detail::scalar_loss(loss_fn, outs, y); }, y);
    if (loss.empty()) return at::Tensor();  // not the last rank
    detail::record_on_current(loss[0]);  // the caller's streams waited for the stages
    return loss[0];
  };
  // State does not outlive the step, whatever happens. The rollback (guarded)
  // is set up before, so a failed step ends with the state of its start, not
  // reset (Note [State snapshots]).
  struct ResetAfter {
    torch::nn::Module& m;
    explicit ResetAfter(torch::nn::Module& module) : m(module) { reset_states(m); }
    ~ResetAfter() { reset_states(m); }
  };
  if (distributed()) {
    return guarded("constant_train_step", [&] {
      ResetAfter reset_after(self);
      return across("constant_train_step", [&](detail::RemoteCall& call) {
        const auto info = agree(call, "constant_train_step", [&] {
          return constant_call_info("constant_train_step", inputs, T, chunk);
        });
        if (call.last()) {
          TORCH_CHECK(static_cast<bool>(loss_fn),
                      "mpipe::ModelPipeline::constant_train_step: loss_fn is empty");
        }
        detail::ReplicaGradients replicas(self.parameters(), &call);  // a mean loss
        at::Tensor loss = step(call.first() ? detail::tensors_of(inputs) : Tensors{},
                               call.last() ? target : at::Tensor(), info.n_items, info.chunk,
                               self.options.worker_threads(), &call);
        replicas.reduce(/*mean=*/true, loss);
        return loss;
      });
    });
  }
  chunk = resolve_chunk(chunk, T);
  return guarded("constant_train_step", [&] {
    ResetAfter reset_after(self);
    const Tensors in = detail::tensors_of(inputs);
    if (!(graphable_call && inputs.size() == 1)) {
      return step(in, target, T, chunk, self.options.worker_threads(), nullptr);
    }
    GraphKey key;
    key.method = "constant_train_step";
    key.items = T;
    key.chunk = chunk;
    key.input_sizes = in[0].sizes().vec();
    key.input_dtype = in[0].scalar_type();
    if (target.defined()) {
      key.target_sizes = target.sizes().vec();
      key.target_dtype = target.scalar_type();
    }
    key.training = self.is_training();
    // x keeps its autograd identity (its gradient is accumulated if it
    // requires one); such a step is never graphed.
    return run_step(key, true, in[0], target,
                    [&](const at::Tensor& x, const at::Tensor& y, bool threaded) {
                      return step({x}, y, T, chunk, threaded, nullptr);
                    });
  });
}

}  // namespace mpipe
