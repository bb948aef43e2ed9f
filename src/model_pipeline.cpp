#include "mpipe/model_pipeline.h"
#include "mpipe/schedule.h"
#include "mpipe/state.h"

#include "backward_positions.h"
#include "device_probe.h"
#include "graphs.h"
#include "recorder.h"
#include "rng.h"
#include "runtime.h"
#include "state_snapshot.h"
#include "streams.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/ScalarType.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/autograd.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <ostream>
#include <string>

namespace mpipe {

ModelPipelineImpl::ModelPipelineImpl(ModelPipelineOptions options_)
    : options(options_),
      runtime_(std::make_unique<detail::Runtime>()),
      graphs_(detail::make_graph_cache()) {
  stages_ = register_module("stages", torch::nn::ModuleList());
}

ModelPipelineImpl::~ModelPipelineImpl() = default;

ModelPipelineImpl& ModelPipelineImpl::append(torch::nn::AnyModule module,
                                             const DeviceArg& device) {
  TORCH_CHECK(!module.is_empty(), "mpipe::ModelPipeline::append: stage ", size(),
              " is an empty AnyModule");
  std::shared_ptr<torch::nn::Module> ptr = module.ptr();
  auto any = std::make_shared<torch::nn::AnyModule>(std::move(module));
  return append_stage(
      std::move(ptr), [any](const at::Tensor& x) { return any->forward(x); }, device);
}

ModelPipelineImpl& ModelPipelineImpl::append_stage(std::shared_ptr<torch::nn::Module> module,
                                                   detail::StageForward forward,
                                                   const DeviceArg& device) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  const size_t index = size();
  TORCH_CHECK(module != nullptr, "mpipe::ModelPipeline::append: stage ", index,
              " is a null module");
  for (size_t i = 0; i < index; ++i) {
    TORCH_CHECK(stages_->ptr(i) != module, "mpipe::ModelPipeline::append: stage ", index,
                " is the same module object as stage ", i,
                "; a module can be one stage only (two stages would share its state)");
  }
  c10::Device resolved = c10::kCPU;
  try {
    resolved = resolve_device(device);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "mpipe::ModelPipeline::append: stage ", index, ": ",
                e.what_without_backtrace());
  }
  module->to(resolved);
  runtime_->add_stage(resolved);
  drop_graphs();
  stateful_.push_back(detail::find_stateful(module));
  stages_->push_back(std::move(module));
  forwards_.push_back(std::move(forward));
  devices_.push_back(resolved);
  return *this;
}

void ModelPipelineImpl::check_runnable(const char* method, const at::Tensor& x,
                                       bool time_major) const {
  TORCH_CHECK(!is_empty(), "mpipe::ModelPipeline::", method,
              ": the pipeline has no stages; add them with append(module, device)");
  TORCH_CHECK(x.defined(), "mpipe::ModelPipeline::", method, ": the input is an undefined tensor");
  if (time_major) {
    TORCH_CHECK(x.dim() >= 2, "mpipe::ModelPipeline::", method,
                ": x_seq must be [T, N, ...] (time, then batch), got shape ", x.sizes());
    TORCH_CHECK(x.size(0) > 0, "mpipe::ModelPipeline::", method,
                ": the sequence has no time steps (T = 0), shape ", x.sizes());
  }
  const int64_t batch_dim = time_major ? 1 : 0;
  TORCH_CHECK(x.dim() > batch_dim, "mpipe::ModelPipeline::", method,
              ": the input needs a batch dimension (dim 0), got a 0-dim tensor");
  TORCH_CHECK(x.size(batch_dim) > 0, "mpipe::ModelPipeline::", method,
              ": the input's batch is empty (size 0 along dim ", batch_dim, "), shape ",
              x.sizes());
}

