#pragma once

#include "mpipe/detail/config.h"

// The training steps: train_step (per-stage programs of forwards and
// backwards, Note [Training runtime]) and constant_train_step (an SNN's T
// time steps in chunks, backward chunk by chunk, Note [Chained backward]).

#include "mpipe/detail/pipeline/pipeline_state.h"
#include "mpipe/detail/pipeline/step_parts-inl.h"

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



MPIPE_FUNC void ModelPipelineImpl::State::check_checkpointable(const char* method,
                                                               bool except_last) const {
  const int64_t first = executor.first_stage(), last = executor.n_total() - 1;
  for (size_t j = 0; j < stateful.size(); ++j) {
    const int64_t stage = first + static_cast<int64_t>(j);
    if (except_last && stage == last) continue;
    for (const auto& m : stateful[j]) {
      TORCH_CHECK(m.state->supports_state_snapshots(), "mpipe::ModelPipeline::", method,
                  ": stage ", stage, " holds a stateful module without state snapshots: ", m.name,
                  ". Checkpointing runs a stage again in backward and must start that module "
                  "from the state its forward saw; implement supports_state_snapshots(), "
                  "save_state() and load_state() (Note [State snapshots] in mpipe/state.h), "
                  "or use Checkpoint::Never");
    }
  }
}

MPIPE_FUNC void ModelPipelineImpl::State::check_checkpointable_steps(
    const detail::CallInfo& info) const {
  // By micro-batch, never the last stage (Note [Checkpointed time steps]);
  // micro-batch 0 is checkpointed whenever any is.
  const detail::TimeChunks chunks{info.n_items, info.chunk, info.rows, info.batch};
  if (!detail::checkpointed(self.options.checkpoint(), 0, chunks.micro_batches())) return;
  check_checkpointable("constant_train_step", /*except_last=*/true);
}

// train_step ----------------------------------------------------------------

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::train_step(const std::vector<Input>& inputs,
                                                           const at::Tensor& target,
                                                           const LossFunction& loss_fn,
                                                           const TrainStepOptions& step,
                                                           bool graphable_call) {
  bool any_grad = false;
  for (const auto& in : inputs) any_grad |= in.tensor.requires_grad();
  CallKind kind;
  kind.method = "train_step";
  kind.step = true;
  // A scaled step runs eagerly (the scale changes as training goes), and so
  // does one whose inputs need gradients or that runs given programs.
  kind.graphable = graphable_call && !any_grad && step.loss_scale() == 1.0 &&
                   step.programs().empty();
  kind.describe = [&] {  // the call's description from the inputs and options, checked
    detail::CallInfo c;
    c.batch = detail::split_batch("train_step", inputs);
    const int64_t n_stages = executor.n_total();
    const bool given = !step.programs().empty();
    if (!given) detail::check_schedule(step, n_stages);
    TORCH_CHECK(std::isfinite(step.loss_scale()) && step.loss_scale() > 0,
                "mpipe::ModelPipeline::train_step: loss_scale must be positive and finite, got ",
                step.loss_scale());
    c.rows = detail::split_rows(step.split(), "train_step", c.batch);
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
  kind.check = [&](const detail::CallInfo& info, detail::RemoteCall* remote) {
    detail::check_grad_mode("train_step");
    if (self.is_training() && self.options.checkpoint() != Checkpoint::Never) {
      check_checkpointable("train_step");
    }
    if (!remote || remote->last()) {
      TORCH_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == info.batch,
                  "mpipe::ModelPipeline::train_step: the target needs the input's batch size (",
                  info.batch, ") along dim 0, got ",
                  target.defined() ? "shape " + c10::str(target.sizes()) : std::string("undefined"));
      detail::check_loss_fn("train_step", loss_fn);
    }
    if (remote && !remote->first()) {  // the first rank's programs, or none, on every rank
      const bool given = info.schedule == detail::kGivenPrograms;
      TORCH_CHECK(given == !step.programs().empty() &&
                      (!given || detail::fingerprint(step.programs()) == info.programs),
                  "mpipe::ModelPipeline::train_step: rank ", remote->group().rank(), "'s "
                  "TrainStepOptions::programs differ from the first rank's (",
                  given ? "given there" : "none there", "); every rank passes the same");
      if (given) detail::check_programs(step.programs(), executor.n_total(), info.n_items);
    }
  };
  kind.plan = [&](const detail::CallInfo& info, const std::vector<Input>& in,
                  const at::Tensor& y, detail::RemoteCall* remote) {
    return plan_train_step(info, in, y, loss_fn, step, remote);
  };
  const Tensors loss = run_call(kind, inputs, target.defined() ? target.detach() : target);
  return loss.empty() ? at::Tensor() : loss[0];
}

