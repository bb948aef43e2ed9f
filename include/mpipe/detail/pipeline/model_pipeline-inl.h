#pragma once

#include "mpipe/detail/config.h"

// The pipeline apart from its calls: building it, its devices, moves, loads
// and reports. The calls are in micro_batch_calls-inl.h and
// time_step_calls-inl.h (pipeline/session.h says where everything is).

#include "mpipe/detail/pipeline/session.h"

#include "mpipe/detail/cuda/device_probe.h"

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
    : options(options_), parts_(std::make_unique<detail::PipelineParts>(*this)) {}

MPIPE_FUNC ModelPipelineImpl::~ModelPipelineImpl() = default;

MPIPE_FUNC size_t ModelPipelineImpl::size() const noexcept { return parts_->stages.size(); }

MPIPE_FUNC const std::vector<c10::Device>& ModelPipelineImpl::devices() const noexcept {
  return parts_->stages.devices;
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
  detail::PipelineParts& s = *parts_;
  std::lock_guard<std::mutex> lock(s.life.mutex());
  const size_t index = size();
  TORCH_CHECK(module != nullptr, "mpipe::ModelPipeline::append: stage ", index,
              " is a null module");
  for (size_t i = 0; i < index; ++i) {
    TORCH_CHECK(s.stages.modules->ptr(i) != module, "mpipe::ModelPipeline::append: stage ", index,
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
  s.graphs.drop();
  detail::Stages& stages = s.stages;
  stages.stateful.push_back(detail::find_stateful(module));
  stages.modules->push_back(std::move(module));
  stages.forwards.push_back(std::move(forward));
  stages.devices.push_back(resolved);
  return *this;
}

MPIPE_FUNC void ModelPipelineImpl::clear_cuda_graphs() {
  std::lock_guard<std::mutex> lock(parts_->life.mutex());
  parts_->graphs.drop();
}

MPIPE_FUNC size_t ModelPipelineImpl::cuda_graphs_captured() const {
  return parts_->graphs.held();
}

MPIPE_FUNC Timeline ModelPipelineImpl::timeline() {
  std::lock_guard<std::mutex> lock(parts_->life.mutex());
  return parts_->timeline.get();
}

MPIPE_FUNC MemoryReport ModelPipelineImpl::memory_report() const {
  const detail::PipelineParts& s = *parts_;
  std::lock_guard<std::mutex> lock(s.life.mutex());
  MemoryReport report;
  report.last_call = s.life.counters().empty() ? std::string() : s.life.watched_call();
  auto row = [&](c10::Device d) -> MemoryReport::DeviceRow& {
    for (auto& r : report.devices) {
      if (r.device == d) return r;
    }
    report.devices.emplace_back();
    report.devices.back().device = d;
    return report.devices.back();
  };
  for (size_t j = 0; j < size(); ++j) {
    MemoryReport::DeviceRow& r = row(s.stages.devices[j]);
    ++r.stages;
    const auto& m = s.stages.modules->ptr(j);
    for (const auto& p : m->parameters()) {
      r.parameter_bytes += static_cast<int64_t>(p.nbytes());
      if (p.grad().defined()) r.gradient_bytes += static_cast<int64_t>(p.grad().nbytes());
    }
    for (const auto& b : m->buffers()) r.buffer_bytes += static_cast<int64_t>(b.nbytes());
  }
  for (auto& r : report.devices) {
    for (const auto& c : s.life.counters()) {
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
  return parts_->stages.modules->ptr(index);
}

MPIPE_FUNC c10::Device ModelPipelineImpl::device(size_t index) const {
  TORCH_CHECK_INDEX(index < size(), "mpipe::ModelPipeline::device: index ", index,
                    " is out of range for a pipeline of ", size(), " stage(s)");
  return parts_->stages.devices[index];
}

MPIPE_FUNC c10::Device ModelPipelineImpl::output_device() const {
  TORCH_CHECK(!is_empty(), "mpipe::ModelPipeline::output_device: the pipeline has no stages");
  return parts_->stages.devices.back();
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
  detail::check_placement_kept(parts_->stages.devices, device, "to");
  to(dtype, non_blocking);
}

MPIPE_FUNC void ModelPipelineImpl::to(torch::Dtype dtype, bool non_blocking) {
  std::lock_guard<std::mutex> lock(parts_->life.mutex());
  torch::nn::Module::to(dtype, non_blocking);
  parts_->graphs.drop();  // parameters have new storage
}

MPIPE_FUNC void ModelPipelineImpl::to(torch::Device device, bool /*non_blocking*/) {
  detail::check_placement_kept(parts_->stages.devices, device, "to");
}

MPIPE_FUNC void ModelPipelineImpl::load(torch::serialize::InputArchive& archive) {
  detail::PipelineParts& s = *parts_;
  std::lock_guard<std::mutex> lock(s.life.mutex());
  torch::nn::Module::load(archive);
  for (size_t i = 0; i < size(); ++i) s.stages.modules->ptr(i)->to(s.stages.devices[i]);
  s.graphs.drop();  // loaded parameters may have new storage
}

MPIPE_FUNC void ModelPipelineImpl::pretty_print(std::ostream& stream) const {
  stream << "mpipe::ModelPipeline(devices=[";
  for (size_t i = 0; i < size(); ++i) stream << (i ? ", " : "") << parts_->stages.devices[i];
  stream << "])";
}

}  // namespace mpipe
