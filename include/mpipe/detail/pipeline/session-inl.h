#pragma once

#include "mpipe/detail/config.h"

// What every call kind of a pipeline uses around the executor (its session):
// the layout and agreement across processes, the executor run with the
// timeline recorded, the CUDA-graph dispatch, and the memory watch. The call
// prologue itself (lock, memory watch, rollback) is State::guarded, and a
// call across processes State::across (pipeline_state.h).

#include "mpipe/detail/pipeline/pipeline_state.h"

#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/cuda/device_probe.h"
#include "mpipe/detail/precision/autocast.h"
#include "mpipe/detail/runtime/programs.h"
#include "mpipe/detail/runtime/rng.h"
#include "mpipe/detail/runtime/scatter.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/simulate.h"
#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

namespace mpipe {


MPIPE_FUNC ModelPipelineImpl::State::State(ModelPipelineImpl& owner)
    : self(owner),
      stages(owner.register_module("stages", torch::nn::ModuleList())),
      graphs(detail::make_graph_cache()) {}

// Note [Plan, then run]
// ~~~~~~~~~~~~~~~~~~~~~
// Every call kind is data (CallKind): how to check and describe a call from
// its inputs and options (describe: a CallInfo, the same on every rank
// across processes), what every rank checks given that description (check),
// and a plan (plan: the executor's CallSpec, with the items, the programs,
// where inputs come from and outputs go, and how to hand results back). One
// session, run_call, runs any kind: the call prologue (guarded), across
// processes the first rank's description told to every rank, else a CUDA
// graph's replay where the call allows one, and the plan through the
// executor (run_plan: the timeline recorded around it). So a public method
// checks its arguments and names its kind; the kinds, with their describe,
// check and plan steps, are in calls-inl.h (the forward-type calls) and
// train_steps-inl.h (the training steps).

namespace detail {
/// Sets a flag for its lifetime.
struct ScopedFlag {
  bool& on;
  explicit ScopedFlag(bool& flag) : on(flag) { on = true; }
  ~ScopedFlag() { on = false; }
  ScopedFlag(const ScopedFlag&) = delete;
  ScopedFlag& operator=(const ScopedFlag&) = delete;
};

/// The key of a graphed call: what its capture depends on.
MPIPE_FUNC detail::GraphKey key_of(const char* method, const CallInfo& info, const at::Tensor& x,
                           const at::Tensor& target, bool training) {
  detail::GraphKey key;
  key.method = method;
  key.items = info.n_items;
  key.rows = info.rows;
  key.reduce = info.reduce != 0;
  key.chunk = info.chunk;
  if (std::string(method) == "train_step") {
    key.schedule = static_cast<int>(info.schedule);
    key.reduction = static_cast<int>(info.reduction);
  }
  key.input_sizes = x.sizes().vec();
  key.input_dtype = x.scalar_type();
  if (target.defined()) {
    key.target_sizes = target.sizes().vec();
    key.target_dtype = target.scalar_type();
  }
  key.training = training;
  key.inference = c10::InferenceMode::is_enabled();
  return key;
}
}  // namespace detail

MPIPE_FUNC Tensors ModelPipelineImpl::State::run_call(const CallKind& kind,
                                                      const std::vector<Input>& inputs,
                                                      const at::Tensor& target) {
  RECORD_USER_SCOPE(std::string("mpipe::") + kind.method);  // the call, for profilers
  const bool threaded = self.options.worker_threads();
  // State does not outlive a constant_train_step, whatever happens. The
  // rollback (guarded) is set up before, so a failed step ends with the state
  // of its start, not reset (Note [State snapshots]).
  struct FreshState {
    torch::nn::Module& m;
    bool after;
    FreshState(torch::nn::Module& module, bool before, bool after_) : m(module), after(after_) {
      if (before || after) reset_states(m);
    }
    ~FreshState() {
      if (after) reset_states(m);
    }
  };
  if (distributed()) {
    return guarded(kind.method, [&] {
      FreshState fresh(self, kind.reset_first, kind.fresh_state);
      return across(kind.method, [&](detail::RemoteCall& call) {
        const detail::CallInfo info = agree(call, kind.method, kind.describe);
        if (kind.check) kind.check(info, &call);
        const std::vector<Input> none;
        return run_plan(kind.plan(info, call.first() ? inputs : none,
                                  call.last() ? target : at::Tensor(), &call),
                        threaded);
      });
    });
  }
  const detail::CallInfo info = kind.describe();
  return guarded(kind.method, [&]() -> Tensors {
    FreshState fresh(self, kind.reset_first, kind.fresh_state);
    if (kind.check) kind.check(info, nullptr);
    if (kind.graphable && inputs.size() == 1) {
      const at::Tensor& x = inputs[0].tensor;
      const detail::GraphKey key = detail::key_of(kind.method, info, x, target, self.is_training());
      auto eager = [&](const at::Tensor& xg, const at::Tensor& yg, bool th) {
        return detail::one_output(kind.method, run_plan(kind.plan(info, {Input(xg)}, yg, nullptr), th));
      };
      if (kind.step) return {run_step(key, x, target, eager)};
      auto no_target = [&](const at::Tensor& xg, bool th) { return eager(xg, at::Tensor(), th); };
      if (graphable(x)) {
        at::Tensor out = graphed_or_eager(graph_key(key), watched_tensors(), x, no_target);
        if (out.defined()) return {out};
      } else if (auto_graphable(x)) {
        return {auto_graphed(key, x, no_target)};
      }
    }
    return run_plan(kind.plan(info, inputs, target, nullptr), threaded);
  });
}

MPIPE_FUNC Tensors ModelPipelineImpl::State::run_plan(Plan plan, bool threaded) {
  {
    RECORD_USER_SCOPE("mpipe::execute");
    execute(plan.spec, threaded);
  }
  RECORD_USER_SCOPE("mpipe::results");
  return plan.results(plan.spec);
}

MPIPE_FUNC std::string ModelPipelineImpl::State::connect(const char* method) {
  const auto& group = self.options.process_group();
  const auto n_local = static_cast<int64_t>(devices.size());
  if (connected_stages == n_local) return {};
  if (connected_stages >= 0) {  // told to every rank through the call (across())
    return c10::str("mpipe::ModelPipeline::", method, ": rank ", group.rank(), " appended ",
                    n_local - connected_stages, " stage(s) after the pipeline's first call across "
                    "processes (it held ", connected_stages, ", now ", n_local,
                    "); append every stage before the first call");
  }
  // Every rank takes part, one with no stage too, so that all of them hear
  // which rank is wrong instead of waiting for it.
  if (pipeline_id < 0) pipeline_id = detail::next_pipeline_id(group);
  const auto counts = detail::exchange_stage_counts(group, pipeline_id, n_local);
  detail::Layout l;
  int64_t first = 0;
  std::string empty;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] <= 0) {
      empty += c10::str(empty.empty() ? "" : ", ", "rank ",
                        detail::group_impl(group)->world_rank(static_cast<int64_t>(p)),
                        " (pipeline rank ", p, ")");
    }
    l.first.push_back(first);
    first += counts[p];
  }
  TORCH_CHECK(empty.empty(), "mpipe::ModelPipeline::", method, ": ", empty,
              " holds no stage; every rank appends its stages (ProcessGroup::stage_range) "
              "before the first call");
  l.n_stages = first;
  layout = l;
  executor.set_layout(l.first[static_cast<size_t>(group.pipeline_rank())], l.n_stages,
                      c10::str(", rank ", group.rank()));
  connected_stages = n_local;
  return {};
}

