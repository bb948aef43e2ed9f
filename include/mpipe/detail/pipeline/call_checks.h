#pragma once

// Private: what the calls share (pipeline/micro_batch_calls-inl.h,
// pipeline/time_step_calls-inl.h): the checks of their arguments and options,
// the loss of a training step, and a plan's run.

#include "mpipe/schedule.h"
#include "mpipe/split.h"
#include "mpipe/tensors.h"
#include "mpipe/training.h"

#include "mpipe/detail/pipeline/session.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace mpipe {
namespace detail {

/// Refuses a pipeline without stages and, given `x` (a Tensor overload's
/// input), an undefined or empty one; `time_major`: x is [T, N, ...].
/// Across processes every rank hears of a rank without stages at the first
/// call, and the first rank's inputs are checked as they are split.
void check_runnable(const PipelineView& p, const char* method, const at::Tensor* x = nullptr,
                    bool time_major = false);
/// The call's time chunk: 0 for single-step stages, kAutoChunk for the
/// pipeline's choice, else k >= 1 (Note [Time chunks]).
int64_t time_chunk_of(const ModelPipelineOptions& options, const char* method,
                 std::optional<int64_t> arg);
/// A time-step call's micro-batch split: the call's, else the options'
/// count, else empty for the pipeline's choice (Note [Micro-batches over
/// time]). The options' count leaves a call without a batched input whole
/// (a split given to the call is refused).
std::optional<Split> split_of(const ModelPipelineOptions& options, const char* method,
                              std::optional<Split> arg, const std::vector<Input>& inputs);

void check_grad_mode(const char* method);
/// A training step's loss function, checked where the loss is taken (the
/// last rank across processes).
void check_loss_fn(const char* method, const LossFunction& loss_fn);
/// The loss of the last stage's outputs `out`: one output in, one value out
/// (0-dim). `method` prefixes the messages when the caller does not name the
/// call itself (the executor does).
at::Tensor scalar_loss(const LossFunction& loss_fn, const Tensors& out, const at::Tensor& target,
                       const char* method = nullptr);
/// Refuses checkpointing of a stage whose stateful modules cannot save
/// their state (all stages, or all but the pipeline's last).
void check_checkpointable(const PipelineView& p, const char* method, bool except_last = false);

/// CallInfo::schedule of a step that runs TrainStepOptions::programs.
constexpr int64_t kGivenPrograms = -1;
/// A fingerprint of `programs`, so that ranks can check they were given the same.
int64_t fingerprint(const std::vector<schedules::Program>& programs);
/// TrainStepOptions::programs, refused unless they run this step: every
/// operation once, one worker per stage, no cycle (schedules::simulate).
void check_programs(const std::vector<schedules::Program>& programs, int64_t n_stages,
                    int64_t n_micro);
/// TrainStepOptions' values against this pipeline; bad ones throw
/// c10::ValueError, as check_programs does.
void check_schedule(const TrainStepOptions& step, int64_t n_stages);

/// Results handed to the caller: usable on its current streams.
Tensors for_caller(Tensors out);
/// `plan` run by `call`'s executor, and its results.
Tensors run_plan(Call& call, Plan plan, bool threaded);

}  // namespace detail
}  // namespace mpipe
