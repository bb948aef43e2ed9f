#pragma once

#include "mpipe/detail/config.h"

#include "mpipe/detail/pipeline/script.h"

#include <mpipe/model_pipeline.h>
#include <mpipe/script.h>

#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/version.h>

#include <filesystem>
#include <memory>
#include <type_traits>

// AOTInductor's package loader: LibTorch 2.x (not mobile builds, not 1.13).
#if defined(__has_include) && !defined(C10_MOBILE) && !defined(ANDROID)
#if __has_include(<torch/csrc/inductor/aoti_package/model_package_loader.h>)
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#define MPIPE_HAS_AOTI 1
#endif
#endif
#ifndef MPIPE_HAS_AOTI
#define MPIPE_HAS_AOTI 0
#endif

namespace mpipe {
namespace detail {

// Note [TorchScript stages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A TorchScript module (torch::jit::Module: scripted or traced in Python, or
// defined in C++) becomes a stage through an adapter, a torch::nn::Module
// that mirrors it: every submodule of the TorchScript module gets a plain
// torch::nn::Module of the same name, holding the same parameter and buffer
// tensors (not copies). So the pipeline's parameters(), named_parameters(),
// optimizers, clip_grad_norm, torch::save/torch::load and JobCheckpoints see
// them under their Python names ("stages.0.fc.weight"), and to(device) moves
// them in place (set_data), where the TorchScript module reads them too.
// Training mode follows train()/eval(). The adapter's forward calls the
// module's forward method with the stage's inputs and returns its outputs: a
// tensor, or a tuple or list of tensors. Autograd runs through TorchScript's
// graph as through any LibTorch op, so every call kind trains it.
//
// A module with a reset() method is stateful: reset_states() and the
// time-step calls reset it through a Stateful child (ScriptReset). It keeps
// one state, not one per micro-batch, so calls with several micro-batches
// are refused while it is in a pipeline, and it offers no state snapshots
// (checkpointing such a stage is refused, Note [State snapshots]).
//
// A stage runs its module's graph without the graph executor's
// optimisations (GraphOptimizerEnabledGuard(false), on whichever thread runs
// the stage): the ops of the graph, one ATen kernel each, as written. With
// them, the executor profiles the first calls and then rewrites the graph
// (autodiff subgraphs with their own backward formulas, fusion on a GPU), so
// the same module gave other gradients split than whole (tanh's symbolic
// backward against ATen's tanh_backward: 2e-9 apart), and a call could run
// other kernels than the one before it, which a CUDA graph's replay or a
// resumed job must not. So a split module equals the whole module run the
// same way (torch::jit::setGraphExecutorOptimize(false)) bit for bit, and
// every call runs the kernels of the last one.
//
// Limits: tensors a module holds as plain attributes (neither parameters nor
// buffers) are not moved by to(device).

/// Registers `from`'s own parameters and buffers on `into`, and a mirror of
/// each child as `into`'s child of the same name.
MPIPE_FUNC void mirror_script_module(torch::nn::Module& into, const torch::jit::Module& from) {
  for (const auto& p : from.named_parameters(/*recurse=*/false)) {
    into.register_parameter(p.name, p.value, p.value.requires_grad());
  }
  for (const auto& b : from.named_buffers(/*recurse=*/false)) into.register_buffer(b.name, b.value);
  for (const auto& c : from.named_children()) {
    auto child = std::make_shared<torch::nn::Module>(c.name);
    mirror_script_module(*child, c.value);
    into.register_module(c.name, child);
  }
}

MPIPE_FUNC ScriptModuleBase::ScriptModuleBase(torch::jit::Module module)
    : torch::nn::Module("mpipe::ScriptModule"), module_(std::move(module)) {
  type_ = module_.type()->name() ? module_.type()->name()->qualifiedName() : std::string("module");
  const auto forward = module_.find_method("forward");
  TORCH_CHECK(forward.has_value(), "mpipe: the TorchScript module ", type_,
              " has no forward method to run as a stage");
  const auto& arguments = forward->function().getSchema().arguments();
  for (size_t k = 1; k < arguments.size(); ++k) {  // 0 is self
    ++max_inputs_;
    if (!arguments[k].default_value()) ++min_inputs_;
  }
  mirror_script_module(*this, module_);
  resets_ = module_.find_method("reset").has_value();
  if (resets_) register_module("mpipe_reset", std::make_shared<ScriptResetImpl>(module_));
  torch::nn::Module::train(module_.is_training());
}

MPIPE_FUNC void ScriptModuleBase::train(bool on) {
  torch::nn::Module::train(on);
  module_.train(on);
}

MPIPE_FUNC void ScriptModuleBase::pretty_print(std::ostream& stream) const {
  stream << "mpipe::ScriptModule(" << type_ << ")";
}

MPIPE_FUNC Tensors ScriptModuleBase::call(const Tensors& inputs) {
  TORCH_CHECK(inputs.size() >= min_inputs_ && inputs.size() <= max_inputs_,
              "the TorchScript module ", type_, "'s forward takes ",
              min_inputs_ == max_inputs_ ? c10::str(max_inputs_)
                                         : c10::str(min_inputs_, " to ", max_inputs_),
              " input(s), but the stage was given ", inputs.size());
  const MicroBatch mb = current_micro_batch();
  TORCH_CHECK(!resets_ || mb.count == 1, "the TorchScript module ", type_,
              " keeps its state (it has a reset() method) for one micro-batch, but the call "
              "cut its batch into ",
              mb.count, "; call it with one micro-batch");
  std::vector<c10::IValue> args(inputs.begin(), inputs.end());
  torch::jit::GraphOptimizerEnabledGuard as_written(false);  // Note [TorchScript stages]
  const c10::IValue out = module_.forward(std::move(args));
  auto tensor_of = [&](const c10::IValue& v, size_t k) {
    TORCH_CHECK(v.isTensor(), "the TorchScript module ", type_, "'s forward returned a ",
                v.tagKind(), " as output ", k, "; a stage returns tensors");
    return v.toTensor();
  };
  Tensors outputs;
  if (out.isTuple()) {
    const auto& elements = out.toTuple()->elements();
    for (size_t k = 0; k < elements.size(); ++k) outputs.push_back(tensor_of(elements[k], k));
  } else if (out.isList()) {
    const auto list = out.toList();
    for (size_t k = 0; k < list.size(); ++k) outputs.push_back(tensor_of(list.get(k), k));
  } else {
    outputs.push_back(tensor_of(out, 0));
  }
  return outputs;
}

MPIPE_FUNC at::Tensor ScriptLayerImpl::forward(const at::Tensor& input) {
  Tensors out = call({input});
  TORCH_CHECK(out.size() == 1, "the TorchScript layer ", type_name(), " returned ", out.size(),
              " tensors; a layer of a Sequential returns one");
  return out[0];
}

MPIPE_FUNC void ScriptResetImpl::reset_state() { module_.run_method("reset"); }

// Note [Exported stages]
// ~~~~~~~~~~~~~~~~~~~~~~
// A program exported from Python (torch.export) and compiled by AOTInductor
// into a .pt2 package is a shared library of fused kernels with its weights
// inside: no parameters to train, no autograd graph. So such a stage runs
// inference only. It is appended in eval mode, and it refuses to run when
// gradients are on and either it is in training mode (a train_step, or
// forward after pipe->train(): its outputs would carry no gradient, and the
// loss would silently train nothing before it) or an input requires a
// gradient (a stage before it trains). Under torch::NoGradGuard or
// c10::InferenceMode it runs in any mode.
//
// The package is loaded onto the stage's device (its index as the loader's
// device, and current while it loads, for loaders that take none), and it
// runs on the stream current on the stage's thread (AOTInductor's runner
// takes the current stream when given none), so it overlaps with other
// stages as any stage does. Automatic CUDA graphs try to capture it, and on
// torch 2.11 the runner fails under capture ("operation not permitted when
// stream is capturing", measured on an H100), which leaves the call eager
// (Note [Automatic CUDA graphs]). It keeps no state between calls. A
// package compiled for one device type cannot run on another: the device in
// its metadata must match the stage's.
//
// The loader exists only in LibTorch 2.x (torch/csrc/inductor/aoti_package,
// found with __has_include when mpipe is compiled); elsewhere append(path)
// throws, naming the LibTorch version.
class ExportedStageImpl : public torch::nn::Module {
 public:
  ExportedStageImpl(const std::filesystem::path& package, c10::Device device);
  Tensors forward(const Tensors& inputs);
  void pretty_print(std::ostream& stream) const override {
    stream << "mpipe::ExportedStage(" << path_ << ")";
  }