MPIPE_FUNC detail::CallInfo ModelPipelineImpl::State::agree(
    detail::RemoteCall& call, const char* method, const std::function<detail::CallInfo()>& make) {
  if (!call.first()) return call.await_call(method);
  detail::CallInfo info = make();
  info.method = detail::method_code(method);
  call.announce(info);
  return info;
}

MPIPE_FUNC void ModelPipelineImpl::State::execute(detail::CallSpec& spec, bool threaded) {
  std::shared_ptr<detail::Recorder> recorder;
  if (self.options.record_timeline() && !spec.remote) {  // one process's stages only (docs/distributed.md)
    // The schedule's idle fraction with unit costs, training or not (forward
    // programs give the fill-drain (n - 1) / (m + n - 1)).
    recorder = start_recording(spec.method, spec.item_name, spec.n_items,
                               schedules::bubble(spec.programs));
    if (spec.training) recorder->describe_schedule(spec.schedule, detail::stage_ranks(spec.programs));
  }
  spec.recorder = recorder.get();
  executor.run(spec, forwards, threaded);
  if (recorder) pending_timeline = recorder;
}

MPIPE_FUNC bool ModelPipelineImpl::State::could_graph(const at::Tensor& x) const {
  if (!graphs || c10::GradMode::is_enabled() || !x.is_cuda() || self.options.record_timeline()) {
    return false;  // a replay has no tasks to record (Note [Timeline])
  }
  for (const auto& d : devices) {
    if (d != x.device()) return false;  // one device per graph (at::cuda::CUDAGraph)
  }
  for (const auto& stage : stateful) {
    for (const auto& m : stage) {
      if (m.state->holds_state()) return false;
    }
  }
  return true;
}