namespace {

/// The last stage's kept outputs as one tensor (see Job::stack_outputs).
at::Tensor gather_items(const detail::Job& job, size_t n_stages) {
  if (job.reduce_sum) return job.outputs[0];
  if (job.stack_outputs) return at::stack(job.outputs, 0);
  for (size_t i = 0; i < job.outputs.size(); ++i) {
    TORCH_CHECK(job.outputs[i].dim() >= 1, "mpipe::ModelPipeline::", job.method, ": stage ",
                n_stages - 1, " returned a 0-dim tensor at ", job.item_name, " ", i,
                "; outputs are concatenated along dim 0, so each needs one",
                job.micro_batched ? "" : " (or use reduce = true)");
  }
  if (job.outputs.size() == 1) return job.outputs[0];
  return at::cat(job.outputs, 0);
}

/// loss_fn(out, target), its errors marked as the loss function's (and as
/// `method`'s, when the runtime does not name the call itself).
at::Tensor call_loss(const LossFunction& loss_fn, const at::Tensor& out, const at::Tensor& target,
                     const char* method = nullptr) {
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

}  // namespace

at::Tensor ModelPipelineImpl::forward(const at::Tensor& x, int64_t split_size) {
  check_runnable("forward", x);
  TORCH_CHECK(split_size > 0, "mpipe::ModelPipeline::forward: split_size must be positive, got ",
              split_size);
  return run_call("forward", split_size, 0, x,
                  [&](const at::Tensor& in, bool threaded) {
                    const std::vector<at::Tensor> chunks = in.split(split_size, 0);
                    detail::Job job;
                    job.method = "forward";
                    job.item_name = "micro-batch";
                    job.n_items = static_cast<int64_t>(chunks.size());
                    job.micro_batched = true;
                    job.source = [&chunks](int64_t i) { return chunks[static_cast<size_t>(i)]; };
                    execute_job(job, threaded, in);
                    return gather_items(job, size());
                  });
}

at::Tensor ModelPipelineImpl::constant_forward(const at::Tensor& x, int64_t T, bool reduce) {
  check_runnable("constant_forward", x);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::constant_forward: T (the number of time steps) "
              "must be positive, got ", T);
  return run_call("constant_forward", T, reduce, x,
                  [&](const at::Tensor& in, bool threaded) {
                    return run_constant("constant_forward", in, T, reduce, threaded);
                  });
}

at::Tensor ModelPipelineImpl::sequence_forward(const at::Tensor& x_seq, bool reduce) {
  check_runnable("sequence_forward", x_seq, /*time_major=*/true);
  return run_call("sequence_forward", reduce, 0, x_seq,
                  [&](const at::Tensor& in, bool threaded) {
                    detail::Job job;
                    job.method = "sequence_forward";
                    job.item_name = "time step";
                    job.n_items = in.size(0);
                    job.reduce_sum = reduce;
                    job.stack_outputs = true;
                    job.source = [&in](int64_t t) { return in.select(0, t); };
                    execute_job(job, threaded, in);
                    return gather_items(job, size());
                  });
}

bool ModelPipelineImpl::graphable(const at::Tensor& x) const {
  if (!options.cuda_graphs() || !graphs_ || c10::GradMode::is_enabled() || !x.is_cuda() ||
      options.record_timeline()) {
    return false;  // a replay has no tasks to record (Note [Timeline])
  }
  for (const auto& d : devices_) {
    if (d != x.device()) return false;  // one device per graph (at::cuda::CUDAGraph)
  }
  for (const auto& stage : stateful_) {
    for (const auto& m : stage) {
      if (m.state->holds_state()) return false;
    }
  }
  return true;
}

at::Tensor ModelPipelineImpl::run_call(
    const char* method, int64_t arg0, int64_t arg1, const at::Tensor& x,
    const std::function<at::Tensor(const at::Tensor&, bool)>& eager) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  begin_memory_watch();
  struct EndWatch {
    ModelPipelineImpl& p;
    const char* method;
    ~EndWatch() { p.end_memory_watch(method); }
  } end_watch{*this, method};
  detail::RollbackOnFailure rollback(stateful_);  // Note [State snapshots]
  if (graphable(x)) {
    const std::string key = c10::str(method, "|", arg0, "|", arg1, "|", x.sizes(), "|",
                                     x.scalar_type(), is_training() ? "|train" : "|eval");
    detail::PlainDraws plain;  // a replay draws what its capture drew (Note [Random draws])
    at::Tensor out = detail::run_graphed(
        *graphs_, key, x, [&](const at::Tensor& in) { return eager(in, /*threaded=*/false); },
        [this] { reset_states(*this); });
    if (out.defined()) {
      reset_states(*this);  // Note [CUDA graphs]: state does not outlive a graphed call
      return out;
    }
  }
  return eager(x, options.worker_threads());
}