 private:
  std::string path_;
#if MPIPE_HAS_AOTI
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
#endif
};
TORCH_MODULE(ExportedStage);

#if MPIPE_HAS_AOTI
/// A loader for `path` on `device`: with the device's index where the
/// loader takes one (LibTorch 2.7 and later), else with it current.
template <typename Loader>
std::unique_ptr<Loader> load_package(const std::string& path, c10::Device device) {
  c10::OptionalDeviceGuard current;
  if (device.has_index() && device.type() != c10::kCPU) current.reset_device(device);
  if constexpr (std::is_constructible<Loader, const std::string&, const std::string&, bool,
                                      size_t, c10::DeviceIndex>::value) {
    return std::make_unique<Loader>(path, "model", false, size_t{1},
                                    device.type() == c10::kCPU ? c10::DeviceIndex(-1)
                                                               : device.index());
  } else {
    return std::make_unique<Loader>(path, "model");
  }
}
#endif

MPIPE_FUNC ExportedStageImpl::ExportedStageImpl(const std::filesystem::path& package,
                                                c10::Device device)
    : torch::nn::Module("mpipe::ExportedStage"), path_(package.string()) {
  TORCH_CHECK(std::filesystem::is_regular_file(package), "the exported program ", path_,
              " is not a file");
#if MPIPE_HAS_AOTI
  loader_ = load_package<torch::inductor::AOTIModelPackageLoader>(path_, device);
  const auto metadata = loader_->get_metadata();
  const auto compiled = metadata.find("AOTI_DEVICE_KEY");
  if (compiled != metadata.end() && !compiled->second.empty()) {
    TORCH_CHECK(c10::Device(compiled->second).type() == device.type(), "the exported program ",
                path_, " was compiled for ", compiled->second, ", but the stage is on ", device);
  }
  train(false);  // Note [Exported stages]
#else
  (void)device;
  TORCH_CHECK(false, path_,
              " is an exported program (an AOTInductor .pt2 package), but this LibTorch (",
              TORCH_VERSION,
              ") has no package loader for it; exported stages need LibTorch 2.x, TorchScript "
              "stages (torch::jit::load) run on every LibTorch");
#endif
}

MPIPE_FUNC Tensors ExportedStageImpl::forward(const Tensors& inputs) {
#if MPIPE_HAS_AOTI
  if (at::GradMode::is_enabled()) {  // Note [Exported stages]
    TORCH_CHECK(!is_training(), "the exported program ", path_,
                " runs inference only, but it was called in training mode with gradients on; "
                "call it under torch::NoGradGuard, or put the pipeline in eval mode");
    for (size_t k = 0; k < inputs.size(); ++k) {
      TORCH_CHECK(!inputs[k].defined() || !inputs[k].requires_grad(), "the exported program ",
                  path_, " cannot pass a gradient back, but its input ", k,
                  " requires one (a stage before it trains); call it under torch::NoGradGuard");
    }
  }
  std::vector<at::Tensor> in(inputs);  // a copy: loaders before 2.6 take a non-const vector
  return loader_->run(in);
#else
  TORCH_CHECK(false, "the exported program ", path_, " was not loaded (", inputs.size(),
              " inputs)");
  return {};
#endif
}

}  // namespace detail

MPIPE_FUNC ModelPipelineImpl& ModelPipelineImpl::append(const torch::jit::Module& module,
                                                        const DeviceArg& device) {
  return append(detail::ScriptStage(module), device);
}

MPIPE_FUNC ModelPipelineImpl& ModelPipelineImpl::append(const std::filesystem::path& package,
                                                        const DeviceArg& device) {
  detail::ExportedStage stage{nullptr};
  c10::Device where = c10::kCPU;
  try {
    where = resolve_device(device);
    stage = detail::ExportedStage(package, where);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "mpipe::ModelPipeline::append: stage ", size(), ": ",
                e.what_without_backtrace());
  }
  return append(stage, where);
}

MPIPE_FUNC torch::nn::Sequential script_layers(const torch::jit::Module& module) {
  torch::nn::Sequential layers;
  for (const auto& child : module.named_children()) {
    layers->push_back(child.name, torch::nn::AnyModule(detail::ScriptLayer(child.value)));
  }
  TORCH_CHECK(!layers->is_empty(), "mpipe::script_layers: the TorchScript module ",
              module.type()->name() ? module.type()->name()->qualifiedName() : std::string(),
              " has no children to split it into");
  return layers;
}

}  // namespace mpipe