MPIPE_FUNC bool ModelPipelineImpl::State::graphable(const at::Tensor& x) const {
  return self.options.cuda_graphs() && could_graph(x);
}

MPIPE_FUNC bool ModelPipelineImpl::State::auto_graphable(const at::Tensor& x) const {
  if (!self.options.auto_cuda_graphs() || self.options.cuda_graphs() || distributed() ||
      self.options.track_memory() || !could_graph(x)) {
    return false;  // (a replay allocates nothing: a memory report would show another call)
  }
  for (const auto& stage : stateful) {
    if (!stage.empty()) return false;  // a graph would reset the state a call carries
  }
  // A module in training mode that holds buffers (BatchNorm) updates them in
  // every call: the capturing call's warm-up would update them twice.
  for (const auto& m : self.modules(/*include_self=*/false)) {
    if (m->is_training() && !m->buffers(/*recurse=*/false).empty()) return false;
  }
  return true;
}

MPIPE_FUNC std::string ModelPipelineImpl::State::graph_key(const detail::GraphKey& key) const {
  // A capture fixes each module's branch on its training flag: a stage put
  // in eval (or train) mode on its own is another graph.
  std::string modes;
  for (const auto& m : self.modules(/*include_self=*/false)) modes += m->is_training() ? '1' : '0';
  return key.str() + "|" + modes;
}