void ModelPipelineImpl::clear_cuda_graphs() {
  std::lock_guard<std::mutex> lock(call_mutex_);
  drop_graphs();
}

void ModelPipelineImpl::drop_graphs() {
  if (graphs_) graphs_ = detail::make_graph_cache();
}

void ModelPipelineImpl::check_checkpointable(const char* method) const {
  for (size_t j = 0; j < stateful_.size(); ++j) {
    for (const auto& m : stateful_[j]) {
      TORCH_CHECK(m.state->supports_state_snapshots(), "mpipe::ModelPipeline::", method,
                  ": stage ", j, " holds a stateful module without state snapshots: ", m.name,
                  ". Checkpointing runs a stage again in backward and must start that module "
                  "from the state its forward saw; implement supports_state_snapshots(), "
                  "save_state() and load_state() (Note [State snapshots] in mpipe/state.h), "
                  "or use Checkpoint::Never");
    }
  }
}

size_t ModelPipelineImpl::cuda_graphs_captured() const {
  return graphs_ ? detail::graphs_held(*graphs_) : 0;
}

bool ModelPipelineImpl::step_graphable(const at::Tensor& x, const at::Tensor& target) const {
  if (x.requires_grad() || (is_training() && options.checkpoint() != Checkpoint::Never)) {
    return false;  // input gradients leave the graph; recompute restores RNG state
  }
  if (target.defined() && target.device() != x.device()) return false;
  // graphable()'s rules apart from grad mode (it also refuses while a timeline
  // is recorded).
  c10::NoGradGuard no_grad;
  return graphable(x);
}

at::Tensor ModelPipelineImpl::run_step(
    const std::string& key, const at::Tensor& x, const at::Tensor& target,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>& eager) {
  if (!key.empty() && step_graphable(x, target)) {
    detail::PlainDraws plain;  // a replay draws what its capture drew (Note [Random draws])
    at::Tensor loss = detail::run_graphed_step(
        *graphs_, key, {x, target}, parameters(),
        [&](const std::vector<at::Tensor>& in) { return eager(in[0], in[1], /*threaded=*/false); },
        [this] { reset_states(*this); });
    if (loss.defined()) {
      reset_states(*this);  // Note [CUDA graphs]: state does not outlive a graphed call
      return loss;
    }
  }
  return eager(x, target, options.worker_threads());
}

