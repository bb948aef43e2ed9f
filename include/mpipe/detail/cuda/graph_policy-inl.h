#pragma once

#include "mpipe/detail/config.h"

// The pipeline's CUDA-graph policy: which calls may run from a graph (one
// device, no grad, no stage holding state, no timeline), the cache's key,
// automatic capture of repeated calls (Note [Automatic CUDA graphs]) and
// training steps (Note [Automatic graphs of training steps]). The
// graphs themselves are cuda/graphs.h's.

#include "mpipe/detail/cuda/graph_policy.h"

#include "mpipe/detail/cuda/device_probe.h"
#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/rng.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

namespace mpipe {
namespace detail {

/// The cache's key of a graphed call: `key` and every module's training flag.
MPIPE_FUNC std::string graph_key(const torch::nn::Module& pipeline, const GraphKey& key) {
  // A capture fixes each module's branch on its training flag: a stage put
  // in eval (or train) mode on its own is another graph.
  std::string modes;
  for (const auto& m : pipeline.modules(/*include_self=*/false)) modes += m->is_training() ? '1' : '0';
  return key.str() + "|" + modes;
}

/// The parameters and buffers a graph reads in place.
MPIPE_FUNC std::vector<at::Tensor> watched_tensors(const torch::nn::Module& pipeline) {
  std::vector<at::Tensor> watched = pipeline.parameters();
  for (auto& b : pipeline.buffers()) watched.push_back(std::move(b));
  return watched;
}

MPIPE_FUNC bool GraphPolicy::could_graph(const ModelPipelineImpl& pipeline, const Stages& stages,
                                         const at::Tensor& x) const {
  if (!cache_ || c10::GradMode::is_enabled() || !x.is_cuda() ||
      pipeline.options.record_timeline()) {
    return false;  // a replay has no tasks to record (Note [Timeline])
  }
  for (const auto& d : stages.devices) {
    if (d != x.device()) return false;  // one device per graph (at::cuda::CUDAGraph)
  }
  for (const auto& stage : stages.stateful) {
    for (const auto& m : stage) {
      if (m.state->holds_state()) return false;
    }
  }
  return true;
}

MPIPE_FUNC bool GraphPolicy::auto_graphable(const ModelPipelineImpl& pipeline,
                                            const Stages& stages, const at::Tensor& x) const {
  const ModelPipelineOptions& o = pipeline.options;
  if (!o.auto_cuda_graphs() || o.cuda_graphs() || o.process_group().defined() ||
      o.track_memory() || !could_graph(pipeline, stages, x)) {
    return false;  // (a replay allocates nothing: a memory report would show another call)
  }
  for (const auto& stage : stages.stateful) {
    if (!stage.empty()) return false;  // a graph would reset the state a call carries
  }
  // A module in training mode that holds buffers (BatchNorm) updates them in
  // every call: the capturing call's warm-up would update them twice.
  for (const auto& m : pipeline.modules(/*include_self=*/false)) {
    if (m->is_training() && !m->buffers(/*recurse=*/false).empty()) return false;
  }
  return true;
}

MPIPE_FUNC at::Tensor GraphPolicy::replay(ModelPipelineImpl& pipeline, const std::string& key,
                                          const std::vector<at::Tensor>& watched,
                                          const at::Tensor& x, const Eager& eager) {
  PlainDraws plain;  // a replay draws what its capture drew (Note [Random draws])
  at::Tensor out = run_graphed(
      *cache_, key, x, watched, [&](const at::Tensor& in) { return eager(in, /*threaded=*/false); },
      [&pipeline] { reset_states(pipeline); });
  if (out.defined()) reset_states(pipeline);  // Note [CUDA graphs]: state does not outlive a graphed call
  return out;  // undefined: the cache is full, run eagerly
}

MPIPE_FUNC at::Tensor GraphPolicy::call(ModelPipelineImpl& pipeline, const Stages& stages,
                                        const GraphKey& key, const at::Tensor& x,
                                        const Eager& eager) {
  if (pipeline.options.cuda_graphs() && could_graph(pipeline, stages, x)) {
    return replay(pipeline, graph_key(pipeline, key), watched_tensors(pipeline), x, eager);
  }
  if (auto_graphable(pipeline, stages, x)) return auto_graphed(pipeline, stages, key, x, eager);
  return {};
}

// Note [Automatic CUDA graphs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Inference calls that repeat are bound by the host's launches when their
// kernels are small (narrow-mlp: eager 5-6.7 ms, its replay 2.8-2.9 ms,
// bench/RESULTS.md), so with ModelPipelineOptions::auto_cuda_graphs
// (the default) they are replayed without a flag, where a replay cannot be
// told from an eager call:
//  - no gradients, one CUDA device, one input tensor, one process, no
//    timeline (the rules of Note [CUDA graphs]), and no Stateful module at
//    all: a graph starts from reset state, an eager call carries state on;
//    no module in training mode with buffers (BatchNorm updating its running
//    statistics: the capturing call's warm-up would update them twice);
//  - the same key (detail::GraphKey: method, arguments, input shape and dtype,
//    autocast state; with graph_key, every module's train/eval flag) ran
//    eagerly twice before, so one-off shapes cost no capture, and neither run
//    drew random numbers (draws_seen: a replay would draw other numbers than
//    the per-item generators of Note [Random draws]);
//  - a capture that fails (a stage that synchronises, such as .item()) is not
//    reported: the key stays eager for good;
//  - a graph whose parameters or buffers moved to new storage (to(),
//    set_data, loading into new tensors) is dropped and captured again, twice
//    at most per key; values changed in place (an optimizer step) are read by
//    the replay;
//  - at most kMaxAutoGraphs graphs are held, each with its activations'
//    memory reserved.
// A replayed call still takes its seed from the CPU's generator, as an eager
// call does, so code after it draws the same numbers either way. What cannot
// be checked is host state a stage's forward reads (a counter, a flag or a
// scalar member changed between calls): the replay repeats the capture's
// device work, so such stages need auto_cuda_graphs(false). While a capture
// runs (once per key), the device's default CUDA generator is in capture
// mode for the whole process: another thread drawing random numbers on that
// device at that moment fails, as with torch.cuda.graphs.
constexpr size_t kMaxAutoGraphs = 4;
constexpr int kAutoEagerRuns = 2;
constexpr int kAutoMoves = 2;


MPIPE_FUNC at::Tensor GraphPolicy::auto_graphed(ModelPipelineImpl& pipeline, const Stages& stages,
                                                const GraphKey& key, const at::Tensor& x,
                                                const Eager& eager) {
  const std::string k = graph_key(pipeline, key);
  const std::vector<at::Tensor> watched = watched_tensors(pipeline);
  const Held held = holds_graph(*cache_, k, watched);
  // An eager call takes its seed from the CPU generator (Note [Random draws]);
  // a replayed one takes it too, so that later draws do not tell them apart.
  auto as_eager_draws = [&stages] { (void)CallRng::begin(stages.devices); };
  if (held == Held::Held) {
    as_eager_draws();
    return replay(pipeline, k, watched, x, eager);
  }
  AutoGraph& seen = this->seen(k);
  if (held == Held::Moved && ++seen.moved > kAutoMoves) seen.refused = true;
  if (!seen.refused && seen.eager_runs >= kAutoEagerRuns && graphs_held(*cache_) < kMaxAutoGraphs &&
      room_for_capture(x.device())) {
    try {
      at::Tensor out = replay(pipeline, k, watched, x, eager);
      if (out.defined()) {
        as_eager_draws();
        return out;
      }
    } catch (const std::exception&) {
      seen.refused = true;  // the capture failed: this key runs eagerly from now on
    }
  }
  const uint64_t draws = draws_seen();
  at::Tensor out = eager(x, pipeline.options.worker_threads());
  if (draws_seen() != draws) seen.refused = true;
  ++seen.eager_runs;
  return out;
}

// Note [Automatic graphs of training steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Training steps of small stages are bound by the host's launches as much as
// inference calls are (snn-1024's single-step constant_train_step: 18-37 ms
// eager, 7.4 ms replayed, bench/RESULTS.md), so auto_cuda_graphs captures
// train_step and constant_train_step too, where a replay gives the eager
// step's results bit for bit (the same kernels in the same order on the same
// streams, gradients accumulated into static .grad tensors as Note [Graphed
// training steps] describes):
//  - the rules of Note [Automatic CUDA graphs] (one CUDA device, one process,
//    no timeline or memory tracking, no random draws in the eager runs, at
//    most kMaxAutoGraphs graphs, parameters moved at most kAutoMoves times);
//  - those of a graphed step: the input needs no gradient, nothing is
//    checkpointed, the loss scale is 1, no programs are given;
//  - train_step: no stateful module at all (an eager step carries state on);
//    constant_train_step starts and ends from reset state either way;
//  - the key holds the loss function's type (and a plain function's
//    address): another loss is another graph. What a lambda captured is not
//    seen: a loss that reads host values changing between steps needs
//    auto_cuda_graphs(false), as does a stage that reads host state;
//  - the caching allocator holds at most half the device's memory when the
//    capture starts (room_for_capture): a graph keeps its own copy of the
//    step's activations, which eager work after it (the optimizer) cannot use.
// The key runs eagerly twice (worker threads as configured), then once more
// inline (the warm-up of run_graphed_step), is captured at its fourth call
// and replayed from then on. A capture that fails runs that step eagerly,
// and its key stays eager. Steps under autocast with mpipe::Linear keep their
// per-step sums of cast gradients (Note [Cast gradients per step]): the
// bf16 copy of each weight, its accumulation and the one addition to .grad
// are device work like any other, captured and replayed.
constexpr int kAutoStepEagerRuns = 2;

MPIPE_FUNC GraphPolicy::AutoGraph& GraphPolicy::seen(const std::string& key) {
  if (auto_graphs_.size() >= 256 && auto_graphs_.count(key) == 0) auto_graphs_.clear();  // many shapes
  return auto_graphs_[key];
}

MPIPE_FUNC at::Tensor GraphPolicy::replay_step(ModelPipelineImpl& pipeline, const std::string& key,
                                               const std::vector<at::Tensor>& params,
                                               const at::Tensor& x, const at::Tensor& target,
                                               const EagerStep& eager, bool failure_throws) {
  PlainDraws plain;  // a replay draws what its capture drew (Note [Random draws])
  at::Tensor loss = run_graphed_step(
      *cache_, key, {x, target}, params,
      [&](const std::vector<at::Tensor>& in) { return eager(in[0], in[1], /*threaded=*/false); },
      [&pipeline] { reset_states(pipeline); }, failure_throws);
  if (loss.defined()) reset_states(pipeline);  // Note [CUDA graphs]: state does not outlive a graphed call
  return loss;
}

MPIPE_FUNC at::Tensor GraphPolicy::step(ModelPipelineImpl& pipeline, const Stages& stages,
                                        const GraphKey& key, const at::Tensor& x,
                                        const at::Tensor& target, const EagerStep& eager) {
  const ModelPipelineOptions& o = pipeline.options;
  const bool automatic = !o.cuda_graphs();
  if ((automatic && (!o.auto_cuda_graphs() || o.process_group().defined() || o.track_memory())) ||
      x.requires_grad() || (pipeline.is_training() && o.checkpoint() != Checkpoint::Never) ||
      (target.defined() && target.device() != x.device())) {
    return {};  // input gradients leave the graph; a recompute is not captured
  }
  {
    // could_graph's rules apart from grad mode (it also refuses while a
    // timeline is recorded).
    c10::NoGradGuard no_grad;
    if (!could_graph(pipeline, stages, x)) return {};
  }
  const std::string k = graph_key(pipeline, key);
  const std::vector<at::Tensor> params = pipeline.parameters();
  if (!automatic) return replay_step(pipeline, k, params, x, target, eager, /*failure_throws=*/true);
  if (key.method == "train_step") {
    for (const auto& stage : stages.stateful) {
      if (!stage.empty()) return {};  // an eager train_step carries state to the next
    }
  }
  AutoGraph& s = seen(k);
  const Held held = holds_step(*cache_, k, params);
  if (held == Held::Moved && ++s.moved > kAutoMoves) s.refused = true;
  if (s.refused) return {};
  if (held != Held::Held) {
    if (s.eager_runs < kAutoStepEagerRuns) {
      const uint64_t draws = draws_seen();
      at::Tensor loss = eager(x, target, o.worker_threads());
      if (draws_seen() != draws) s.refused = true;
      ++s.eager_runs;
      return loss;
    }
    if (graphs_held(*cache_) >= kMaxAutoGraphs || !room_for_capture(x.device())) return {};
  }
  // Undefined: the capture failed (the key stays eager), or the step must run
  // eagerly this time (Note [Graphed training steps]).
  return replay_step(pipeline, k, params, x, target, eager, /*failure_throws=*/false);
}

MPIPE_FUNC void GraphPolicy::drop() {
  if (cache_) cache_ = make_graph_cache();
  auto_graphs_.clear();
}

}  // namespace detail

}  // namespace mpipe
