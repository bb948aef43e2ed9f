#include "mpipe/detail/header_only.h"  // Note [Header-only mode]

#ifndef MPIPE_TRAINING_H_
#define MPIPE_TRAINING_H_

// Options of ModelPipelineImpl::train_step: the schedule, the loss and how it
// is reduced over the batch; and the automatic choice of schedule.

#include <mpipe/schedule.h>
#include <mpipe/simulate.h>
#include <mpipe/split.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <string>
#include <vector>

namespace mpipe {

/// How loss_fn reduces over the rows it is given, and so how train_step
/// weighs the micro-batches.
enum class LossReduction {
  /// The loss function returns the mean over the rows it is given; the step's
  /// gradients are those of the mean over the whole batch.
  Mean,
  /// The loss function returns the sum over its rows; the step's gradients are
  /// those of the sum over the whole batch.
  Sum,
};

/// Loss of one micro-batch: (output of the last stage, matching rows of the
/// target) -> a scalar.
using LossFunction = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

/// How train_step runs: the split into micro-batches, the schedule, the loss's
/// reduction and the schedule's inputs.
struct TrainStepOptions {
  /// Micro-batches of `split_size` rows (the last may be smaller).
  /* implicit */ TrainStepOptions(int64_t split_size) : split_(split_size) {}
  /// Micro-batches as `split` says: rows each, or mpipe::chunks(n).
  /* implicit */ TrainStepOptions(Split split) : split_(split) {}

  /// Micro-batches of `rows` rows each (the last may be smaller).
  TrainStepOptions& split_size(int64_t rows) {
    split_ = Split(rows);
    return *this;
  }
  /// `n` micro-batches (torchgpipe's `chunks`, torch.distributed.pipelining's
  /// `n_microbatches`), as mpipe::chunks(n).
  TrainStepOptions& chunks(int64_t n) {
    split_ = Split::chunks(n);
    return *this;
  }
  /// The split, as given (Note [Two spellings of a split] in mpipe/split.h).
  const Split& split() const noexcept { return split_; }

 private:
  Split split_;