at::Tensor ModelPipelineImpl::train_step(const at::Tensor& input, const at::Tensor& target,
                                         const LossFunction& loss_fn,
                                         const TrainStepOptions& step) {
  check_runnable("train_step", input);
  TORCH_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == input.size(0),
              "mpipe::ModelPipeline::train_step: the target needs the input's batch size (",
              input.size(0), ") along dim 0, got ",
              target.defined() ? "shape " + c10::str(target.sizes()) : std::string("undefined"));
  TORCH_CHECK(static_cast<bool>(loss_fn), "mpipe::ModelPipeline::train_step: loss_fn is empty");
  TORCH_CHECK(step.split_size() > 0,
              "mpipe::ModelPipeline::train_step: split_size must be positive, got ",
              step.split_size());
  TORCH_CHECK(c10::GradMode::is_enabled() && !c10::InferenceMode::is_enabled(),
              "mpipe::ModelPipeline::train_step: gradients are off (NoGradGuard or "
              "InferenceMode is active); a training step needs them");
  const int64_t batch = input.size(0), rows = step.split_size();
  const bool mean = step.reduction() == LossReduction::Mean;
  std::vector<std::vector<at::Tensor>> params;
  for (size_t j = 0; j < size(); ++j) params.push_back(stages_->ptr(j)->parameters());
  auto eager = [&](const at::Tensor& x, const at::Tensor& y, bool threaded) {
    detail::TrainJob job;
    job.n_items = (batch - 1) / rows + 1;  // not (batch + rows - 1) / rows: rows may be huge
    job.input = [&](int64_t i) { return x.narrow(0, i * rows, std::min(rows, batch - i * rows)); };
    job.target = [&](int64_t i) { return y.narrow(0, i * rows, std::min(rows, batch - i * rows)); };
    job.loss = [&](int64_t i, const at::Tensor& out, const at::Tensor& tgt) {
      at::Tensor loss = call_loss(loss_fn, out, tgt);
      TORCH_CHECK(loss.defined() && loss.numel() == 1,
                  "the loss function must return one value, got ",
                  loss.defined() ? "shape " + c10::str(loss.sizes()) : std::string("undefined"));
      loss = loss.reshape({});
      if (mean) loss = loss * (static_cast<double>(std::min(rows, batch - i * rows)) / batch);
      return loss;
    };
    job.programs = programs_for(step.schedule(), job.n_items, static_cast<int64_t>(size()));
    job.checkpoint = is_training() ? options.checkpoint() : Checkpoint::Never;
    job.stateful = &stateful_;
    job.input_requires_grad = input.requires_grad();
    auto recorder = start_recording(
        "train_step", "micro-batch", job.n_items,
        options.record_timeline() ? schedule::bubble(job.programs) : 0.0);
    job.recorder = recorder.get();
    runtime_->train(job, forwards_, threaded, x, y, params);
    if (recorder) pending_timeline_ = recorder;
    if (job.input_requires_grad) {
      torch::autograd::backward({input}, {at::cat(job.input_grads, 0).to(input.device())});
    }
    return job.loss_sum;
  };
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (is_training() && options.checkpoint() != Checkpoint::Never) {
    check_checkpointable("train_step");
  }
  begin_memory_watch();
  struct EndWatch {
    ModelPipelineImpl& p;
    ~EndWatch() { p.end_memory_watch("train_step"); }
  } end_watch{*this};
  detail::RollbackOnFailure rollback(stateful_);  // Note [State snapshots]
  std::string key;  // empty: not graphed (the input's gradient leaves the graph)
  if (options.cuda_graphs() && !input.requires_grad()) {
    key = c10::str("train_step|", rows, "|", static_cast<int>(step.schedule()), "|",
                   static_cast<int>(step.reduction()), "|", input.sizes(), "|",
                   input.scalar_type(), "|", target.sizes(), "|", target.scalar_type(),
                   is_training() ? "|train" : "|eval");
  }
  return run_step(key, input.detach(), target.detach(), eager);
}