MPIPE_FUNC ModelPipelineImpl::State::Plan ModelPipelineImpl::State::plan_train_step(
    const detail::CallInfo& info, const std::vector<Input>& inputs, const at::Tensor& y,
    const LossFunction& loss_fn, const TrainStepOptions& step, detail::RemoteCall* remote) {
  const int64_t rows = info.rows, batch = info.batch;
  const bool mean = info.reduction == static_cast<int64_t>(LossReduction::Mean);
  const bool first = !remote || remote->first();
  const bool last_rank = !remote || remote->last();
  // The caller's inputs (their gradients are accumulated) and their detached
  // copies, which the stages take.
  auto caller = std::make_shared<const std::vector<Input>>(inputs);
  auto in = std::make_shared<std::vector<Input>>();
  std::vector<bool> requires_grad;
  for (const auto& x : inputs) {
    Input d(x.tensor.detach());
    d.batched = x.batched;
    in->push_back(d);
    requires_grad.push_back(first && x.tensor.requires_grad());
  }
  Plan plan;
  detail::CallSpec& spec = plan.spec;
  spec.method = "train_step";
  spec.item_name = "micro-batch";
  spec.training = true;
  spec.micro_batched = true;
  spec.accumulate_cast_grads = self.options.accumulate_cast_grads() && !in_graphed_step;
  spec.remote = remote;
  spec.n_items = info.n_items;
  if (info.schedule == detail::kGivenPrograms) {
    spec.schedule = "given programs";
    spec.programs = step.programs();
  } else {
    const auto schedule = static_cast<Schedule>(info.schedule);
    spec.schedule = to_string(schedule);
    spec.programs = programs_for(schedule, spec.n_items, executor.n_total(), info.virtual_stages);
  }
  spec.source = [in, rows, batch](int64_t i) { return detail::micro_batch(*in, i, rows, batch); };
  spec.target = [y, rows, batch](int64_t i) {
    return Tensors{y.narrow(0, i * rows, std::min(rows, batch - i * rows))};
  };
  const double loss_scale = step.loss_scale();
  auto unscaled = std::make_shared<std::vector<at::Tensor>>(
      loss_scale != 1.0 ? static_cast<size_t>(info.n_items) : 0);
  spec.loss = [loss_fn, mean, rows, batch, loss_scale, unscaled](int64_t i, const Tensors& out,
                                                               const Tensors& tgt) {
    at::Tensor loss = detail::scalar_loss(loss_fn, out, tgt[0]);
    if (mean) loss = loss * (static_cast<double>(std::min(rows, batch - i * rows)) / batch);
    if (loss_scale != 1.0) {  // backward from the scaled loss; the step returns the loss itself
      (*unscaled)[static_cast<size_t>(i)] = loss.detach();
      loss = loss * loss_scale;
    }
    return loss;
  };
  spec.checkpoint = self.is_training() ? self.options.checkpoint() : Checkpoint::Never;
  spec.stateful = &stateful;
  spec.input_requires_grad = requires_grad;
  spec.caller_tensors = detail::tensors_of(*in);
  if (y.defined()) spec.caller_tensors.push_back(y);
  // Data parallelism: what this step adds to the gradients, before it runs.
  auto replicas = std::make_shared<detail::ReplicaGradients>(self.parameters(), remote);
  plan.results = [this, caller, in, requires_grad, rows, batch, mean, last_rank, unscaled,
                  replicas](const detail::CallSpec& done) -> Tensors {
    at::Tensor loss_sum;
    if (last_rank) {  // the step's loss, on the last stage's stream, summed in micro-batch order
      c10::OptionalStreamGuard last_stage(executor.compute_stream(devices.size() - 1));
      for (const auto& l : unscaled->empty() ? done.losses : *unscaled) {
        loss_sum = loss_sum.defined() ? loss_sum + l : l;
      }
    }
    executor.join();  // the caller's streams wait for the sum too (and a graph capture joins it)
    // Parameter gradients and the loss are used on the caller's streams now.
    for (size_t j = 0; j < devices.size(); ++j) {
      for (const auto& p : stages->ptr(j)->parameters()) detail::record_on_current(p.grad());
    }
    if (loss_sum.defined()) detail::record_on_current(loss_sum);
    std::vector<at::Tensor> roots, grads;  // the inputs' gradients, through the caller's graph
    for (size_t k = 0; k < caller->size(); ++k) {
      if (!requires_grad[k]) continue;
      const Input& x = (*caller)[k];
      std::vector<at::Tensor> parts;
      at::Tensor sum;
      for (int64_t i = 0; i < done.n_items; ++i) {
        const at::Tensor mb = detail::micro_batch(*in, i, rows, batch)[k];  // a copy: the vector is a temporary
        at::Tensor g = done.input_grads[static_cast<size_t>(i)][k];
        if (!g.defined()) g = at::zeros_like(mb);
        detail::record_on_current(g);
        g = g.to(x.tensor.device());
        if (x.batched) {
          parts.push_back(g);
        } else {
          sum = sum.defined() ? sum + g : g;
        }
      }
      roots.push_back(x.tensor);
      grads.push_back(x.batched ? at::cat(parts, 0) : sum);
    }
    if (!roots.empty()) {
      detail::NoAutocast no_autocast;  // the caller's graph: the engine's threads
      torch::autograd::backward(roots, grads);
    }
    replicas->reduce(mean, loss_sum);
    return loss_sum.defined() ? Tensors{loss_sum} : Tensors{};
  };
  return plan;
}

