#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_MODEL_PIPELINE_H_
#define MPIPE_MODEL_PIPELINE_H_

// mpipe::ModelPipeline: a model split into stages, each on its own device and
// stream, with micro-batches (forward) or time steps (constant_forward)
// streamed through them. Design: docs/design.md and Note [One runtime] in
// mpipe/detail/runtime/executor.h.

#include <mpipe/device.h>
#include <mpipe/memory.h>
#include <mpipe/pipeline_options.h>
#include <mpipe/split.h>
#include <mpipe/tensors.h>
#include <mpipe/timeline.h>
#include <mpipe/training.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch {
namespace jit {
struct Module;  // torch/csrc/jit/api/module.h
}  // namespace jit
}  // namespace torch

namespace mpipe {

namespace detail {
struct PipelineParts;  // mpipe/detail/pipeline/session.h

template <typename M, typename = void>
struct has_tensor_forward : std::false_type {};
template <typename M>
struct has_tensor_forward<
    M, std::enable_if_t<std::is_convertible<
           decltype(std::declval<M&>().forward(std::declval<const at::Tensor&>())),
           at::Tensor>::value>> : std::true_type {};

template <typename M, typename = void>
struct has_tensors_forward : std::false_type {};
template <typename M>
struct has_tensors_forward<
    M, std::enable_if_t<std::is_convertible<
           decltype(std::declval<M&>().forward(std::declval<const Tensors&>())),
           Tensors>::value>> : std::true_type {};

/// A stage's result as Tensors: one tensor, a vector, or a tuple of tensors.
inline Tensors as_tensors(at::Tensor t) { return {std::move(t)}; }
inline Tensors as_tensors(Tensors t) { return t; }
template <typename... Ts>
Tensors as_tensors(std::tuple<Ts...> t) {
  Tensors out;
  std::apply([&](auto&... x) { (out.push_back(at::Tensor(x)), ...); }, t);
  return out;
}

void check_input_count(size_t got, size_t wanted);

/// Calls `m.forward(in[0], ..., in[N - 1])`, checking that there are N inputs.
template <size_t N, typename M, size_t... I>
Tensors call_with(M& m, const Tensors& in, std::index_sequence<I...>) {
  check_input_count(in.size(), N);
  return as_tensors(m.forward(in[I]...));
}

template <typename T>
struct forward_arity;
template <typename C, typename R, typename... A>
struct forward_arity<R (C::*)(A...)> : std::integral_constant<size_t, sizeof...(A)> {};
template <typename C, typename R, typename... A>
struct forward_arity<R (C::*)(A...) const> : std::integral_constant<size_t, sizeof...(A)> {};

/// How the pipeline calls module `m` as a stage (see append).
template <typename M>
StageForward stage_forward(M* m) {
  if constexpr (has_tensors_forward<M>::value) {
    return [m](const Tensors& in) { return as_tensors(m->forward(in)); };
  } else if constexpr (has_tensor_forward<M>::value) {
    return [m](const Tensors& in) {
      check_input_count(in.size(), 1);
      return Tensors{m->forward(in[0])};
    };
  } else {
    constexpr size_t n = forward_arity<decltype(&M::forward)>::value;
    return [m](const Tensors& in) {
      return call_with<n>(*m, in, std::make_index_sequence<n>{});
    };
  }
}
}  // namespace detail

/// A model split into stages, each on its own device, with micro-batches or
/// time steps streamed through them; use it through the holder
/// mpipe::ModelPipeline (`pipe->append(...)`, `pipe->forward(...)`).
class ModelPipelineImpl : public torch::nn::Module {
 public:
  /// An empty pipeline with `options` (mpipe/pipeline_options.h).
  explicit ModelPipelineImpl(ModelPipelineOptions options = {});
  ~ModelPipelineImpl() override;
  ModelPipelineImpl(const ModelPipelineImpl&) = delete;
  ModelPipelineImpl& operator=(const ModelPipelineImpl&) = delete;