at::Tensor ModelPipelineImpl::constant_train_step(const at::Tensor& x, int64_t T,
                                                  const at::Tensor& target,
                                                  const LossFunction& loss_fn) {
  check_runnable("constant_train_step", x);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::constant_train_step: T (the number of time steps) "
              "must be positive, got ", T);
  TORCH_CHECK(static_cast<bool>(loss_fn),
              "mpipe::ModelPipeline::constant_train_step: loss_fn is empty");
  TORCH_CHECK(c10::GradMode::is_enabled() && !c10::InferenceMode::is_enabled(),
              "mpipe::ModelPipeline::constant_train_step: gradients are off (NoGradGuard or "
              "InferenceMode is active); a training step needs them");
  auto eager = [&](const at::Tensor& in, const at::Tensor& tgt, bool threaded) {
    detail::BackwardPositions positions(in);  // Note [Backward positions]
    const at::Tensor out =
        run_constant("constant_train_step", in, T, /*reduce=*/true, threaded, &positions);
    struct JoinOnError {  // the caller's streams wait for the stage streams, also after an error
      detail::Runtime& runtime;
      bool done = false;
      ~JoinOnError() {
        if (done) return;
        try {
          runtime.join();
        } catch (...) {  // the first error is the one to report
        }
      }
    } join_on_error{*runtime_};
    at::Tensor loss;
    {
      // The loss and the backward call run on the last stage's stream, as in
      // train_step; the caller's stream waits for them below.
      c10::OptionalStreamGuard last_stage(runtime_->compute_stream(size() - 1));
      loss = call_loss(loss_fn, out, tgt, "constant_train_step");
      TORCH_CHECK(loss.defined() && loss.numel() == 1,
                  "mpipe::ModelPipeline::constant_train_step: the loss function must return one "
                  "value, got ",
                  loss.defined() ? "shape " + c10::str(loss.sizes()) : std::string("undefined"));
      loss = loss.reshape({});
      std::string failure;
      try {
        torch::autograd::backward({loss});
      } catch (const c10::Error& e) {
        failure = e.what_without_backtrace();
      } catch (const std::exception& e) {
        failure = e.what();
      }
      if (!failure.empty()) {
        const auto position = positions.last();
        TORCH_CHECK(position.first < 0, "mpipe::ModelPipeline::constant_train_step: stage ",
                    position.first, " (on ", devices_[static_cast<size_t>(position.first)],
                    ") failed at backward of time step ", position.second, " of ", T, ": ",
                    failure);
        TORCH_CHECK(false, "mpipe::ModelPipeline::constant_train_step: the backward pass failed "
                    "before reaching a stage (in the loss's backward): ", failure);
      }
    }
    join_on_error.done = true;
    runtime_->join();  // the caller's streams wait for the stage streams
    if (const auto last = runtime_->compute_stream(size() - 1)) {
      detail::record_on(loss, detail::current_stream(last->device()));  // used there now
    }
    return loss.detach();
  };
  std::lock_guard<std::mutex> lock(call_mutex_);
  begin_memory_watch();
  struct EndWatch {
    ModelPipelineImpl& p;
    ~EndWatch() { p.end_memory_watch("constant_train_step"); }
  } end_watch{*this};
  // Declared before ResetAfter, so a failed step ends with the state of its
  // start, not reset (Note [State snapshots]).
  detail::RollbackOnFailure rollback(stateful_);
  reset_states(*this);
  struct ResetAfter {  // state does not outlive the step, whatever happens
    torch::nn::Module& m;
    ~ResetAfter() { reset_states(m); }
  } reset_after{*this};
  std::string key;
  if (options.cuda_graphs()) {
    key = c10::str("constant_train_step|", T, "|", x.sizes(), "|", x.scalar_type(), "|",
                   target.defined() ? c10::str(target.sizes(), target.scalar_type()) : "-",
                   is_training() ? "|train" : "|eval");
  }
  // x keeps its autograd identity (its gradient is accumulated if it requires
  // one); such a step is never graphed.
  return run_step(key, x, target, eager);
}

at::Tensor ModelPipelineImpl::run_constant(const char* method, const at::Tensor& in, int64_t T,
                                           bool reduce, bool threaded,
                                           detail::BackwardPositions* positions) {
  detail::Job job;
  job.method = method;
  job.item_name = "time step";
  job.n_items = T;
  job.same_input = true;
  job.reduce_sum = reduce;
  job.source = [&in](int64_t) { return in; };
  job.backward_positions = positions;
  execute_job(job, threaded, in);
  return gather_items(job, size());
}

void ModelPipelineImpl::execute_job(detail::Job& job, bool threaded, const at::Tensor& input) {
  auto recorder = start_recording(
      job.method, job.item_name, job.n_items,
      schedule::fill_drain_bubble(job.n_items, static_cast<int64_t>(size())));
  job.recorder = recorder.get();
  runtime_->execute(job, forwards_, threaded, input);
  if (recorder) pending_timeline_ = recorder;
}

std::shared_ptr<detail::Recorder> ModelPipelineImpl::start_recording(
    const char* method, const char* item_name, int64_t n_items, double schedule_bubble) const {
  if (!options.record_timeline()) return nullptr;
  return std::make_shared<detail::Recorder>(method, item_name, n_items, devices_, schedule_bubble);
}

Timeline ModelPipelineImpl::timeline() {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (pending_timeline_) {
    timeline_ = pending_timeline_->finish();
    pending_timeline_.reset();
  }
  return timeline_;
}

