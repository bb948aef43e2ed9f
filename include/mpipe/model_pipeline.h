#pragma once

// mpipe::ModelPipeline: a model split into stages, each on its own device and
// stream, with micro-batches (forward) or time steps (constant_forward)
// streamed through them. Design: Note [Pipeline runtime] in src/runtime.h and
// docs/design.md.

#include <mpipe/device.h>
#include <mpipe/memory.h>
#include <mpipe/pipeline_options.h>
#include <mpipe/timeline.h>
#include <mpipe/training.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpipe {

namespace detail {
class Runtime;
class GraphCache;
class Recorder;
struct Job;
struct StatefulModule;
class BackwardPositions;
/// How the runtime calls a stage: one tensor in, one tensor out.
using StageForward = std::function<at::Tensor(const at::Tensor&)>;

template <typename M, typename = void>
struct has_tensor_forward : std::false_type {};
template <typename M>
struct has_tensor_forward<
    M, std::enable_if_t<std::is_convertible<
           decltype(std::declval<M&>().forward(std::declval<const at::Tensor&>())),
           at::Tensor>::value>> : std::true_type {};
}  // namespace detail

class ModelPipelineImpl : public torch::nn::Module {
 public:
  explicit ModelPipelineImpl(ModelPipelineOptions options = {});
  ~ModelPipelineImpl() override;
  ModelPipelineImpl(const ModelPipelineImpl&) = delete;
  ModelPipelineImpl& operator=(const ModelPipelineImpl&) = delete;

  /// Appends a stage that runs after those already appended and moves it to
  /// `device` (see DeviceArg for the accepted spellings). `module` is any module
  /// whose forward takes and returns one tensor: a holder such as
  /// torch::nn::Sequential or torch::nn::Linear, a std::shared_ptr to one, or an
  /// AnyModule. The stage is registered as submodule "stages.<index>". Its
  /// mpipe::Stateful modules are found now (Note [State snapshots]): register
  /// them before appending the stage.
  template <typename ModuleType>
  ModelPipelineImpl& append(std::shared_ptr<ModuleType> module, const DeviceArg& device) {
    static_assert(std::is_base_of<torch::nn::Module, ModuleType>::value,
                  "mpipe::ModelPipeline::append takes a torch::nn::Module");
    static_assert(detail::has_tensor_forward<ModuleType>::value,
                  "mpipe::ModelPipeline::append: the stage's forward must take one tensor "
                  "and return a tensor");
    ModuleType* raw = module.get();
    return append_stage(std::move(module),
                        [raw](const at::Tensor& x) -> at::Tensor { return raw->forward(x); },
                        device);
  }
  template <typename ModuleType>
  ModelPipelineImpl& append(const torch::nn::ModuleHolder<ModuleType>& module,
                            const DeviceArg& device) {
    return append(module.ptr(), device);
  }
  ModelPipelineImpl& append(torch::nn::AnyModule module, const DeviceArg& device);

  /// Splits `x` along dim 0 into micro-batches of `split_size` rows (the last
  /// may be smaller; split_size >= batch gives one), streams them through the
  /// stages as a fill-drain wavefront and returns their outputs concatenated
  /// along dim 0, on the output device. Equal, in value and in gradients, to
  /// running the stages one after another on the whole batch.
  at::Tensor forward(const at::Tensor& x, int64_t split_size);

  /// Runs the model T times on the same input `x`, time steps pipelined across
  /// stages (stage j runs step t while stage j-1 runs step t+1). Each stage runs
  /// exactly T times, steps in order, so stateful modules see what a plain loop
  /// `for t < T: out += model(x)` shows them. reduce = true returns the sum of
  /// the T outputs; reduce = false returns them concatenated along dim 0,
  /// time-major ([T*N, ...]).
  at::Tensor constant_forward(const at::Tensor& x, int64_t T, bool reduce = true);

  /// Runs the model on a sequence `x_seq` of shape [T, N, ...] (e.g.
  /// Poisson-encoded frames), step t on x_seq[t], with time steps pipelined
  /// across stages as in constant_forward. Returns the per-step outputs stacked
  /// as [T, N, ...], or their sum when reduce = true. Equal, in values and
  /// gradients, to a plain loop over t.
  at::Tensor sequence_forward(const at::Tensor& x_seq, bool reduce = false);

  /// One training step. Splits `input` and `target` along dim 0 into
  /// micro-batches of step.split_size() rows, runs every stage's forwards and
  /// backwards under step.schedule() (GPipe or 1F1B), with activation
  /// checkpointing as options.checkpoint says, and accumulates into every
  /// parameter's .grad (as backward() would) the gradient of the full-batch
  /// loss: the mean over the batch when `loss_fn` returns the mean over the
  /// rows it is given (LossReduction::Mean, the default), or the sum
  /// (LossReduction::Sum). If `input` requires grad, its gradient is
  /// accumulated too. Returns that loss, detached, on the output device.
  /// Optimizer steps stay with the caller. See Note [Training runtime].
  /// With options.cuda_graphs the whole step can be replayed from a CUDA graph
  /// (Note [Graphed training steps]); the graph holds the loss computation as
  /// it was captured, so after changing what loss_fn computes for the same
  /// shapes, call clear_cuda_graphs().
  at::Tensor train_step(const at::Tensor& input, const at::Tensor& target,
                        const LossFunction& loss_fn, const TrainStepOptions& step);