  /// Appends a stage that runs after those already appended and moves it to
  /// `device` (see DeviceArg for the accepted spellings). `module` is a holder
  /// such as torch::nn::Sequential or torch::nn::Linear, a std::shared_ptr to
  /// one, or an AnyModule (one tensor in and out). Its forward takes
  ///  - one tensor and returns one tensor (the common case), or
  ///  - `const mpipe::Tensors&` and returns Tensors (or one tensor), or
  ///  - N tensors (a forward that is not a template) and returns one tensor
  ///    or a std::tuple of tensors;
  /// stage j's outputs are stage j+1's inputs, in order (mpipe/tensors.h). The
  /// stage is registered as submodule "stages.<index>". Its mpipe::Stateful
  /// modules are found now (Note [State snapshots]): register them before
  /// appending the stage.
  template <typename ModuleType>
  ModelPipelineImpl& append(std::shared_ptr<ModuleType> module, const DeviceArg& device) {
    static_assert(std::is_base_of<torch::nn::Module, ModuleType>::value,
                  "mpipe::ModelPipeline::append takes a torch::nn::Module");
    ModuleType* raw = module.get();
    return append_stage(std::move(module), detail::stage_forward(raw), device);
  }
  /// append for a module holder (torch::nn::Sequential, torch::nn::Linear, ...).
  template <typename ModuleType>
  ModelPipelineImpl& append(const torch::nn::ModuleHolder<ModuleType>& module,
                            const DeviceArg& device) {
    return append(module.ptr(), device);
  }
  /// append for an AnyModule: one tensor in, one tensor out.
  ModelPipelineImpl& append(torch::nn::AnyModule module, const DeviceArg& device);
  /// append for a TorchScript module (scripted or traced in Python and loaded
  /// with torch::jit::load, or defined in C++): its forward takes the stage's
  /// inputs and returns a tensor or a tuple or list of tensors. Its
  /// parameters and buffers are the pipeline's, under their own names, and
  /// stay shared with `module` (mpipe/script.h; Note [TorchScript stages]).
  ModelPipelineImpl& append(const torch::jit::Module& module, const DeviceArg& device);
  /// append for a program exported from Python and compiled by AOTInductor:
  /// the .pt2 package that torch._inductor.aoti_compile_and_package writes,
  /// loaded onto `device` (of the type it was compiled for). Its forward
  /// takes the stage's inputs, shaped as it was exported for, and returns its
  /// outputs. It runs inference only: forward and the time-step calls with
  /// gradients off (torch::NoGradGuard) or in eval mode, the mode it is
  /// appended in; asked for a gradient (training mode with gradients on, or
  /// an input that requires one) it throws. It has no parameters. Needs a
  /// LibTorch with AOTInductor's package loader (2.x); Debian's 1.13 has
  /// none, and there this throws (Note [Exported stages]).
  ModelPipelineImpl& append(const std::filesystem::path& package, const DeviceArg& device);

  /// Splits `x` along dim 0 into micro-batches, streams them through the
  /// stages as a fill-drain wavefront and returns their outputs concatenated
  /// along dim 0, on the output device. `split` is rows per micro-batch (an
  /// integer, as the seed's split_size: the last may be smaller, and one at or
  /// above the batch gives one micro-batch) or mpipe::chunks(n), n
  /// micro-batches as torchgpipe's `chunks` (mpipe/split.h). Equal, in value
  /// and in gradients, to running the stages one after another on the whole
  /// batch.
  at::Tensor forward(const at::Tensor& x, Split split);
  /// forward for stages with several tensors: `inputs` are stage 0's inputs,
  /// each split along dim 0 unless marked mpipe::unbatched (then every
  /// micro-batch gets it whole); batched inputs must agree on their size along
  /// dim 0. Returns the last stage's outputs, each concatenated along dim 0.
  Tensors forward(const std::vector<Input>& inputs, Split split);

