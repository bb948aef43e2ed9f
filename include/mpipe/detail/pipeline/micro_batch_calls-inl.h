#pragma once

#include "mpipe/detail/config.h"

// The micro-batch calls, forward and train_step: their public methods, and
// each call's description, checks, plan and results (Note [Plan, then run]
// in session-inl.h). train_step runs per-stage programs of forwards and
// backwards (Note [Training runtime] in runtime/actions-inl.h).

#include "mpipe/detail/pipeline/session.h"

#include "mpipe/detail/distributed/replicas.h"
#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/items.h"
#include "mpipe/detail/runtime/streams.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <memory>

namespace mpipe {
namespace detail {

/// A batch cut into micro-batches of `rows` rows (split_rows), checked.
MPIPE_FUNC CallInfo micro_batches(const char* method, const std::vector<Input>& inputs,
                                  const Split& split) {
  CallInfo c;
  c.batch = split_batch(method, inputs);
  c.rows = split_rows(split, method, c.batch);
  c.n_items = (c.batch - 1) / c.rows + 1;  // not (batch + rows - 1) / rows: rows may be huge
  return c;
}

// forward --------------------------------------------------------------------

/// forward's plan: micro-batches through forward-only programs.
MPIPE_FUNC Plan forward_plan(const PipelineView& p, const CallInfo& info,
                             const std::vector<Input>& in, RemoteCall* remote) {
  const int64_t n_stages = p.n_stages();
  Plan plan;
  CallSpec& spec = plan.spec;
  spec.method = "forward";
  spec.item_name = "micro-batch";
  spec.n_items = info.n_items;
  spec.micro_batched = true;
  spec.programs = schedules::forward_only(spec.n_items, n_stages);
  auto kept = std::make_shared<const std::vector<Input>>(in);
  spec.source = [kept, rows = info.rows, batch = info.batch](int64_t i) {
    return micro_batch(*kept, i, rows, batch);
  };
  spec.caller_tensors = tensors_of(in);
  spec.remote = remote;
  auto outs = std::make_shared<std::vector<Tensors>>(static_cast<size_t>(spec.n_items));
  spec.sink = [outs](int64_t i, Tensors o) { (*outs)[static_cast<size_t>(i)] = std::move(o); };
  const int64_t lanes_option = p.options().lanes();
  TORCH_CHECK(lanes_option >= 0, "mpipe::ModelPipeline::forward: ModelPipelineOptions::"
              "lanes must be 0 (automatic) or positive, got ", lanes_option);
  // lanes(0): one lane per micro-batch, up to 8 (Note [Lanes]).
  int64_t lanes = lanes_option > 0 ? lanes_option : std::min<int64_t>(spec.n_items, 8);
  // Under autocast a stage's micro-batches share the casts of its weights
  // (Note [Autocast in the pipeline]), made on the stream of the first: other
  // lanes would read them unordered.
  if (AutocastState::current().any()) lanes = 1;
  if (lanes > 1 && !remote) {  // Note [Lanes]: stages that keep no state
    spec.lanes = lanes;
    for (size_t j = 0; j < p.stages.size(); ++j) {
      spec.lane_stages.push_back(p.stages.stateful[j].empty() &&
                                 p.stages.modules->ptr(j)->buffers().empty());
    }
  }
  plan.results = [outs, remote, n_stages](const CallSpec&) -> Tensors {
    if (remote && !remote->last()) return {};
    return for_caller(gather("forward", "micro-batch", n_stages - 1, *outs, false, true));
  };
  return plan;
}

MPIPE_FUNC Tensors forward(PipelineParts& parts, const std::vector<Input>& inputs, Split split,
                           bool one_tensor) {
  Call call(parts, "forward");
  try {
    const PipelineView& p = call.view();
    std::optional<CallInfo> mine;
    if (call.describes()) {
      check_runnable(p, "forward", one_tensor ? &inputs[0].tensor : nullptr);
      mine = micro_batches("forward", inputs, split);
    }
    const CallInfo info = call.agree(mine);
    // The plan, run (eagerly, or by the graph policy's capture).
    auto eager = [&](const std::vector<Input>& in, bool threaded, RemoteCall* remote) {
      Plan plan = forward_plan(p, info, in, remote);
      call.execute(plan.spec, threaded);
      return plan.results(plan.spec);
    };
    at::Tensor replayed;
    if (one_tensor) {
      replayed = call.replay(inputs[0].tensor, {}, info, /*step=*/nullptr,
                             [&](const at::Tensor& x, const at::Tensor&, bool threaded) {
                               return one_output("forward", eager({Input(x)}, threaded, nullptr));
                             });
    }
    const std::vector<Input> none;
    Tensors out = replayed.defined() ? Tensors{replayed}
                                     : eager(call.first() ? inputs : none,
                                             p.options().worker_threads(), call.remote());
    call.finish();
    return out;
  } catch (...) {
    call.fail();
  }
}

// train_step -------------------------------------------------------------------

/// train_step's description: its micro-batches and schedule (checked).
MPIPE_FUNC CallInfo train_step_info(const PipelineView& p, const std::vector<Input>& inputs,
                                    const TrainStepOptions& step) {
  CallInfo c = micro_batches("train_step", inputs, step.split());
  const int64_t n_stages = p.n_stages();
  const bool given = !step.programs().empty();
  if (!given) check_schedule(step, n_stages);
  TORCH_CHECK(std::isfinite(step.loss_scale()) && step.loss_scale() > 0,
              "mpipe::ModelPipeline::train_step: loss_scale must be positive and finite, got ",
              step.loss_scale());
  c.virtual_stages = step.virtual_stages();
  c.reduction = static_cast<int64_t>(step.reduction());
  if (given) {
    check_programs(step.programs(), n_stages, c.n_items);
    c.schedule = kGivenPrograms;
    c.programs = fingerprint(step.programs());
    return c;
  }
  std::vector<int64_t> labels = p.stages.device_labels();
  if (p.distributed()) {  // this rank's stages on their devices, every other rank on one
    const StageMap& map = p.executor.stage_map();
    const auto mine = labels;
    labels.clear();
    for (int64_t s = 0; s < n_stages; ++s) {
      labels.push_back(map.holds(s) ? mine[map.at(s)] : n_stages + p.group.layout().rank_of(s));
    }
  }
  if (step.schedule() != Schedule::Auto && step.schedule() != Schedule::Tailored) {
    c.schedule = static_cast<int64_t>(step.schedule());
    return c;
  }
  const ScheduleChoice choice = choose_schedule(c.n_items, n_stages, step, labels);
  c.schedule = static_cast<int64_t>(choice.schedule);
  if (choice.schedule == Schedule::Tailored) {  // built here, sent to the other ranks
    c.tailored = choice.programs;
    c.programs = fingerprint(choice.programs);
  }
  return c;
}

/// The checks every rank makes of a train_step, given its description.
MPIPE_FUNC void check_train_step(const PipelineView& p, const CallInfo& info,
                                 const at::Tensor& target, const LossFunction& loss_fn,
                                 const TrainStepOptions& step, RemoteCall* remote) {
  check_grad_mode("train_step");
  if (p.training() && p.options().checkpoint() != Checkpoint::Never) {
    check_checkpointable(p, "train_step");
  }
  if (!remote || remote->last()) {
    TORCH_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == info.batch,
                "mpipe::ModelPipeline::train_step: the target needs the input's batch size (",
                info.batch, ") along dim 0, got ",
                target.defined() ? "shape " + c10::str(target.sizes()) : std::string("undefined"));
    check_loss_fn("train_step", loss_fn);
  }
  if (remote && !remote->first()) {  // the first rank's programs, or none, on every rank
    const auto& programs = step.programs();
    const bool given = info.schedule == kGivenPrograms;
    TORCH_CHECK(given == !programs.empty() && (!given || fingerprint(programs) == info.programs),
                "mpipe::ModelPipeline::train_step: rank ", remote->group().rank(), "'s "
                "TrainStepOptions::programs differ from the first rank's (",
                given ? "given there" : "none there", "); every rank passes the same");
    if (given) check_programs(programs, p.n_stages(), info.n_items);
    if (info.schedule == static_cast<int64_t>(Schedule::Tailored)) {
      TORCH_CHECK(fingerprint(info.tailored) == info.programs,
                  "mpipe::ModelPipeline::train_step: Tailored's programs arrived damaged");
      check_programs(info.tailored, p.n_stages(), info.n_items);
    }
  }
}

/// train_step's plan: per-stage programs of forwards and backwards over the
/// micro-batches; the results send the inputs' gradients through the
/// caller's graph.
MPIPE_FUNC Plan train_step_plan(const PipelineView& p, const CallInfo& info,
                                const std::vector<Input>& caller_inputs, const at::Tensor& y,
                                const LossFunction& loss_fn, const TrainStepOptions& step,
                                RemoteCall* remote) {
  const int64_t rows = info.rows, batch = info.batch;
  const bool mean = info.reduction == static_cast<int64_t>(LossReduction::Mean);
  const bool first = !remote || remote->first();
  // The caller's inputs (their gradients are accumulated) and their detached
  // copies, which the stages take.
  auto caller = std::make_shared<const std::vector<Input>>(caller_inputs);
  auto in = std::make_shared<std::vector<Input>>();
  std::vector<bool> requires_grad;
  for (const auto& x : caller_inputs) {
    Input d(x.tensor.detach());
    d.batched = x.batched;
    in->push_back(d);
    requires_grad.push_back(first && x.tensor.requires_grad());
  }
  Plan plan;
  CallSpec& spec = plan.spec;
  spec.method = "train_step";
  spec.item_name = "micro-batch";
  spec.training = true;
  spec.micro_batched = true;
  spec.accumulate_cast_grads = p.options().accumulate_cast_grads();
  spec.remote = remote;
  spec.n_items = info.n_items;
  if (info.schedule == kGivenPrograms) {
    spec.schedule = "given programs";
    spec.programs = step.programs();
  } else if (info.schedule == static_cast<int64_t>(Schedule::Tailored)) {
    spec.schedule = "Tailored";
    spec.programs = info.tailored;
  } else {
    const auto schedule = static_cast<Schedule>(info.schedule);
    spec.schedule = to_string(schedule);
    spec.programs = programs_for(schedule, spec.n_items, p.n_stages(), info.virtual_stages);
  }
  spec.source = [in, rows, batch](int64_t i) { return micro_batch(*in, i, rows, batch); };
  spec.target = [y, rows, batch](int64_t i) {
    return Tensors{y.narrow(0, i * rows, std::min(rows, batch - i * rows))};
  };
  spec.loss = [loss_fn, mean, rows, batch](int64_t i, const Tensors& out,
                                                      const Tensors& tgt) {
    at::Tensor loss = scalar_loss(loss_fn, out, tgt[0]);
    if (mean) loss = loss * (static_cast<double>(std::min(rows, batch - i * rows)) / batch);
    return loss;
  };
  spec.loss_scale = step.loss_scale();  // backward from the scaled loss; the step returns the loss
  spec.checkpoint = p.training() ? p.options().checkpoint() : Checkpoint::Never;
  spec.stateful = &p.stages.stateful;
  spec.input_requires_grad = requires_grad;
  spec.caller_tensors = tensors_of(*in);
  if (y.defined()) spec.caller_tensors.push_back(y);
  // Data parallelism: what this step adds to the gradients, before it runs.
  std::shared_ptr<ReplicaGradients> replicas;
  if (remote && remote->group().replicas() > 1) {
    replicas = std::make_shared<ReplicaGradients>(p.module.parameters(), *remote);
  }
  const Stages* stages = &p.stages;
  plan.results = [stages, caller, in, requires_grad, rows, batch, mean,
                  replicas](const CallSpec& done) -> Tensors {
    // The executor's join made the stages' work the caller's: parameter
    // gradients and the loss are used on the caller's streams now.
    for (size_t j = 0; j < stages->size(); ++j) {
      for (const auto& param : stages->modules->ptr(j)->parameters()) {
        record_on_current(param.grad());
      }
    }
    at::Tensor loss = done.loss_sum;
    if (loss.defined()) record_on_current(loss);
    Tensors roots, grads;  // the inputs' gradients, each joined over the micro-batches
    for (size_t k = 0; k < caller->size(); ++k) {
      if (!requires_grad[k]) continue;
      const Input& x = (*caller)[k];
      std::vector<at::Tensor> parts;
      at::Tensor sum;
      for (int64_t i = 0; i < done.n_items; ++i) {
        at::Tensor g = done.input_grads[static_cast<size_t>(i)][k];
        if (!g.defined()) g = at::zeros_like(micro_batch(*in, i, rows, batch)[k]);
        record_on_current(g);
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
    backward_through_caller(roots, grads);
    if (replicas) replicas->reduce(mean, loss);
    return loss.defined() ? Tensors{loss} : Tensors{};
  };
  return plan;
}

MPIPE_FUNC at::Tensor train_step(PipelineParts& parts, const std::vector<Input>& inputs,
                                 const at::Tensor& target_in, const LossFunction& loss_fn,
                                 const TrainStepOptions& step, bool one_tensor) {
  const at::Tensor target = target_in.defined() ? target_in.detach() : target_in;
  Call call(parts, "train_step");
  try {
    const PipelineView& p = call.view();
    std::optional<CallInfo> mine;
    if (call.describes()) {
      check_runnable(p, "train_step", one_tensor ? &inputs[0].tensor : nullptr);
      mine = train_step_info(p, inputs, step);
    }
    const CallInfo info = call.agree(mine);
    check_train_step(p, info, target, loss_fn, step, call.remote());
    auto eager = [&](const std::vector<Input>& in, const at::Tensor& y, bool threaded,
                     RemoteCall* remote) {
      Plan plan = train_step_plan(p, info, in, y, loss_fn, step, remote);
      call.execute(plan.spec, threaded);
      return one_output("train_step", plan.results(plan.spec));
    };
    at::Tensor loss;
    // A scaled step runs eagerly (the scale changes as training goes), and so
    // does one whose input needs gradients or that runs given programs.
    if (one_tensor && !inputs[0].tensor.requires_grad() && step.loss_scale() == 1.0 &&
        step.programs().empty()) {
      loss = call.replay(inputs[0].tensor, target, info, &loss_fn,
                         [&](const at::Tensor& x, const at::Tensor& y, bool threaded) {
                           return eager({Input(x)}, y, threaded, nullptr);
                         });
    }
    if (!loss.defined()) {
      const std::vector<Input> none;
      loss = eager(call.first() ? inputs : none, call.last() ? target : at::Tensor(),
                   p.options().worker_threads(), call.remote());
    }
    call.finish();
    return loss;
  } catch (...) {
    call.fail();
  }
}

}  // namespace detail

// The public methods ---------------------------------------------------------

MPIPE_FUNC at::Tensor ModelPipelineImpl::forward(const at::Tensor& x, Split split) {
  return detail::one_output("forward", detail::forward(*parts_, {x}, split, true));
}

MPIPE_FUNC Tensors ModelPipelineImpl::forward(const std::vector<Input>& inputs, Split split) {
  return detail::forward(*parts_, inputs, split, false);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::train_step(const at::Tensor& input,
                                                    const at::Tensor& target,
                                                    const LossFunction& loss_fn,
                                                    const TrainStepOptions& step) {
  return detail::train_step(*parts_, {input}, target, loss_fn, step, true);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::train_step(const std::vector<Input>& inputs,
                                                    const at::Tensor& target,
                                                    const LossFunction& loss_fn,
                                                    const TrainStepOptions& step) {
  return detail::train_step(*parts_, inputs, target, loss_fn, step, false);
}

}  // namespace mpipe