  /// One training step of a model run for T time steps (an SNN): resets the
  /// stateful modules, computes out = constant_forward(x, T, true) (the sum of
  /// the T outputs), loss = loss_fn(out, target), accumulates the loss's
  /// gradients into every parameter's .grad (and x's, if it requires grad),
  /// resets the stateful modules again and returns the loss, detached.
  /// `target` may be undefined if loss_fn ignores it. With options.cuda_graphs
  /// the forward and backward are replayed from one CUDA graph (Note [Graphed
  /// training steps]), loss_fn included: see train_step.
  at::Tensor constant_train_step(const at::Tensor& x, int64_t T, const at::Tensor& target,
                                 const LossFunction& loss_fn);

  /// Number of stages.
  size_t size() const noexcept { return devices_.size(); }
  bool is_empty() const noexcept { return devices_.empty(); }
  /// Stage `index`'s module.
  std::shared_ptr<torch::nn::Module> stage(size_t index) const;
  /// The device stage `index` runs on.
  c10::Device device(size_t index) const;
  const std::vector<c10::Device>& devices() const noexcept { return devices_; }
  /// Where forward's and constant_forward's results live: the last stage's device.
  c10::Device output_device() const;

  /// Stateful modules in the stages keep one state per micro-batch of forward
  /// (Note [Per-micro-batch state], mpipe/state.h); reset them all with
  /// mpipe::reset_states(*pipeline).

  /// Note [Moving a pipeline]: a pipeline's placement is its point, so a move
  /// of the whole pipeline to one device is refused unless every stage is
  /// already there. Dtype casts are allowed and keep each stage on its device.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  /// Loads like Module::load, then puts each stage back on its device (an
  /// archive may have been saved from, or mapped to, other devices).
  void load(torch::serialize::InputArchive& archive) override;
  /// Drops captured CUDA graphs (Note [CUDA graphs]); call it after replacing
  /// a stage's parameter or buffer tensors by hand (in-place updates, such as
  /// an optimizer's, need nothing). Waits for a call in progress, as do
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
  void pretty_print(std::ostream& stream) const override;

  ModelPipelineOptions options;

 private:
  ModelPipelineImpl& append_stage(std::shared_ptr<torch::nn::Module> module,
                                  detail::StageForward forward, const DeviceArg& device);
  void check_runnable(const char* method, const at::Tensor& x, bool time_major = false) const;
  /// clear_cuda_graphs with call_mutex_ held.
  void drop_graphs();
  /// Refuses checkpointing when a stage holds a Stateful module without state
  /// snapshots (Note [State snapshots]).
  void check_checkpointable(const char* method) const;
  void check_placement_kept(c10::Device device, const char* what) const;
  bool graphable(const at::Tensor& x) const;
  /// Whether a training step on (x, target) may be graphed (Note [Graphed
  /// training steps]): graphable's rules, plus the target on x's device, an
  /// input that needs no gradient and no checkpointing.
  bool step_graphable(const at::Tensor& x, const at::Tensor& target) const;
  /// Runs a training step: replayed from a CUDA graph when step_graphable, else
  /// `eager(x, target, worker_threads)`; an empty key is never graphed. The
  /// caller holds call_mutex_.
  at::Tensor run_step(const std::string& key, const at::Tensor& x, const at::Tensor& target,
                      const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>& eager);
  /// Runs a call: replayed from a CUDA graph when options.cuda_graphs() allows
  /// it (keyed by method, its two integer arguments and x's shape), else
  /// `eager(x, worker_threads)`.
  at::Tensor run_call(const char* method, int64_t arg0, int64_t arg1, const at::Tensor& x,
                      const std::function<at::Tensor(const at::Tensor&, bool)>& eager);

  /// Runs a forward-type job through the runtime, recording its tasks when
  /// options.record_timeline (fill-drain's bubble as the schedule's).
  void execute_job(detail::Job& job, bool threaded, const at::Tensor& input);
  /// `in` run T times (constant_forward's job, also constant_train_step's):
  /// the sum of the outputs, or them concatenated time-major.
  at::Tensor run_constant(const char* method, const at::Tensor& in, int64_t T, bool reduce,
                          bool threaded, detail::BackwardPositions* positions = nullptr);
  /// A recorder for a call of `n_items` items when options.record_timeline,
  /// else null; `schedule_bubble` is the schedule's idle fraction.
  std::shared_ptr<detail::Recorder> start_recording(const char* method, const char* item_name,
                                                    int64_t n_items, double schedule_bubble) const;
  /// With options.track_memory: resets the allocator peaks of the stage
  /// devices (begin) and reads them after the call (end).
  void begin_memory_watch();
  void end_memory_watch(const char* method);

  torch::nn::ModuleList stages_;
  std::vector<detail::StageForward> forwards_;
  std::vector<c10::Device> devices_;
  std::vector<std::vector<detail::StatefulModule>> stateful_;  // per stage
  std::unique_ptr<detail::Runtime> runtime_;
  std::shared_ptr<detail::GraphCache> graphs_;  // null without CUDA
  mutable std::mutex call_mutex_;  // one call at a time: stages' state must see calls in order
  std::shared_ptr<detail::Recorder> pending_timeline_;  // the last recorded call
  Timeline timeline_;                                   // ...once resolved
  std::string memory_call_;
  struct MemoryCounters {
    c10::Device device;
    int64_t before, peak;
  };
  std::vector<MemoryCounters> memory_counters_;  // per CUDA stage device, last call
};

/// A holder for ModelPipelineImpl, as torch::nn's modules have.
TORCH_MODULE(ModelPipeline);

}  // namespace mpipe