  /// Runs the model T times on the same input `x`, time steps pipelined across
  /// stages (stage j runs step t while stage j-1 runs step t+1). Each stage runs
  /// exactly T times, steps in order, so stateful modules see what a plain loop
  /// `for t < T: out += model(x)` shows them. reduce = true returns the sum of
  /// the T outputs; reduce = false returns them concatenated along dim 0,
  /// time-major ([T*N, ...]).
  ///
  /// State carries from call to call: reset it between batches
  /// (mpipe::reset_states(*pipe)), or set
  /// ModelPipelineOptions::reset_state_each_call to have every call start from
  /// reset state. A forgotten reset raises no error: the next batch starts from
  /// the last one's membrane potentials.
  ///
  /// Multi-step stages (ModelPipelineOptions::step_mode(Multi), or a
  /// `time_chunk` k given here, which overrides the options): each stage call
  /// takes k consecutive steps at once, x repeated as [k, N, ...], and returns
  /// [k, N, ...]; chunks are pipelined as steps are (Note [Time chunks]). The
  /// result has the same shape and values for every k.
  ///
  /// Micro-batches (`split`, as forward's: rows per micro-batch or
  /// mpipe::chunks(n); default ModelPipelineOptions::time_micro_batches):
  /// the batch is also cut along dim 0, and the items streamed are (micro-
  /// batch, time chunk) pairs, each micro-batch with its own neuron state
  /// (Note [Per-micro-batch state]), so the stages overlap even with one
  /// chunk of all T steps. The result equals a plain loop that runs each
  /// micro-batch for T steps, joined along the batch dimension; it differs
  /// from the whole batch's only where a layer's result depends on the rows it
  /// sees (batch statistics). See Note [Micro-batches over time].
  at::Tensor constant_forward(const at::Tensor& x, int64_t T, bool reduce = true,
                              std::optional<int64_t> time_chunk = std::nullopt,
                              std::optional<Split> split = std::nullopt);
  /// constant_forward for stages with several tensors: every time step gets
  /// all `inputs` (multi-step: batched inputs repeated as [k, ...], unbatched
  /// ones whole); each output is summed (reduce) or concatenated time-major.
  Tensors constant_forward(const std::vector<Input>& inputs, int64_t T, bool reduce = true,
                           std::optional<int64_t> time_chunk = std::nullopt,
                           std::optional<Split> split = std::nullopt);

  /// Runs the model on a sequence `x_seq` of shape [T, N, ...] (e.g.
  /// Poisson-encoded frames), step t on x_seq[t], with time steps pipelined
  /// across stages as in constant_forward. Returns the per-step outputs stacked
  /// as [T, N, ...], or their sum when reduce = true. Equal, in values and
  /// gradients, to a plain loop over t. Multi-step stages get the sequence in
  /// chunks x_seq[t : t + k], as in constant_forward. State carries from call
  /// to call as in constant_forward (ModelPipelineOptions::reset_state_each_call).
  /// `split` cuts the batch (dim 1 of x_seq) into micro-batches, as in
  /// constant_forward.
  at::Tensor sequence_forward(const at::Tensor& x_seq, bool reduce = false,
                              std::optional<int64_t> time_chunk = std::nullopt,
                              std::optional<Split> split = std::nullopt);
  /// sequence_forward for stages with several tensors: batched inputs are
  /// [T, N, ...] and step t gets their row t; unbatched inputs go whole to
  /// every step. Each output is stacked [T, ...] or summed (reduce).
  Tensors sequence_forward(const std::vector<Input>& inputs, bool reduce = false,
                           std::optional<int64_t> time_chunk = std::nullopt,
                           std::optional<Split> split = std::nullopt);

  /// One training step. Splits `input` and `target` along dim 0 into
  /// micro-batches as step.split() says (rows per micro-batch, or
  /// mpipe::chunks(n)), runs every stage's forwards and
  /// backwards under step.schedule() (any mpipe::Schedule, Auto's choice or
  /// TrainStepOptions::programs: mpipe/training.h, mpipe/schedule.h), with
  /// activation checkpointing as options.checkpoint says, and accumulates
  /// into every parameter's .grad (as backward() would) the gradient of the
  /// full-batch loss: the mean over the batch when `loss_fn` returns the mean
  /// over the rows it is given (LossReduction::Mean, the default), or the sum
  /// (LossReduction::Sum). If `input` requires grad, its gradient is
  /// accumulated too. Returns that loss, detached, on the output device.
  /// Optimizer steps stay with the caller. See Note [Training runtime].
  /// With options.cuda_graphs the whole step can be replayed from a CUDA graph
  /// (Note [Graphed training steps]); the graph holds the loss computation as
  /// it was captured, so after changing what loss_fn computes for the same
  /// shapes, call clear_cuda_graphs().
  at::Tensor train_step(const at::Tensor& input, const at::Tensor& target,
                        const LossFunction& loss_fn, const TrainStepOptions& step);
  /// train_step for stages with several tensors: `inputs` as in forward's
  /// overload (their gradients, where they require one, are accumulated; an
  /// unbatched input's is the sum over micro-batches). The last stage returns
  /// one tensor, which loss_fn takes.
  at::Tensor train_step(const std::vector<Input>& inputs, const at::Tensor& target,
                        const LossFunction& loss_fn, const TrainStepOptions& step);

