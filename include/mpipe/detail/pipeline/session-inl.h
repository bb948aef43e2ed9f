#pragma once

#include "mpipe/detail/config.h"

// The session: what every call of a pipeline goes through, as the scope of
// one call (Call): its life (lock, memory watch, rollback), the agreement
// across processes, and its plans through the executor with the timeline
// recorded; and the checks of arguments and options that the calls share.

#include "mpipe/detail/pipeline/session.h"

#include "mpipe/detail/runtime/errors.h"
#include "mpipe/detail/runtime/items.h"
#include "mpipe/detail/runtime/streams.h"
#include "mpipe/detail/runtime/time_chunks.h"

#include "mpipe/simulate.h"
#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <string>

namespace mpipe {

// Note [Plan, then run]
// ~~~~~~~~~~~~~~~~~~~~~~
// A call's own file drives it from start to end, in one pass: the public
// method opens a Call (the call lock, the memory watch, the rollback of
// stateful modules on failure; across processes, the call on every rank),
// describes the call from its arguments (a CallInfo; across processes the
// first rank describes it and every rank agrees on that description), checks
// it, builds its plan (the executor's CallSpec: the items, the programs,
// where inputs come from and outputs go, and how to hand results back),
// executes it and finishes the call. Its describe, check and plan steps read
// the pipeline through a PipelineView and change nothing. The calls live
// with the data they move: pipeline/micro_batch_calls-inl.h (forward,
// train_step) and pipeline/time_step_calls-inl.h (constant_forward,
// sequence_forward, constant_train_step). Which calls a CUDA graph replays is
// the graph policy's (cuda/graph_policy-inl.h), which runs the call's eager
// form when it captures.

namespace detail {

MPIPE_FUNC PipelineParts::PipelineParts(ModelPipelineImpl& owner)
    : self(owner), stages(owner.register_module("stages", torch::nn::ModuleList())) {}

/// The key of a graphed call: what its capture depends on.
MPIPE_FUNC GraphKey key_of(const char* method, const CallInfo& info, const at::Tensor& x,
                              const at::Tensor& target, bool training) {
  GraphKey key;
  key.method = method;
  key.items = info.n_items;
  key.rows = info.rows;
  key.reduce = info.reduce != 0;
  key.time_chunk = info.time_chunk;
  key.schedule = static_cast<int>(info.schedule);
  key.virtual_stages = info.virtual_stages;
  key.reduction = static_cast<int>(info.reduction);
  key.programs = info.programs;
  key.input_sizes = x.sizes().vec();
  key.input_dtype = x.scalar_type();
  if (target.defined()) {
    key.target_sizes = target.sizes().vec();
    key.target_dtype = target.scalar_type();
  }
  key.training = training;
  key.inference = c10::InferenceMode::is_enabled();
  return key;
}

/// What a step's graph key knows of its loss function: the callable's type
/// and, for a plain function, its address. Not what a lambda captured: a
/// graph replays the loss its capture computed (docs/performance.md).
MPIPE_FUNC std::string loss_identity(const LossFunction& fn) {
  using Plain = at::Tensor (*)(const at::Tensor&, const at::Tensor&);
  std::string id = fn.target_type().name();
  if (const Plain* f = fn.target<Plain>()) id += c10::str("@", reinterpret_cast<uintptr_t>(*f));
  return id;
}

/// The memory watch's start: `method` when options.track_memory, else null.
MPIPE_FUNC const char* begin_watch(PipelineParts& parts, const char* method) {
  if (!parts.self.options.track_memory()) return nullptr;
  parts.life.begin_watch(parts.stages);
  return method;
}

MPIPE_FUNC Call::Call(PipelineParts& parts, const char* method)
    : parts_(parts),
      method_(method),
      lock_(parts.life.mutex()),
      watch_{parts, begin_watch(parts, method)},
      rollback_(parts.stages.stateful),  // Note [State snapshots]
      view_(parts.view()) {
  start_with_fresh_casts();  // Note [Autocast in the pipeline]
  if (view_.distributed()) {
    remote_ = parts.group.open(method, parts.self.options.process_group(),
                               parts.self.options.stage_numbers(), parts.stages.devices,
                               parts.executor, late_);
  }
}

MPIPE_FUNC Call::~Call() {
  remote_.reset();
  // State does not outlive a constant_train_step, whatever happens; the
  // rollback, which runs after, puts a failed call's state back as it was.
  if (reset_after_) reset_states(parts_.self);
}

MPIPE_FUNC bool Call::describes() const {
  TORCH_CHECK(late_.empty(), late_);
  return first();
}

MPIPE_FUNC at::Tensor Call::replay(const at::Tensor& x, const at::Tensor& y, const CallInfo& info,
                                   const LossFunction* step, const GraphPolicy::EagerStep& eager) {
  if (remote_ || !GraphPolicy::may_replay(parts_.self.options, x)) return {};  // one process
  GraphKey key = key_of(method_, info, x, y, parts_.self.is_training());
  if (step) {
    key.loss = loss_identity(*step);
    return parts_.graphs.step(parts_.self, parts_.stages, key, x, y, eager);
  }
  return parts_.graphs.call(parts_.self, parts_.stages, key, x,
                            [&](const at::Tensor& xg, bool threaded) {
                              return eager(xg, at::Tensor(), threaded);
                            });
}

MPIPE_FUNC CallInfo Call::agree(const std::optional<CallInfo>& mine) {
  if (!describes()) return remote_->await_call(method_);
  CallInfo info = *mine;
  if (remote_) {
    info.method = method_code(method_);
    remote_->announce(info);
  }
  return info;
}

MPIPE_FUNC void Call::reset_states_now(bool after) {
  reset_states(parts_.self);
  reset_after_ = after;
}

MPIPE_FUNC void Call::execute(CallSpec& spec, bool threaded) {
  RECORD_USER_SCOPE("mpipe::execute");
  std::shared_ptr<Recorder> recorder;
  if (parts_.self.options.record_timeline() && !spec.remote) {  // one process's stages only (docs/distributed.md)
    // The schedule's idle fraction with unit costs, training or not (forward
    // programs give the fill-drain (n - 1) / (m + n - 1)).
    recorder = std::make_shared<Recorder>(spec.method, spec.item_name, spec.n_items,
                                          parts_.stages.devices, schedules::bubble(spec.programs));
    if (spec.training) recorder->describe_schedule(spec.schedule, spec.programs);
  }
  spec.recorder = recorder.get();
  parts_.executor.run(spec, parts_.stages.forwards, threaded);
  if (recorder) parts_.timeline.pending = recorder;
}

MPIPE_FUNC void Call::finish() {
  finished_ = true;
  if (remote_) remote_->finish("", method_);  // throws another rank's failure
}

MPIPE_FUNC void Call::fail() {
  const std::exception_ptr error = std::current_exception();
  if (!remote_ || finished_) std::rethrow_exception(error);
  finished_ = true;
  const std::string what = message_of(error);
  const std::string others = remote_->finish(what, method_);
  if (others.empty()) std::rethrow_exception(error);
  // What the other ranks reported may name the root cause (the rank that
  // stalled behind the one this rank waited for).
  TORCH_CHECK(false, what, "; other ranks: ", others);
}

MPIPE_FUNC void CallLife::begin_watch(const Stages& stages) {
  counters_.clear();
  for (const auto& d : stages.devices) {
    bool seen = false;
    for (const auto& c : counters_) seen |= c.device == d;
    if (!d.is_cuda() || seen) continue;
    reset_allocator_peak(d);
    counters_.push_back({d, allocator_counters(d).allocated, -1});
  }
}

MPIPE_FUNC void CallLife::end_watch(const char* method) {
  for (auto& c : counters_) c.peak = allocator_counters(c.device).peak;
  watched_call_ = method;
}

// What the calls share ----------------------------------------------------

MPIPE_FUNC void check_runnable(const PipelineView& p, const char* method, const at::Tensor* x,
                               bool time_major) {
  // Across processes the first rank checks its inputs as it splits them, and
  // a rank without stages is named to every rank at the first call, so that
  // every rank hears of it (Note [Cross-process calls]).
  if (p.distributed()) return;
  TORCH_CHECK(p.stages.size() > 0, "mpipe::ModelPipeline::", method,
              ": the pipeline has no stages; add them with append(module, device)");
  if (!x) return;
  TORCH_CHECK(x->defined(), "mpipe::ModelPipeline::", method, ": the input is an undefined tensor");
  if (time_major) {
    TORCH_CHECK(x->dim() >= 2, "mpipe::ModelPipeline::", method,
                ": x_seq must be [T, N, ...] (time, then batch), got shape ", x->sizes());
    TORCH_CHECK(x->size(0) > 0, "mpipe::ModelPipeline::", method,
                ": the sequence has no time steps (T = 0), shape ", x->sizes());
  }
  const int64_t batch_dim = time_major ? 1 : 0;
  TORCH_CHECK(x->dim() > batch_dim, "mpipe::ModelPipeline::", method,
              ": the input needs a batch dimension (dim 0), got a 0-dim tensor");
  TORCH_CHECK(x->size(batch_dim) > 0, "mpipe::ModelPipeline::", method,
              ": the input's batch is empty (size 0 along dim ", batch_dim, "), shape ",
              x->sizes());
}

MPIPE_FUNC int64_t time_chunk_of(const ModelPipelineOptions& options, const char* method,
                            std::optional<int64_t> arg) {
  if (arg) {
    TORCH_CHECK(*arg >= 1, "mpipe::ModelPipeline::", method, ": time_chunk (time steps per "
                "stage call) must be >= 1, got ", *arg);
    return *arg;
  }
  if (options.step_mode() == snn::StepMode::Single) return 0;
  TORCH_CHECK(options.time_chunk() >= 0, "mpipe::ModelPipeline::", method,
              ": ModelPipelineOptions::time_chunk (time steps per stage call) must be >= 1, or 0 "
              "for the pipeline's choice, got ", options.time_chunk());
  return options.time_chunk() == 0 ? kAutoChunk : options.time_chunk();
}

MPIPE_FUNC std::optional<Split> split_of(const ModelPipelineOptions& options, const char* method,
                                         std::optional<Split> arg,
                                         const std::vector<Input>& inputs) {
  if (arg) {
    split_rows(*arg, method, 1);  // refuses a value below 1, naming it
    return arg;
  }
  TORCH_CHECK(options.time_micro_batches() >= 0, "mpipe::ModelPipeline::", method,
              ": ModelPipelineOptions::time_micro_batches must be >= 1, or 0 for the "
              "pipeline's choice, got ", options.time_micro_batches());
  bool batched = false;
  for (const auto& in : inputs) batched |= in.batched;
  if (options.time_micro_batches() == 0 || !batched) return std::nullopt;
  return Split::chunks(options.time_micro_batches());
}

MPIPE_FUNC void check_grad_mode(const char* method) {
  TORCH_CHECK(c10::GradMode::is_enabled() && !c10::InferenceMode::is_enabled(),
              "mpipe::ModelPipeline::", method, ": gradients are off (NoGradGuard or "
              "InferenceMode is active); a training step needs them");
}

MPIPE_FUNC void check_loss_fn(const char* method, const LossFunction& loss_fn) {
  TORCH_CHECK(static_cast<bool>(loss_fn), "mpipe::ModelPipeline::", method, ": loss_fn is empty");
}

/// loss_fn(out, target), its errors marked as the loss function's (and as
/// `method`'s, when the executor does not name the call itself).
MPIPE_FUNC at::Tensor call_loss(const LossFunction& loss_fn, const at::Tensor& out,
                                const at::Tensor& target, const char* method) {
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

/// The loss of the last stage's outputs (session.h).
MPIPE_FUNC at::Tensor scalar_loss(const LossFunction& loss_fn, const Tensors& out,
                                  const at::Tensor& target, const char* method) {
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

MPIPE_FUNC void check_checkpointable(const PipelineView& p, const char* method, bool except_last) {
  const auto& stateful = p.stages.stateful;
  for (size_t j = 0; j < stateful.size(); ++j) {
    const int64_t stage = p.executor.stage_map().global[j];
    if (except_last && stage == p.n_stages() - 1) continue;
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

MPIPE_FUNC int64_t fingerprint(const std::vector<schedules::Program>& programs) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over every operation's fields
  auto mix = [&](int64_t v) {
    h ^= static_cast<uint64_t>(v);
    h *= 1099511628211ull;
  };
  for (size_t r = 0; r < programs.size(); ++r) {
    mix(-1 - static_cast<int64_t>(r));
    for (const auto& op : programs[r]) {
      mix(static_cast<int64_t>(op.kind) + (op.with_next ? 16 : 0));
      mix(op.micro_batch);
      mix(op.stage);
    }
  }
  return static_cast<int64_t>(h & 0x7fffffffffffffffull) | 1;  // never 0 (no programs)
}

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
  const bool interleaved = step.schedule() == Schedule::Interleaved1F1B ||
                           step.schedule() == Schedule::Auto || step.schedule() == Schedule::Tailored;
  TORCH_CHECK_VALUE(v >= 1, "mpipe::ModelPipeline::train_step: virtual_stages must be >= 1, got ", v);
  TORCH_CHECK_VALUE(v == 1 || interleaved, "mpipe::ModelPipeline::train_step: virtual_stages=", v,
                    " applies to Schedule::Interleaved1F1B, Auto and Tailored, not ",
                    to_string(step.schedule()));
  TORCH_CHECK_VALUE(n_stages % v == 0, "mpipe::ModelPipeline::train_step: virtual_stages=", v,
                    " must divide the stage count, ", n_stages, " (stage s runs on worker s % (",
                    "n_stages / virtual_stages))");
  const bool vee = step.schedule() == Schedule::ZeroBubbleV || step.schedule() == Schedule::DualPipeV;
  TORCH_CHECK_VALUE(!vee || n_stages % 2 == 0, "mpipe::ModelPipeline::train_step: ",
                    to_string(step.schedule()), " needs an even number of stages, got ", n_stages);
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

MPIPE_FUNC Tensors for_caller(Tensors out) {
  for (const auto& t : out) record_on_current(t);
  return out;
}

MPIPE_FUNC void backward_through_caller(const Tensors& inputs, const Tensors& grads) {
  Tensors roots, sent;
  for (size_t k = 0; k < inputs.size() && k < grads.size(); ++k) {
    if (!grads[k].defined()) continue;
    record_on_current(grads[k]);  // made on a stage's stream
    roots.push_back(inputs[k]);
    sent.push_back(grads[k].to(inputs[k].device()));
  }
  if (roots.empty()) return;
  NoAutocast no_autocast;  // the caller's graph: the engine's threads
  torch::autograd::backward(roots, sent);
}

}  // namespace detail
}  // namespace mpipe
