#pragma once

#include "mpipe/detail/config.h"

// The facade: building a pipeline, its devices, moves, loads and reports. The
// calls themselves are in calls-inl.h and train_steps-inl.h (mpipe/detail/pipeline/pipeline_state.h
// says where everything is).

#include "mpipe/detail/pipeline/pipeline_state.h"
#include "mpipe/detail/runtime/scatter.h"
#include "mpipe/detail/runtime/time_chunks.h"

#include "mpipe/detail/cuda/device_probe.h"

#include "mpipe/linear.h"
#include "mpipe/state.h"

#include <c10/util/Exception.h>

#include <ostream>
#include <string>

namespace mpipe {

namespace detail {
MPIPE_FUNC void check_input_count(size_t got, size_t wanted) {
  TORCH_CHECK(got == wanted, "the stage's forward takes ", wanted, " tensor(s), but it was given ",
              got, " (the previous stage's outputs, or the call's inputs)");
}
}  // namespace detail

MPIPE_FUNC ModelPipelineImpl::ModelPipelineImpl(ModelPipelineOptions options_)
    : options(options_), state_(std::make_unique<State>(*this)) {}

MPIPE_FUNC ModelPipelineImpl::~ModelPipelineImpl() = default;

MPIPE_FUNC size_t ModelPipelineImpl::size() const noexcept { return state_->devices.size(); }

MPIPE_FUNC const std::vector<c10::Device>& ModelPipelineImpl::devices() const noexcept {
  return state_->devices;
}

MPIPE_FUNC ModelPipelineImpl& ModelPipelineImpl::append(torch::nn::AnyModule module,
                                                        const DeviceArg& device) {
  TORCH_CHECK(!module.is_empty(), "mpipe::ModelPipeline::append: stage ", size(),
              " is an empty AnyModule");
  std::shared_ptr<torch::nn::Module> ptr = module.ptr();
  auto any = std::make_shared<torch::nn::AnyModule>(std::move(module));
  return append_stage(
      std::move(ptr),
      [any](const Tensors& in) {
        detail::check_input_count(in.size(), 1);
        return Tensors{any->forward(in[0])};
      },
      device);
}

MPIPE_FUNC ModelPipelineImpl& ModelPipelineImpl::append_stage(
    std::shared_ptr<torch::nn::Module> module, detail::StageForward forward,
    const DeviceArg& device) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.call_mutex);
  const size_t index = size();
  TORCH_CHECK(module != nullptr, "mpipe::ModelPipeline::append: stage ", index,
              " is a null module");
  for (size_t i = 0; i < index; ++i) {
    TORCH_CHECK(s.stages->ptr(i) != module, "mpipe::ModelPipeline::append: stage ", index,
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
  s.executor.add_stage(resolved);
  s.drop_graphs();
  s.stateful.push_back(detail::find_stateful(module));
  for (const auto& m : module->modules()) {
    s.cast_linears |= dynamic_cast<const LinearImpl*>(m.get()) != nullptr;
  }
  s.stages->push_back(std::move(module));
  s.forwards.push_back(std::move(forward));
  s.devices.push_back(resolved);
  return *this;
}

namespace detail {

MPIPE_FUNC void check_runnable(const ModelPipelineImpl& p, const char* method) {
  // Across processes the first rank checks its inputs inside the call, and
  // a rank without stages is named to every rank at the first call, so that
  // every rank hears of it (Note [Cross-process calls]).
  if (p.options.process_group().defined()) return;
  TORCH_CHECK(!p.is_empty(), "mpipe::ModelPipeline::", method,
              ": the pipeline has no stages; add them with append(module, device)");
}

MPIPE_FUNC void check_runnable(const ModelPipelineImpl& p, const char* method, const at::Tensor& x,
                               bool time_major = false) {
  check_runnable(p, method);
  if (p.options.process_group().defined()) return;  // as above
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

/// The call's time chunk: 0 for single-step stages, detail::kAutoChunk for
/// the pipeline's choice, else k >= 1 (Note [Time chunks]).
MPIPE_FUNC int64_t chunk_of(const ModelPipelineImpl& p, const char* method,
                            std::optional<int64_t> arg) {
  if (arg) {
    TORCH_CHECK(*arg >= 1, "mpipe::ModelPipeline::", method, ": time_chunk (time steps per "
                "stage call) must be >= 1, got ", *arg);
    return *arg;
  }
  if (p.options.step_mode() == snn::StepMode::Single) return 0;
  TORCH_CHECK(p.options.time_chunk() >= 0, "mpipe::ModelPipeline::", method,
              ": ModelPipelineOptions::time_chunk (time steps per stage call) must be >= 1, or 0 "
              "for the pipeline's choice, got ", p.options.time_chunk());
  return p.options.time_chunk() == 0 ? detail::kAutoChunk : p.options.time_chunk();
}

/// A time-step call's micro-batch split: the call's, else the options'
/// count, else empty for the pipeline's choice (Note [Micro-batches over time]).
/// `batched`: whether the call has a batched input; the options' count
/// leaves a call without one whole (a split given to the call is refused).
MPIPE_FUNC std::optional<Split> split_of(const ModelPipelineImpl& p, const char* method,
                                         std::optional<Split> arg, bool batched = true) {
  if (arg) {
    detail::split_rows(*arg, method, 1);  // refuses a value below 1, naming it
    return arg;
  }
  TORCH_CHECK(p.options.time_micro_batches() >= 0, "mpipe::ModelPipeline::", method,
              ": ModelPipelineOptions::time_micro_batches must be >= 1, or 0 for the "
              "pipeline's choice, got ", p.options.time_micro_batches());
  if (p.options.time_micro_batches() == 0 || !batched) return std::nullopt;
  return Split::chunks(p.options.time_micro_batches());
}

MPIPE_FUNC bool any_batched(const std::vector<Input>& inputs) {
  for (const auto& in : inputs) {
    if (in.batched) return true;
  }
  return false;
}

}  // namespace detail

MPIPE_FUNC at::Tensor ModelPipelineImpl::forward(const at::Tensor& x, Split split) {
  detail::check_runnable(*this, "forward", x);
  return detail::one_output("forward",
                                   state_->forward({x}, split, /*graphable_call=*/true));
}

MPIPE_FUNC Tensors ModelPipelineImpl::forward(const std::vector<Input>& inputs,
                                              Split split) {
  detail::check_runnable(*this, "forward");
  return state_->forward(inputs, split, /*graphable_call=*/false);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_forward(const at::Tensor& x, int64_t T,
                                                          bool reduce,
                                                          std::optional<int64_t> time_chunk,
    std::optional<Split> split) {
  detail::check_runnable(*this, "constant_forward", x);
  const int64_t chunk = detail::chunk_of(*this, "constant_forward", time_chunk);
  const auto micro_batches = detail::split_of(*this, "constant_forward", split);
  return detail::one_output("constant_forward",
                                   state_->constant_forward({x}, T, reduce, chunk, micro_batches, true));
}

MPIPE_FUNC Tensors ModelPipelineImpl::constant_forward(const std::vector<Input>& inputs, int64_t T,
                                                       bool reduce,
                                                       std::optional<int64_t> time_chunk,
    std::optional<Split> split) {
  detail::check_runnable(*this, "constant_forward");
  const int64_t chunk = detail::chunk_of(*this, "constant_forward", time_chunk);
  const auto micro_batches =
      detail::split_of(*this, "constant_forward", split, detail::any_batched(inputs));
  return state_->constant_forward(inputs, T, reduce, chunk, micro_batches, false);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::sequence_forward(const at::Tensor& x_seq, bool reduce,
                                                          std::optional<int64_t> time_chunk,
    std::optional<Split> split) {
  detail::check_runnable(*this, "sequence_forward", x_seq, /*time_major=*/true);
  const int64_t chunk = detail::chunk_of(*this, "sequence_forward", time_chunk);
  const auto micro_batches = detail::split_of(*this, "sequence_forward", split);
  return detail::one_output("sequence_forward",
                                   state_->sequence_forward({x_seq}, reduce, chunk, micro_batches, true));
}

MPIPE_FUNC Tensors ModelPipelineImpl::sequence_forward(const std::vector<Input>& inputs,
                                                       bool reduce,
                                                       std::optional<int64_t> time_chunk,
    std::optional<Split> split) {
  detail::check_runnable(*this, "sequence_forward");
  const int64_t chunk = detail::chunk_of(*this, "sequence_forward", time_chunk);
  const auto micro_batches =
      detail::split_of(*this, "sequence_forward", split, detail::any_batched(inputs));
  return state_->sequence_forward(inputs, reduce, chunk, micro_batches, false);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::train_step(const at::Tensor& input,
                                                    const at::Tensor& target,
                                                    const LossFunction& loss_fn,
                                                    const TrainStepOptions& step) {
  detail::check_runnable(*this, "train_step", input);
  return state_->train_step({input}, target, loss_fn, step, true);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::train_step(const std::vector<Input>& inputs,
                                                    const at::Tensor& target,
                                                    const LossFunction& loss_fn,
                                                    const TrainStepOptions& step) {
  detail::check_runnable(*this, "train_step");
  return state_->train_step(inputs, target, loss_fn, step, false);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_train_step(const at::Tensor& x, int64_t T,
                                                             const at::Tensor& target,
                                                             const LossFunction& loss_fn,
                                                             std::optional<int64_t> time_chunk,
    std::optional<Split> split) {
  detail::check_runnable(*this, "constant_train_step", x);
  const int64_t chunk = detail::chunk_of(*this, "constant_train_step", time_chunk);
  const auto micro_batches = detail::split_of(*this, "constant_train_step", split);
  return state_->constant_train_step({x}, T, target, loss_fn, chunk, micro_batches, true);
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::constant_train_step(const std::vector<Input>& inputs,
                                                             int64_t T, const at::Tensor& target,
                                                             const LossFunction& loss_fn,
                                                             std::optional<int64_t> time_chunk,
    std::optional<Split> split) {
  detail::check_runnable(*this, "constant_train_step");
  const int64_t chunk = detail::chunk_of(*this, "constant_train_step", time_chunk);
  const auto micro_batches =
      detail::split_of(*this, "constant_train_step", split, detail::any_batched(inputs));
  return state_->constant_train_step(inputs, T, target, loss_fn, chunk, micro_batches, false);
}

MPIPE_FUNC void ModelPipelineImpl::clear_cuda_graphs() {
  std::lock_guard<std::mutex> lock(state_->call_mutex);
  state_->drop_graphs();
}

MPIPE_FUNC size_t ModelPipelineImpl::cuda_graphs_captured() const {
  return state_->graphs ? detail::graphs_held(*state_->graphs) : 0;
}

MPIPE_FUNC Timeline ModelPipelineImpl::timeline() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.call_mutex);
  if (s.pending_timeline) {
    s.timeline = s.pending_timeline->finish();
    s.pending_timeline.reset();
  }
  return s.timeline;
}

MPIPE_FUNC MemoryReport ModelPipelineImpl::memory_report() const {
  const State& s = *state_;
  std::lock_guard<std::mutex> lock(s.call_mutex);
  MemoryReport report;
  report.last_call = s.memory_counters.empty() ? std::string() : s.memory_call;
  auto row = [&](c10::Device d) -> MemoryReport::DeviceRow& {
    for (auto& r : report.devices) {
      if (r.device == d) return r;
    }
    report.devices.emplace_back();
    report.devices.back().device = d;
    return report.devices.back();
  };
  for (size_t j = 0; j < size(); ++j) {
    MemoryReport::DeviceRow& r = row(s.devices[j]);
    ++r.stages;
    const auto& m = s.stages->ptr(j);
    for (const auto& p : m->parameters()) {
      r.parameter_bytes += static_cast<int64_t>(p.nbytes());
      if (p.grad().defined()) r.gradient_bytes += static_cast<int64_t>(p.grad().nbytes());
    }
    for (const auto& b : m->buffers()) r.buffer_bytes += static_cast<int64_t>(b.nbytes());
  }
  for (auto& r : report.devices) {
    for (const auto& c : s.memory_counters) {
      if (c.device != r.device) continue;
      r.allocated_before_bytes = c.before;
      r.peak_allocated_bytes = c.peak;
    }
  }
  return report;
}

MPIPE_FUNC std::shared_ptr<torch::nn::Module> ModelPipelineImpl::stage(size_t index) const {
  TORCH_CHECK_INDEX(index < size(), "mpipe::ModelPipeline::stage: index ", index,
                    " is out of range for a pipeline of ", size(), " stage(s)");
  return state_->stages->ptr(index);
}

MPIPE_FUNC c10::Device ModelPipelineImpl::device(size_t index) const {
  TORCH_CHECK_INDEX(index < size(), "mpipe::ModelPipeline::device: index ", index,
                    " is out of range for a pipeline of ", size(), " stage(s)");
  return state_->devices[index];
}

MPIPE_FUNC c10::Device ModelPipelineImpl::output_device() const {
  TORCH_CHECK(!is_empty(), "mpipe::ModelPipeline::output_device: the pipeline has no stages");
  return state_->devices.back();
}

// Note [Moving a pipeline]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A pipeline's placement is its point: each stage sits on the device it was
// appended to, and every call follows that map. Module::to(device) would
// move every stage onto one device and silently undo it, so to(device) and
// to(device, dtype) are refused unless every stage is already there (then
// nothing moves), with a message that says what to do instead. to(dtype)
// casts each stage where it is. Every cast drops the cached CUDA graphs, whose
// captured addresses the new parameter storage no longer matches; so does
// load(), which puts each stage back on its device.
namespace detail {
MPIPE_FUNC void check_placement_kept(const std::vector<c10::Device>& devices, c10::Device device,
                                     const char* what) {
  for (size_t i = 0; i < devices.size(); ++i) {
    const bool same = devices[i].type() == device.type() &&
                      (!device.has_index() || devices[i].index() == device.index());
    TORCH_CHECK(same, "mpipe::ModelPipeline::", what, "(", device,
                "): this would move every stage to one device and undo the pipeline's "
                "placement (stage ", i, " is on ", devices[i],
                "). Cast dtypes with to(dtype), which keeps each stage on its device, or "
                "append the stages to a new pipeline on the devices you want");
  }
}
}  // namespace detail

MPIPE_FUNC void ModelPipelineImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  detail::check_placement_kept(state_->devices, device, "to");
  to(dtype, non_blocking);
}

MPIPE_FUNC void ModelPipelineImpl::to(torch::Dtype dtype, bool non_blocking) {
  std::lock_guard<std::mutex> lock(state_->call_mutex);
  torch::nn::Module::to(dtype, non_blocking);
  state_->drop_graphs();  // parameters have new storage
}

MPIPE_FUNC void ModelPipelineImpl::to(torch::Device device, bool /*non_blocking*/) {
  detail::check_placement_kept(state_->devices, device, "to");
}

MPIPE_FUNC void ModelPipelineImpl::load(torch::serialize::InputArchive& archive) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.call_mutex);
  torch::nn::Module::load(archive);
  for (size_t i = 0; i < size(); ++i) s.stages->ptr(i)->to(s.devices[i]);
  s.drop_graphs();  // loaded parameters may have new storage
}

MPIPE_FUNC void ModelPipelineImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::ModelPipeline(devices=[";
  for (size_t i = 0; i < size(); ++i) stream << (i ? ", " : "") << state_->devices[i];
  stream << "])";
}

}  // namespace mpipe