void ModelPipelineImpl::begin_memory_watch() {
  if (!options.track_memory()) return;
  memory_counters_.clear();
  for (const auto& d : devices_) {
    bool seen = false;
    for (const auto& c : memory_counters_) seen |= c.device == d;
    if (!d.is_cuda() || seen) continue;
    detail::reset_allocator_peak(d);
    memory_counters_.push_back({d, detail::allocator_counters(d).allocated, -1});
  }
}

void ModelPipelineImpl::end_memory_watch(const char* method) {
  if (!options.track_memory()) return;
  for (auto& c : memory_counters_) c.peak = detail::allocator_counters(c.device).peak;
  memory_call_ = method;
}

MemoryReport ModelPipelineImpl::memory_report() const {
  std::lock_guard<std::mutex> lock(call_mutex_);
  MemoryReport report;
  report.last_call = memory_counters_.empty() ? std::string() : memory_call_;
  auto row = [&](c10::Device d) -> DeviceMemory& {
    for (auto& r : report.devices) {
      if (r.device == d) return r;
    }
    report.devices.emplace_back();
    report.devices.back().device = d;
    return report.devices.back();
  };
  for (size_t j = 0; j < size(); ++j) {
    DeviceMemory& r = row(devices_[j]);
    ++r.stages;
    const auto& m = stages_->ptr(j);
    for (const auto& p : m->parameters()) {
      r.parameter_bytes += static_cast<int64_t>(p.nbytes());
      if (p.grad().defined()) r.gradient_bytes += static_cast<int64_t>(p.grad().nbytes());
    }
    for (const auto& b : m->buffers()) r.buffer_bytes += static_cast<int64_t>(b.nbytes());
  }
  for (auto& r : report.devices) {
    for (const auto& c : memory_counters_) {
      if (c.device != r.device) continue;
      r.allocated_before_bytes = c.before;
      r.peak_allocated_bytes = c.peak;
    }
  }
  return report;
}

std::shared_ptr<torch::nn::Module> ModelPipelineImpl::stage(size_t index) const {
  TORCH_CHECK_INDEX(index < size(), "mpipe::ModelPipeline::stage: index ", index,
                    " is out of range for a pipeline of ", size(), " stage(s)");
  return stages_->ptr(index);
}

c10::Device ModelPipelineImpl::device(size_t index) const {
  TORCH_CHECK_INDEX(index < size(), "mpipe::ModelPipeline::device: index ", index,
                    " is out of range for a pipeline of ", size(), " stage(s)");
  return devices_[index];
}

c10::Device ModelPipelineImpl::output_device() const {
  TORCH_CHECK(!is_empty(), "mpipe::ModelPipeline::output_device: the pipeline has no stages");
  return devices_.back();
}

void ModelPipelineImpl::check_placement_kept(c10::Device device, const char* what) const {
  for (size_t i = 0; i < size(); ++i) {
    const bool same = devices_[i].type() == device.type() &&
                      (!device.has_index() || devices_[i].index() == device.index());
    TORCH_CHECK(same, "mpipe::ModelPipeline::", what, "(", device,
                "): this would move every stage to one device and undo the pipeline's "
                "placement (stage ", i, " is on ", devices_[i],
                "). Cast dtypes with to(dtype), which keeps each stage on its device, or "
                "append the stages to a new pipeline on the devices you want");
  }
}

void ModelPipelineImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  check_placement_kept(device, "to");
  to(dtype, non_blocking);
}

void ModelPipelineImpl::to(torch::Dtype dtype, bool non_blocking) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  torch::nn::Module::to(dtype, non_blocking);
  drop_graphs();  // parameters have new storage
}

void ModelPipelineImpl::to(torch::Device device, bool /*non_blocking*/) {
  check_placement_kept(device, "to");
}

void ModelPipelineImpl::load(torch::serialize::InputArchive& archive) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  torch::nn::Module::load(archive);
  for (size_t i = 0; i < size(); ++i) stages_->ptr(i)->to(devices_[i]);
  drop_graphs();  // loaded parameters may have new storage
}

void ModelPipelineImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::ModelPipeline(devices=[";
  for (size_t i = 0; i < size(); ++i) stream << (i ? ", " : "") << devices_[i];
  stream << "])";
}

}  // namespace mpipe
