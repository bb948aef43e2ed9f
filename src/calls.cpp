// The forward-type calls (forward, constant_forward, sequence_forward) and the
// prologue and graph dispatch every call kind shares.

#include "pipeline_state.h"

#include "device_probe.h"
#include "rng.h"
#include "scatter.h"
#include "streams.h"

#include "mpipe/state.h"

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace mpipe {

using detail::CallSpec;
using detail::GraphKey;

ModelPipelineImpl::State::State(ModelPipelineImpl& owner)
    : self(owner),
      stages(owner.register_module("stages", torch::nn::ModuleList())),
      graphs(detail::make_graph_cache()) {}

namespace {

void check_split(const char* method, int64_t split_size) {
  TORCH_CHECK(split_size > 0, "mpipe::ModelPipeline::", method,
              ": split_size must be positive, got ", split_size);
}

/// The one output of a call whose Tensor overload was used.
at::Tensor single(const char* method, Tensors out) {
  TORCH_CHECK(out.size() == 1, "mpipe::ModelPipeline::", method, ": the last stage returned ",
              out.size(), " tensors; call the overload that takes std::vector<mpipe::Input> "
              "and returns mpipe::Tensors");
  return std::move(out[0]);
}

GraphKey key_of(const char* method, int64_t items, bool reduce, const at::Tensor& x,
                bool training) {
  GraphKey key;
  key.method = method;
  key.items = items;
  key.reduce = reduce;
  key.input_sizes = x.sizes().vec();
  key.input_dtype = x.scalar_type();
  key.training = training;
  return key;
}

/// Results handed to the caller: usable on its current streams.
Tensors for_caller(Tensors out) {
  for (const auto& t : out) detail::record_on_current(t);
  return out;
}

}  // namespace

Tensors ModelPipelineImpl::State::forward(const std::vector<Input>& inputs, int64_t split_size,
                                          bool graphable_call) {
  const int64_t batch = detail::split_batch("forward", inputs);
  check_split("forward", split_size);
  auto eager = [&](const std::vector<Input>& in, bool threaded) {
    CallSpec spec;
    spec.method = "forward";
    spec.item_name = "micro-batch";
    spec.n_items = (batch - 1) / split_size + 1;  // split_size may be huge
    spec.micro_batched = true;
    spec.programs = schedules::forward_only(spec.n_items, static_cast<int64_t>(devices.size()));
    spec.source = [&](int64_t i) { return detail::micro_batch(in, i, split_size, batch); };
    spec.caller_tensors = detail::tensors_of(in);
    std::vector<Tensors> outs(static_cast<size_t>(spec.n_items));
    spec.sink = [&](int64_t i, Tensors o) { outs[static_cast<size_t>(i)] = std::move(o); };
    execute(spec, threaded);
    return for_caller(detail::gather("forward", "micro-batch",
                                     static_cast<int64_t>(devices.size()) - 1, outs, false, true));
  };
  return guarded("forward", [&]() -> Tensors {
    if (graphable_call && graphable(inputs[0].tensor)) {
      at::Tensor out = graphed_or_eager(
          key_of("forward", split_size, false, inputs[0].tensor, self.is_training()),
          inputs[0].tensor, [&](const at::Tensor& x, bool threaded) {
            return single("forward", eager({x}, threaded));
          });
      if (out.defined()) return {out};
    }
    return eager(inputs, self.options.worker_threads());
  });
}

Tensors ModelPipelineImpl::State::run_constant(const char* method, const Tensors& in, int64_t T,
                                               bool reduce, bool threaded,
                                               detail::BackwardPositions* positions) {
  CallSpec spec;
  spec.method = method;
  spec.item_name = "time step";
  spec.n_items = T;
  spec.programs = schedules::forward_only(T, static_cast<int64_t>(devices.size()));
  spec.same_input = true;
  spec.source = [&](int64_t) { return in; };
  spec.caller_tensors = in;
  spec.backward_positions = positions;
  detail::TimeStepOutputs outs(T, reduce);
  spec.sink = [&](int64_t t, Tensors o) { outs.add(t, std::move(o)); };
  execute(spec, threaded);
  if (reduce) return for_caller(outs.steps()[0]);
  return for_caller(detail::gather(method, "time step", static_cast<int64_t>(devices.size()) - 1,
                                   outs.steps(), false, false));
}

Tensors ModelPipelineImpl::State::constant_forward(const std::vector<Input>& inputs, int64_t T,
                                                   bool reduce, bool graphable_call) {
  detail::batch_size("constant_forward", inputs, 0);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::constant_forward: T (the number of time steps) "
              "must be positive, got ", T);
  const Tensors in = detail::tensors_of(inputs);
  return guarded("constant_forward", [&]() -> Tensors {
    if (graphable_call && graphable(in[0])) {
      at::Tensor out = graphed_or_eager(
          key_of("constant_forward", T, reduce, in[0], self.is_training()), in[0],
          [&](const at::Tensor& x, bool threaded) {
            return single("constant_forward",
                          run_constant("constant_forward", {x}, T, reduce, threaded));
          });
      if (out.defined()) return {out};
    }
    return run_constant("constant_forward", in, T, reduce, self.options.worker_threads());
  });
}

