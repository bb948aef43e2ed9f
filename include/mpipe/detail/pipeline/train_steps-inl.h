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

using detail::CallSpec;
using detail::GraphKey;


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