 public:
  /// The order of forwards and backwards (mpipe/schedule.h); GPipe by default.
  TORCH_ARG(Schedule, schedule) = Schedule::GPipe;
  /// What loss_fn returns: the mean over its rows (default) or their sum.
  TORCH_ARG(LossReduction, reduction) = LossReduction::Mean;
  /// Interleaved1F1B (and Auto's interleaved candidate): chunks per worker; it
  /// must divide the stage count. 1 makes Interleaved1F1B plain 1F1B. train_step
  /// refuses a value below 1, one that does not divide the stage count, and
  /// any value other than 1 with GPipe, OneFOneB, ZeroBubbleH1, ZeroBubbleV or DualPipeV
  /// (their placements are fixed). With Auto, a value above 1 adds
  /// Interleaved1F1B to the candidates, and with Tailored its placement
  /// (Note [Choosing a schedule]).
  TORCH_ARG(int64_t, virtual_stages) = 1;
  /// Auto and Tailored: what one micro-batch's operations cost on each stage
  /// (one entry for all stages, or one per stage; empty: equal stages), e.g.
  /// from balance::stage_costs.
  TORCH_ARG(schedules::Costs, stage_costs) = {};
  /// Auto and Tailored: the activation memory one micro-batch keeps alive on
  /// each stage, in bytes (one per stage; empty: memory is not considered).
  TORCH_ARG(std::vector<double>, activation_bytes) = {};
  /// Auto and Tailored: the most activation memory a device may hold, in
  /// bytes (0: no limit; Tailored then keeps within 1F1B's peak).
  TORCH_ARG(double, memory_limit) = 0;
  /// Programs to run instead of `schedule`'s: one per worker, each the
  /// operations that worker runs in order (schedules::F, B, I, W of every
  /// stage and micro-batch of the step; Note [Programs] in schedule.h), e.g.
  /// an order no built-in schedule produces. train_step refuses programs that
  /// miss or repeat an operation, put one stage on two workers, or cannot
  /// finish (schedules::validate and schedules::simulate), or whose
  /// micro-batch count is not the step's. Such a step is never replayed from
  /// a CUDA graph. Across processes every rank passes the same programs.
  TORCH_ARG(std::vector<schedules::Program>, programs) = {};
  /// Backward runs from the loss times this (loss scaling for fp16, e.g.
  /// GradScaler::get_scale()); the step still returns the unscaled loss. A
  /// step with a scale other than 1 is never replayed from a CUDA graph.
  TORCH_ARG(double, loss_scale) = 1.0;
};

/// What choose_schedule picked, and every candidate's prediction.
struct ScheduleChoice {
  /// One candidate, with what the model predicts for it.
  struct Candidate {
    Schedule schedule;        ///< the candidate
    double time = 0;          ///< schedules::makespan with the stage costs
    double bubble = 0;        ///< schedules::bubble with the stage costs
    double peak_memory = 0;   ///< a device's most activation bytes (Note [Choosing a schedule])
    double peak_in_flight = 0;  ///< a device's most (stage, micro-batch) activations
    bool fits = true;         ///< peak_memory <= memory_limit (or no limit)
  };
  Schedule schedule;                  ///< the pick
  std::vector<Candidate> candidates;  ///< in the order they were weighed
  std::vector<schedules::Program> programs;  ///< the pick's, one per worker
};

// Note [Choosing a schedule]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The model runs every candidate's programs through schedules::simulate with
// the given stage costs: each worker runs its operations in order, one at a
// time, each as soon as its inputs exist; workers whose stages sit on one
// device take turns on it (the earliest-ready first); a hand-off between
// workers costs the stage's `transfer`. The predicted step time is the
// makespan. A worker's activation memory is the sum of activation_bytes over
// the (stage, micro-batch) pairs between their forward and their backward
// (for split backwards, their weight gradient); a device's is the sum over
// its workers, and its peak must not exceed memory_limit. Built-in
// candidates, in this order: GPipe, 1F1B and ZB-H1; Interleaved1F1B when
// virtual_stages > 1; ZB-V when the stages are even in number and stage s
// shares a device with stage n-1-s (a V: all on one GPU, for one), and
// there DualPipeV with at least n micro-batches (its pairs charged F + B:
// their overlap is not predicted, so it is taken only where its order alone
// is faster). Auto takes
// the fastest built-in that fits (times within a relative 1e-9 count as
// equal); among equally fast ones, the one with the fewest peak bytes, then
// the fewest peak activations, then the earlier in that list. If none fits,
// the one with the least peak bytes (the earlier among equals).
//
// Tailored, weighed last, is built for the costs (Note [Greedy schedules] in
// mpipe/detail/schedules/greedy.h): list-scheduled programs for every
// placement the devices allow (a worker per stage; the V; Megatron's
// interleaving with virtual_stages > 1), every order (IFW, FIW, IWF) with
// caps of 1 micro-batch up (or as many activations per stage held), raised
// until two caps in a row are no faster or min(m, n) is reached, and the
// built-ins themselves; the fastest within its bound wins (memory_limit, or
// without one the peaks of 1F1B), so it is never predicted slower than a
// built-in within that bound. Auto picks it only where it is predicted
// faster than the built-in it would pick, or where no built-in fits and it
// does. Answers are kept per question (sizes, costs, memory, devices), so a
// step pays the search once.
//
// Stages sharing one device: while no hand-off costs anything (transfer 0)
// the device never waits, so every candidate takes the sum of its operations
// and memory decides. With virtual_stages 1 and an even stage count that is
// ZB-V, whose workers hold two stages each (8 activations against 1F1B's 10
// for 8 micro-batches on 4 stages). With virtual_stages > 1 it is usually
// Interleaved1F1B, which holds as few (8) and comes first in the list; with
// few micro-batches 1F1B holds fewer and wins (on 8 stages with 2 chunks per
// worker: 2 to 4 micro-batches; ZB-V at 5). A hand-off cost makes the device
// wait for hand-offs, and then the times differ: 8 micro-batches on 4 stages
// with forward = backward_input = backward_weight = transfer = 1 take 96
// units under GPipe, ZB-H1 and ZB-V (whose middle hand-off stays on its
// worker) and 98 under 1F1B, and ZB-V (fewer activations) wins; with
// transfer 3, GPipe takes 99 units against 1F1B's 102, and Tailored 98
// within 1F1B's memory. Limits: parameters and optimizer state are not
// counted (they do not depend on the schedule); the costs are what the
// caller measured (e.g. balance::profile_time on one sample), and a GPU that
// overlaps two streams' kernels does better than taking turns.

/// The schedule TrainStepOptions' Auto picks for n_micro micro-batches over
/// n_stages stages, stage s on device stage_devices[s] (any labels; empty:
/// every stage on its own device), with its programs; with options.schedule()
/// Tailored, the programs Tailored builds. Note [Choosing a schedule].
inline ScheduleChoice choose_schedule(int64_t n_micro, int64_t n_stages,
                                      const TrainStepOptions& options,
                                      const std::vector<int64_t>& stage_devices = {});

}  // namespace mpipe

#include <mpipe/detail/schedules/choose.h>  // choose_schedule's definition

#endif  // MPIPE_TRAINING_H_