MPIPE_FUNC std::vector<at::Tensor> ModelPipelineImpl::State::watched_tensors() const {
  std::vector<at::Tensor> watched = self.parameters();
  for (auto& b : self.buffers()) watched.push_back(std::move(b));
  return watched;
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::graphed_or_eager(
    const std::string& key, const std::vector<at::Tensor>& watched, const at::Tensor& x,
    const std::function<at::Tensor(const at::Tensor&, bool)>& eager) {
  detail::PlainDraws plain;  // a replay draws what its capture drew (Note [Random draws])
  detail::ScopedFlag graph_run(in_graph_run);  // lanes(0) means 2 lanes in a graph (calls-inl.h)
  at::Tensor out = detail::run_graphed(
      *graphs, key, x, watched,
      [&](const at::Tensor& in) { return eager(in, /*threaded=*/false); },
      [this] { reset_states(self); });
  if (out.defined()) reset_states(self);  // Note [CUDA graphs]: state does not outlive a graphed call
  return out;  // undefined: the cache is full, run eagerly
}

// Note [Automatic CUDA graphs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Inference calls that repeat are bound by the host's launches when their
// kernels are small (narrow-mlp: eager 5-6.7 ms, its replay with 2 lanes
// 2.8 ms, bench/RESULTS.md), so with ModelPipelineOptions::auto_cuda_graphs
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

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::auto_graphed(
    const detail::GraphKey& key, const at::Tensor& x,
    const std::function<at::Tensor(const at::Tensor&, bool)>& eager) {
  const std::string k = graph_key(key);
  const std::vector<at::Tensor> watched = watched_tensors();
  const detail::Held held = detail::holds_graph(*graphs, k, watched);
  // An eager call takes its seed from the CPU generator (Note [Random draws]);
  // a replayed one takes it too, so that later draws do not tell them apart.
  auto as_eager_draws = [this] { (void)detail::CallRng::begin(devices); };
  if (held == detail::Held::Held) {
    as_eager_draws();
    return graphed_or_eager(k, watched, x, eager);
  }
  if (auto_graphs.size() >= 256 && auto_graphs.count(k) == 0) auto_graphs.clear();  // many shapes
  AutoGraph& seen = auto_graphs[k];
  if (held == detail::Held::Moved && ++seen.moved > kAutoMoves) seen.refused = true;
  if (!seen.refused && seen.eager_runs >= kAutoEagerRuns &&
      detail::graphs_held(*graphs) < kMaxAutoGraphs) {
    try {
      at::Tensor out = graphed_or_eager(k, watched, x, eager);
      if (out.defined()) {
        as_eager_draws();
        return out;
      }
    } catch (const std::exception&) {
      seen.refused = true;  // the capture failed: this key runs eagerly from now on
    }
  }
  const uint64_t draws = detail::draws_seen();
  at::Tensor out = eager(x, self.options.worker_threads());
  if (detail::draws_seen() != draws) seen.refused = true;
  ++seen.eager_runs;
  return out;
}

MPIPE_FUNC bool ModelPipelineImpl::State::step_graphable(const at::Tensor& x,
                                                         const at::Tensor& target) const {
  if (x.requires_grad() || (self.is_training() && self.options.checkpoint() != Checkpoint::Never)) {
    return false;  // input gradients leave the graph; a recompute is not captured
  }
  if (target.defined() && target.device() != x.device()) return false;
  // graphable()'s rules apart from grad mode (it also refuses while a timeline
  // is recorded).
  c10::NoGradGuard no_grad;
  return graphable(x);
}

// Note [Graphs or summed casts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A graphed training step keeps autograd's way with cast weights: every
// micro-batch converts its weight gradient to float32 and adds it on its own
// (the per-step sum of Note [Cast gradients per step] is not captured). Under
// autocast with mpipe::Linear stages, the eager step sums them in bf16
// instead, and that saves more than a replay does: measured on an H200,
// wide-mlp-bf16-linear's graphed step took 60.6 ms against 49.3 ms eager
// (issue 33). So such a step runs eagerly, cuda_graphs or not (46.38 against
// 46.36 ms after, bench/RESULTS.md), unless accumulate_cast_grads is off.
MPIPE_FUNC bool ModelPipelineImpl::State::casts_beat_graphs(const at::Tensor& x) const {
  if (!self.options.accumulate_cast_grads() || !cast_linears) return false;
  const auto autocast = detail::AutocastState::current();
  return x.is_cuda() ? autocast.cuda : autocast.cpu;
}

MPIPE_FUNC at::Tensor ModelPipelineImpl::State::run_step(
    const detail::GraphKey& key, const at::Tensor& x, const at::Tensor& target,
    const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>& eager) {
  if (self.options.cuda_graphs() && step_graphable(x, target) && !casts_beat_graphs(x)) {
    detail::PlainDraws plain;  // a replay draws what its capture drew (Note [Random draws])
    // Graphed steps keep autograd's accumulation (Note [Cast gradients per step]).
    detail::ScopedFlag graphed(in_graphed_step);
    at::Tensor loss = detail::run_graphed_step(
        *graphs, graph_key(key), {x, target}, self.parameters(),
        [&](const std::vector<at::Tensor>& in) { return eager(in[0], in[1], /*threaded=*/false); },
        [this] { reset_states(self); });
    if (loss.defined()) {
      reset_states(self);  // Note [CUDA graphs]: state does not outlive a graphed call
      return loss;
    }
  }
  return eager(x, target, self.options.worker_threads());
}

MPIPE_FUNC void ModelPipelineImpl::State::drop_graphs() {
  if (graphs) graphs = detail::make_graph_cache();
  auto_graphs.clear();
}

MPIPE_FUNC std::shared_ptr<detail::Recorder> ModelPipelineImpl::State::start_recording(
    const char* method, const char* item_name, int64_t n_items, double bubble) const {
  return std::make_shared<detail::Recorder>(method, item_name, n_items, devices, bubble);
}

MPIPE_FUNC void ModelPipelineImpl::State::begin_memory_watch() {
  if (!self.options.track_memory()) return;
  memory_counters.clear();
  for (const auto& d : devices) {
    bool seen = false;
    for (const auto& c : memory_counters) seen |= c.device == d;
    if (!d.is_cuda() || seen) continue;
    detail::reset_allocator_peak(d);
    memory_counters.push_back({d, detail::allocator_counters(d).allocated, -1});
  }
}

MPIPE_FUNC void ModelPipelineImpl::State::end_memory_watch(const char* method) {
  if (!self.options.track_memory()) return;
  for (auto& c : memory_counters) c.peak = detail::allocator_counters(c.device).peak;
  memory_call = method;
}

}  // namespace mpipe
