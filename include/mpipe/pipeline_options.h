#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_PIPELINE_OPTIONS_H_
#define MPIPE_PIPELINE_OPTIONS_H_

// Options of mpipe::ModelPipeline, in the style of torch::nn's options structs.

#include <mpipe/checkpoint.h>
#include <mpipe/distributed.h>
#include <mpipe/snn/step_mode.h>

#include <torch/arg.h>

#include <cstdint>
#include <vector>

namespace mpipe {

/// Options of a ModelPipeline, in the style of torch::nn's options structs:
/// `mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().worker_threads(false))`.
struct ModelPipelineOptions {
  /// Run each stage's host work (kernel launches, CPU compute) on a worker
  /// thread of its own, so stages issue work concurrently. When false, the
  /// caller's thread runs every task in the schedule's clock order; results are
  /// the same either way (docs/design.md, "One runtime", says where a
  /// backward() of your own after a forward can differ in its last bits). A call of one item
  /// (one micro-batch, or one time chunk) always runs on the caller's thread:
  /// its tasks wait for one another, so threads would only add hand-offs.
  TORCH_ARG(bool, worker_threads) = true;
  /// constant_forward and sequence_forward start from reset state: every
  /// Stateful module of the pipeline is reset (mpipe::reset_states) at the
  /// start of each such call, as SpikingJelly users call reset_net after each
  /// batch. Off (the default): state carries from call to call, as the seed's
  /// class does, and you reset it yourself between batches; forgetting that is
  /// silent when the batch shape stays the same. State is left as the call
  /// ends, for inspection. constant_train_step always starts and ends reset.
  TORCH_ARG(bool, reset_state_each_call) = false;
  /// Activation checkpointing in train_step (only in training mode): a
  /// checkpointed stage keeps just its input in forward and runs again in
  /// backward, drawing the same random numbers, so dropout draws the same
  /// mask. See Note [Training runtime]. constant_train_step checkpoints by
  /// micro-batch of its split (ExceptLast: all but the last micro-batch) on
  /// every stage but the last: a checkpointed micro-batch runs all its time
  /// chunks again at its first backward on the stage, so a stage holds a
  /// graph only from then to the micro-batch's last backward (Note
  /// [Checkpointed time steps]).
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::Never;
  /// Capture no-grad forward / constant_forward / sequence_forward calls, and
  /// whole training steps (train_step, constant_train_step: forward and
  /// backward), whose stages and input share one CUDA device as CUDA graphs,
  /// and replay them (one graph per method, arguments and input shape).
  /// Stateful modules then start every graphed call from their reset state
  /// and are reset after it. Needs a CUDA build of LibTorch; elsewhere, or
  /// when a call does not qualify, the call runs as usual. See Notes [CUDA
  /// graphs] and [Graphed training steps].
  TORCH_ARG(bool, cuda_graphs) = false;
  /// Replay repeated calls from CUDA graphs, with no flag to set, where a
  /// replay gives the eager call's results bit for bit, on one CUDA device
  /// holding every stage and the input, in one process:
  ///  - a single-tensor forward (or constant_forward, sequence_forward) under
  ///    NoGradGuard or InferenceMode with no stateful module (nor a module
  ///    with buffers in training mode, such as BatchNorm updating its
  ///    statistics), captured the third time the same call (split, input
  ///    shape and dtype, module mode, autocast state) comes;
  ///  - a train_step (no stateful module) or constant_train_step whose input
  ///    needs no gradient, with no checkpointing, a loss scale of 1 and no
  ///    given programs, captured the fourth time the same step (and the same
  ///    loss function type) comes; gradients accumulate into .grad as eager
  ///    steps' do.
  /// Not when the earlier runs drew random numbers (dropout), nor while the
  /// caching allocator holds more than half the device's memory (a graph
  /// keeps its activations' memory reserved). A capture that fails falls
  /// back to eager calls, and a graph whose parameters or buffers were moved
  /// to new storage is captured again. At most 4 such graphs are held
  /// (clear_cuda_graphs frees them). Turn it off for a stage or a loss
  /// function that depends on host state changing between calls (a counter,
  /// a flag, a scalar member, a value a lambda captured by reference): a
  /// replay repeats the device work of its capture. No effect with
  /// cuda_graphs, which captures qualifying calls without these extra rules.
  /// See Notes [Automatic CUDA graphs] and [Automatic graphs of training
  /// steps].
  TORCH_ARG(bool, auto_cuda_graphs) = true;
  /// forward() on CUDA: each GPU gets this many streams (lanes), and
  /// micro-batch i runs on lane i % lanes through every stage on that GPU, so
  /// up to `lanes` micro-batches run on a GPU at once and a micro-batch passes
  /// between stages of one GPU without an event. It pays where a stage's
  /// kernels are too small to fill the GPU (several stages on one GPU, small
  /// micro-batches); results are the same. Only stages that hold no state (no
  /// buffers, no stateful modules) use lanes; the others, training steps,
  /// time-step calls and calls under autocast (whose micro-batches share a
  /// stage's weight casts) use one stream per stage. 0 (the default) chooses
  /// one lane per micro-batch, up to 8: a replay from a CUDA graph adds no host
  /// cost per lane, and an eager call spares an event per hand-off between
  /// stages of one GPU (2.5-10 µs per task on H100s). Each lane keeps its
  /// micro-batch's memory (in a replay, in the graph's memory); lanes(1), one
  /// stream per stage, keeps the least. See Note [Lanes].
  TORCH_ARG(int64_t, lanes) = 0;
  /// train_step under autocast: each mpipe::Linear weight (float32) is cast
  /// once per step and stage, and the micro-batches' gradients of that cast
  /// are summed in the autocast dtype, then added to the weight's .grad once,
  /// as one backward over the whole batch would (the engine sums a shared
  /// tensor's gradients in its dtype). This saves a float32 conversion and
  /// addition per weight and micro-batch (a quarter of a bf16 wide-MLP step).
  /// Off: each micro-batch's gradient is converted and added on its own, as
  /// in a plain gradient-accumulation loop (more precise sums, slower). Hooks
  /// on such a weight do not see the per-step sum. Graphed steps sum the same
  /// way. See Note [Cast gradients per step].
  TORCH_ARG(bool, accumulate_cast_grads) = true;
  /// How the stages take time in constant_forward, sequence_forward and
  /// constant_train_step. Single (the default): one time step per stage
  /// call, input [N, ...]. Multi: the stages are multi-step (neurons in
  /// snn::StepMode::Multi, stateless layers inside snn::SeqToANN, as
  /// SpikingJelly's step_mode 'm'), and each stage call gets time_chunk()
  /// consecutive steps as [k, N, ...]. A call's own time_chunk argument
  /// overrides both. See Note [Time chunks].
  TORCH_ARG(snn::StepMode, step_mode) = snn::StepMode::Single;
  /// Time steps per stage call with multi-step stages (the last chunk may
  /// be shorter; >= T: all steps in one call, no overlap over time). Fewer,
  /// larger chunks cost fewer launches; more chunks overlap more across
  /// devices. 0 (the default) chooses: all T steps in one chunk when every
  /// stage is on one device, where that measured fastest (bench/RESULTS.md);
  /// with D devices (or ranks) about 4 chunks per device, k = ceil(T / 4D).
  TORCH_ARG(int64_t, time_chunk) = 0;
  /// Micro-batches of constant_forward, sequence_forward and
  /// constant_train_step (a call's own `split` overrides it): n cuts the
  /// batch into n micro-batches (mpipe::chunks(n)'s rule), each with its own
  /// neuron state, and the items streamed are (micro-batch, time chunk)
  /// pairs, so stages overlap even with one chunk of all T steps. Results
  /// equal a plain loop run on each micro-batch; they differ from the whole
  /// batch's where a layer depends on the rows it sees (BatchNorm's batch
  /// statistics, SpikingConvBlock in training). 0 (the default) chooses: the
  /// whole batch, except for multi-step stages spread over D devices (the
  /// distinct devices of the stages, the CPU counting as one device like each
  /// GPU; across processes, the ranks) whose time chunks give fewer than 2
  /// items per device (T < 2D
  /// with the default chunk), in calls that start from reset state
  /// (constant_train_step, reset_state_each_call); then about 4 items per
  /// device, min(batch, ceil(4D / chunks)) micro-batches. Measured: the speed-up depends on the
  /// item count, not on how items are cut, and 4 per device reached 82 % of
  /// the ideal (bench/RESULTS.md). 1 never cuts the batch. A negative value
  /// is refused by each of those calls (c10::Error naming the call and the
  /// value). See Note [Micro-batches over time].
  TORCH_ARG(int64_t, time_micro_batches) = 0;
  /// Record every task of each call (stage, item, forward / backward /
  /// recompute / copy, start, end, device) for ModelPipelineImpl::timeline();
  /// calls then run eagerly, never from a CUDA graph. See Note [Timeline].
  TORCH_ARG(bool, record_timeline) = false;
  /// Reset the CUDA caching allocator's peak counter of every stage device at
  /// the start of each call and read it at the end, for memory_report(). The
  /// counters are process-wide: leave this off if other code reads them.
  TORCH_ARG(bool, track_memory) = false;
  /// The process group the pipeline spans (mpipe/distributed.h): each rank
  /// appends its own stages (a contiguous range, unless stage_numbers says
  /// otherwise), and every rank makes the same calls. Undefined (the
  /// default): the pipeline lives in this process. Set it before the first
  /// call; calls then never run as CUDA graphs.
  TORCH_ARG(distributed::ProcessGroup, process_group);
  /// Across processes: the pipeline's stage numbers of the stages this rank
  /// appends, ascending, in append order; ProcessGroup::v_stages gives the V
  /// of ZB-V (rank r holds stages r and 2S - 1 - r of 2S). Every rank sets
  /// them or none does; together they number every stage once, and pipeline
  /// rank 0 holds stage 0 (it reads the inputs). The rank that holds the last
  /// stage gets the outputs and the loss. Empty (the default): the ranks hold
  /// contiguous ranges in pipeline-rank order. Checked at the first call.
  TORCH_ARG(std::vector<int64_t>, stage_numbers);
};

}  // namespace mpipe

#endif  // MPIPE_PIPELINE_OPTIONS_H_