// constant_train_step ---------------------------------------------------------

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::constant_train_step(
    const std::vector<Input>& inputs, int64_t T, const at::Tensor& target,
    const LossFunction& loss_fn, int64_t chunk, const std::optional<Split>& split,
    bool graphable_call) {
  CallKind kind;
  kind.method = "constant_train_step";
  kind.step = true;
  kind.fresh_state = true;
  kind.graphable = graphable_call;  // x keeps its autograd identity: with gradients, never graphed
  kind.describe = [&] {
    return constant_call_info("constant_train_step", inputs, T, chunk, split, /*fresh=*/true);
  };
  kind.check = [&](const detail::CallInfo& info, detail::RemoteCall* remote) {
    detail::check_grad_mode("constant_train_step");
    if (self.is_training()) check_checkpointable_steps(info);
    if (!remote || remote->last()) {
      detail::check_loss_fn("constant_train_step", loss_fn);
    }
  };
  kind.plan = [&](const detail::CallInfo& info, const std::vector<Input>& in,
                  const at::Tensor& y, detail::RemoteCall* remote) {
    Plan plan = plan_constant("constant_train_step", info, in, remote, loss_fn, y);
    // Data parallelism: the replicas' gradients averaged (a mean loss).
    auto replicas = std::make_shared<detail::ReplicaGradients>(self.parameters(), remote);
    plan.results = [replicas, results = std::move(plan.results)](const detail::CallSpec& done) {
      const Tensors got = results(done);
      at::Tensor loss = got.empty() ? at::Tensor() : got[0];
      replicas->reduce(/*mean=*/true, loss);
      return loss.defined() ? Tensors{loss} : Tensors{};
    };
    return plan;
  };
  const Tensors loss = run_call(kind, inputs, target);
  return loss.empty() ? at::Tensor() : loss[0];
}

}  // namespace mpipe
