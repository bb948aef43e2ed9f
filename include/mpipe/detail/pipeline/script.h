#pragma once

// Private: TorchScript modules as torch::nn modules (Note [TorchScript
// stages] in script-inl.h).

#include "mpipe/detail/config.h"

#include <mpipe/state.h>
#include <mpipe/tensors.h>

#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <ostream>
#include <string>

namespace mpipe {
namespace detail {

/// What both adapters share: `module`'s parameters and buffers registered as
/// this module's (the same tensors), its training mode, and its forward.
class ScriptModuleBase : public torch::nn::Module {
 public:
  explicit ScriptModuleBase(torch::jit::Module module);
  void train(bool on = true) override;
  void pretty_print(std::ostream& stream) const override;
  /// module.forward(inputs), its result as tensors.
  Tensors call(const Tensors& inputs);
  const torch::jit::Module& module() const { return module_; }
  /// The module's TorchScript type, for messages.
  const std::string& type_name() const { return type_; }

 private:
  torch::jit::Module module_;
  std::string type_;         // for messages
  size_t min_inputs_ = 0;    // forward's arguments without a default
  size_t max_inputs_ = 0;    // all of forward's arguments (self not counted)
  bool resets_ = false;      // it has a reset() method (a Stateful child calls it)
};

/// A stage of one TorchScript module: tensors in, tensors out (append).
class ScriptStageImpl : public ScriptModuleBase {
 public:
  using ScriptModuleBase::ScriptModuleBase;
  Tensors forward(const Tensors& inputs) { return call(inputs); }
};
TORCH_MODULE(ScriptStage);

/// A layer for mpipe::balance's Sequentials: one tensor in, one out.
class ScriptLayerImpl : public ScriptModuleBase {
 public:
  using ScriptModuleBase::ScriptModuleBase;
  at::Tensor forward(const at::Tensor& input);
};
TORCH_MODULE(ScriptLayer);

/// The reset() method of a TorchScript module, as mpipe::Stateful: what
/// reset_states (and the time-step calls) call.
class ScriptResetImpl : public torch::nn::Module, public Stateful {
 public:
  explicit ScriptResetImpl(torch::jit::Module module) : module_(std::move(module)) {}
  void reset_state() override;

 private:
  torch::jit::Module module_;
};

}  // namespace detail
}  // namespace mpipe