Tensors ModelPipelineImpl::State::sequence_forward(const std::vector<Input>& inputs, bool reduce,
                                                   bool graphable_call) {
  const int64_t T = detail::batch_size("sequence_forward", inputs, 0);
  TORCH_CHECK(T != -1, "mpipe::ModelPipeline::sequence_forward: no input is batched; a "
              "batched input is [T, N, ...]");
  detail::batch_size("sequence_forward", inputs, 1);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::sequence_forward: the sequence has no time steps "
              "(T = 0)");
  auto eager = [&](const std::vector<Input>& in, bool threaded) {
    CallSpec spec;
    spec.method = "sequence_forward";
    spec.item_name = "time step";
    spec.n_items = T;
    spec.programs = schedules::forward_only(T, static_cast<int64_t>(devices.size()));
    spec.source = [&](int64_t t) { return detail::time_step(in, t); };
    spec.caller_tensors = detail::tensors_of(in);
    detail::TimeStepOutputs outs(T, reduce);
    spec.sink = [&](int64_t t, Tensors o) { outs.add(t, std::move(o)); };
    execute(spec, threaded);
    if (reduce) return for_caller(outs.steps()[0]);
    return for_caller(detail::gather("sequence_forward", "time step",
                                     static_cast<int64_t>(devices.size()) - 1, outs.steps(), true,
                                     false));
  };
  return guarded("sequence_forward", [&]() -> Tensors {
    if (graphable_call && graphable(inputs[0].tensor)) {
      at::Tensor out = graphed_or_eager(
          key_of("sequence_forward", 0, reduce, inputs[0].tensor, self.is_training()),
          inputs[0].tensor, [&](const at::Tensor& x, bool threaded) {
            return single("sequence_forward", eager({x}, threaded));
          });
      if (out.defined()) return {out};
    }
    return eager(inputs, self.options.worker_threads());
  });
}

void ModelPipelineImpl::State::execute(CallSpec& spec, bool threaded) {
  std::shared_ptr<detail::Recorder> recorder;
  if (self.options.record_timeline()) {
    recorder = start_recording(
        spec.method, spec.item_name, spec.n_items,
        spec.training ? schedules::bubble(spec.programs)
                      : schedules::fill_drain_bubble(spec.n_items,
                                                     static_cast<int64_t>(devices.size())));
    if (spec.training) recorder->describe_schedule(spec.schedule, schedules::stage_ranks(spec.programs));
  }
  spec.recorder = recorder.get();
  executor.run(spec, forwards, threaded);
  if (recorder) pending_timeline = recorder;
}

bool ModelPipelineImpl::State::graphable(const at::Tensor& x) const {
  if (!self.options.cuda_graphs() || !graphs || c10::GradMode::is_enabled() || !x.is_cuda() ||
      self.options.record_timeline()) {
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

at::Tensor ModelPipelineImpl::State::graphed_or_eager(
    const GraphKey& key, const at::Tensor& x,
    const std::function<at::Tensor(const at::Tensor&, bool)>& eager) {
  detail::PlainDraws plain;  // a replay draws what its capture drew (Note [Random draws])
  at::Tensor out = detail::run_graphed(
      *graphs, key.str(), x, [&](const at::Tensor& in) { return eager(in, /*threaded=*/false); },
      [this] { reset_states(self); });
  if (out.defined()) reset_states(self);  // Note [CUDA graphs]: state does not outlive a graphed call
  return out;  // undefined: the cache is full, run eagerly
}

void ModelPipelineImpl::State::drop_graphs() {
  if (graphs) graphs = detail::make_graph_cache();
}

std::shared_ptr<detail::Recorder> ModelPipelineImpl::State::start_recording(
    const char* method, const char* item_name, int64_t n_items, double bubble) const {
  return std::make_shared<detail::Recorder>(method, item_name, n_items, devices, bubble);
}

void ModelPipelineImpl::State::begin_memory_watch() {
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

void ModelPipelineImpl::State::end_memory_watch(const char* method) {
  if (!self.options.track_memory()) return;
  for (auto& c : memory_counters) c.peak = detail::allocator_counters(c.device).peak;
  memory_call = method;
}

}  // namespace mpipe