  /// One training step of a model run for T time steps (an SNN): resets the
  /// stateful modules, computes out = constant_forward(x, T, true) (the sum of
  /// the T outputs), loss = loss_fn(out, target), accumulates the loss's
  /// gradients into every parameter's .grad (and x's, if it requires grad),
  /// resets the stateful modules again and returns the loss, detached.
  /// `target` may be undefined if loss_fn ignores it. With options.cuda_graphs
  /// the forward and backward are replayed from one CUDA graph (Note [Graphed
  /// training steps]), loss_fn included: see train_step.
  /// Multi-step stages take the T steps in chunks, as in constant_forward.
  /// With micro-batches (`split`, as in constant_forward) `out` is every
  /// micro-batch's sum joined along dim 0, and loss_fn runs once, on it.
  at::Tensor constant_train_step(const at::Tensor& x, int64_t T, const at::Tensor& target,
                                 const LossFunction& loss_fn,
                                 std::optional<int64_t> time_chunk = std::nullopt,
                                 std::optional<Split> split = std::nullopt);
  /// constant_train_step for stages with several tensors (the last returns one).
  at::Tensor constant_train_step(const std::vector<Input>& inputs, int64_t T,
                                 const at::Tensor& target, const LossFunction& loss_fn,
                                 std::optional<int64_t> time_chunk = std::nullopt,
                                 std::optional<Split> split = std::nullopt);

  /// Number of stages.
  size_t size() const noexcept;
  /// Whether no stage was appended yet.
  bool is_empty() const noexcept { return size() == 0; }
  /// Stage `index`'s module.
  std::shared_ptr<torch::nn::Module> stage(size_t index) const;
  /// The device stage `index` runs on.
  c10::Device device(size_t index) const;
  /// Every stage's device, in stage order.
  const std::vector<c10::Device>& devices() const noexcept;
  /// Where forward's and constant_forward's results live: the last stage's device.
  c10::Device output_device() const;

  // Stateful modules in the stages keep one state per micro-batch of forward
  // (and of the time-step calls' split)
  // (Note [Per-micro-batch state], mpipe/state.h); reset them all with
  // mpipe::reset_states(*pipeline).

  /// Refused unless every stage is already on `device`; then casts to `dtype`
  /// (Note [Moving a pipeline]: a pipeline's placement is its point).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  /// Casts every stage to `dtype` where it is.
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  /// Refused unless every stage is already on `device` (then nothing moves).
  void to(torch::Device device, bool non_blocking = false) override;

  /// Loads like Module::load, then puts each stage back on its device (an
  /// archive may have been saved from, or mapped to, other devices).
  void load(torch::serialize::InputArchive& archive) override;
  /// Drops captured CUDA graphs (Note [CUDA graphs]) and frees their memory
  /// pools, and forgets which calls were seen (auto_cuda_graphs). Training
  /// steps' graphs, and graphs of stages that read host state, need it after
  /// a stage's parameters or buffers are replaced by hand; in-place updates,
  /// such as an optimizer's, need nothing. Waits for a call in progress, as do
  /// append, to and load.
  void clear_cuda_graphs();
  /// How many calls are held as CUDA graphs now (0 without CUDA).
  size_t cuda_graphs_captured() const;

  /// The tasks of the last call that ran with options.record_timeline (an
  /// empty Timeline if none did). Waits for the call's device work to finish.
  /// Export with Timeline::save_chrome_trace / save_svg.
  Timeline timeline();

  /// Parameters, gradients and buffers per stage device now, plus, with
  /// options.track_memory, the caching allocator's figures of the last call
  /// on each CUDA device (print it with MemoryReport::to_string()).
  MemoryReport memory_report() const;
  /// Prints "mpipe::ModelPipeline(devices=[cpu, cuda:0, ...])".
  void pretty_print(std::ostream& stream) const override;

  /// The options the pipeline was built with.
  ModelPipelineOptions options;

 private:
  ModelPipelineImpl& append_stage(std::shared_ptr<torch::nn::Module> module,
                                  detail::StageForward forward, const DeviceArg& device);

  /// Everything else a pipeline holds, one part per concern
  /// (mpipe/detail/pipeline/session.h): the stages, their executor, the
  /// call lock and memory watch, the graph policy, the process group, the
  /// timeline.
  std::unique_ptr<detail::PipelineParts> parts_;
};

/// A holder for ModelPipelineImpl, as torch::nn's modules have.
TORCH_MODULE(ModelPipeline);

}  // namespace mpipe

#endif  // MPIPE_MODEL_PIPELINE_H_
