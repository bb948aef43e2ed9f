#pragma once

#include "mpipe/detail/config.h"

// The forward-type calls: forward, constant_forward, sequence_forward (the
// services every call kind uses are in session-inl.h).

#include "mpipe/detail/pipeline/pipeline_state.h"

#include "mpipe/detail/distributed/group.h"
#include "mpipe/detail/cuda/device_probe.h"
#include "mpipe/detail/runtime/rng.h"
#include "mpipe/detail/runtime/scatter.h"
#include "mpipe/detail/runtime/streams.h"

#include "mpipe/state.h"

#include <algorithm>

#include <ATen/Functions.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace mpipe {

using detail::CallSpec;
using detail::GraphKey;

namespace detail {

MPIPE_FUNC GraphKey key_of(const char* method, int64_t items, bool reduce, const at::Tensor& x,
                           bool training, int64_t chunk = 0) {
  GraphKey key;
  key.method = method;
  key.items = items;
  key.chunk = chunk;
  key.reduce = reduce;
  key.input_sizes = x.sizes().vec();
  key.input_dtype = x.scalar_type();
  key.training = training;
  return key;
}

/// Results handed to the caller: usable on its current streams.
MPIPE_FUNC Tensors for_caller(Tensors out) {
  for (const auto& t : out) detail::record_on_current(t);
  return out;
}

}  // namespace detail

MPIPE_FUNC Tensors ModelPipelineImpl::State::forward_items(const std::vector<Input>& in,
                                                           int64_t rows, int64_t batch,
                                                           bool threaded,
                                                           detail::RemoteCall* remote) {
  const int64_t n_stages = executor.n_total();
  CallSpec spec;
  spec.method = "forward";
  spec.item_name = "micro-batch";
  spec.n_items = (batch - 1) / rows + 1;  // rows may be huge
  spec.micro_batched = true;
  spec.programs = schedules::forward_only(spec.n_items, n_stages);
  spec.source = [&](int64_t i) { return detail::micro_batch(in, i, rows, batch); };
  spec.caller_tensors = detail::tensors_of(in);
  spec.remote = remote;
  std::vector<Tensors> outs(static_cast<size_t>(spec.n_items));
  spec.sink = [&](int64_t i, Tensors o) { outs[static_cast<size_t>(i)] = std::move(o); };
  const int64_t lanes = self.options.lanes();
  TORCH_CHECK(lanes >= 1, "mpipe::ModelPipeline::forward: ModelPipelineOptions::lanes must be at "
              "least 1, got ", lanes);
  if (lanes > 1 && !remote) {  // Note [Lanes]: stages that keep no state
    spec.lanes = lanes;
    for (size_t j = 0; j < stateful.size(); ++j) {
      spec.lane_stages.push_back(stateful[j].empty() && stages[j]->buffers().empty());
    }
  }
  execute(spec, threaded);
  if (remote && !remote->last()) return {};
  return detail::for_caller(
      detail::gather("forward", "micro-batch", n_stages - 1, outs, false, true));
}

MPIPE_FUNC Tensors ModelPipelineImpl::State::forward(const std::vector<Input>& inputs,
                                                     int64_t split_size, bool graphable_call) {
  if (distributed()) {
    return guarded("forward", [&] {
      return across("forward", [&](detail::RemoteCall& call) {
        const auto info = agree(call, "forward", [&] {
          detail::CallInfo c;
          c.batch = detail::split_batch("forward", inputs);
          detail::check_split("forward", split_size);
          c.rows = split_size;
          c.n_items = (c.batch - 1) / split_size + 1;
          return c;
        });
        return forward_items(call.first() ? inputs : std::vector<Input>{}, info.rows, info.batch,
                             self.options.worker_threads(), &call);
      });
    });
  }
  const int64_t batch = detail::split_batch("forward", inputs);
  detail::check_split("forward", split_size);
  auto eager = [&](const std::vector<Input>& in, bool threaded) {
    return forward_items(in, split_size, batch, threaded, nullptr);
  };
  return guarded("forward", [&]() -> Tensors {
    if (graphable_call && graphable(inputs[0].tensor)) {
      at::Tensor out = graphed_or_eager(
          detail::key_of("forward", split_size, false, inputs[0].tensor, self.is_training()),
          inputs[0].tensor, [&](const at::Tensor& x, bool threaded) {
            return detail::one_output("forward", eager({x}, threaded));
          });
      if (out.defined()) return {out};
    }
    return eager(inputs, self.options.worker_threads());
  });
}

// Note [Time chunks]
// ~~~~~~~~~~~~~~~~~~
// With multi-step stages (ModelPipelineOptions::step_mode(Multi), or a
// time_chunk given to the call) the items that flow through the stages are
// chunks of k consecutive time steps, time-major [k, N, ...], not single
// steps: each stage call runs k steps at once (stateless layers on [k*N, ...]
// through SeqToANN, neurons as one fused multi-step kernel), so a stage makes
// T/k calls instead of T, while chunks still overlap across stages as steps
// do. k = 1 pipelines every step (most overlap, most calls); k >= T is one
// chunk (no overlap over time). The last chunk may be shorter. State carries
// from chunk to chunk as it does from step to step, and the outputs are cut
// back into steps (and summed step by step when reducing), so results do not
// depend on k, except where a layer's result depends on how many rows it
// sees at once: batch statistics (SpikingConvBlock normalises step by step
// in training for this reason), a BLAS that rounds a product over k*N rows
// differently from one over N rows (MKL, cuBLAS: the last bit), and the
// summation order of weight gradients. With ModelPipelineOptions::time_chunk
// 0 the pipeline picks k (resolve_chunk): T on one device, where one chunk
// measured fastest (bench/RESULTS.md, runs H and I).

MPIPE_FUNC int64_t ModelPipelineImpl::State::resolve_chunk(int64_t chunk, int64_t T) const {
  if (chunk != detail::kAutoChunk) return chunk;
  // Measured on one GPU: one chunk of all T steps is fastest, since stages
  // that share a device gain nothing from overlapping. Across devices, about
  // four chunks per device keep each busy (the fill-drain bubble is D - 1 of
  // n + D - 1 items).
  int64_t n_devices = 0;
  if (distributed()) {
    n_devices = static_cast<int64_t>(layout.first.size());
  } else {
    std::vector<c10::Device> seen;
    for (const auto& d : devices) {
      if (std::find(seen.begin(), seen.end(), d) == seen.end()) seen.push_back(d);
    }
    n_devices = static_cast<int64_t>(seen.size());
  }
  if (n_devices <= 1) return T;
  return std::max<int64_t>(1, (T + 4 * n_devices - 1) / (4 * n_devices));
}

MPIPE_FUNC Tensors ModelPipelineImpl::State::run_constant(const char* method, const Tensors& in,
                                                          int64_t T, bool reduce, int64_t chunk,
                                                          bool threaded,
                                                          detail::RemoteCall* remote,
                                                          const std::vector<bool>& batched,
                                                          const std::function<at::Tensor(const Tensors&)>& loss,
                                                          const at::Tensor& target) {
  const int64_t n_stages = executor.n_total();
  const detail::TimeChunks chunks{T, chunk};
  CallSpec spec;
  spec.method = method;
  spec.item_name = chunks.multi() ? "time chunk" : "time step";
  spec.n_items = chunks.count();
  spec.time_chunks = chunks;
  spec.remote = remote;
  spec.programs = loss ? schedules::chained(spec.n_items, n_stages)
                       : schedules::forward_only(spec.n_items, n_stages);
  std::vector<Input> inputs;
  for (size_t k = 0; k < in.size(); ++k) {
    inputs.push_back(k < batched.size() && !batched[k] ? unbatched(in[k]) : Input(in[k]));
  }
  if (chunks.multi()) {
    // Every chunk is the same view unless the last is shorter.
    spec.same_input = T % chunk == 0 || spec.n_items == 1;
    spec.source = [&](int64_t i) { return detail::repeated_chunk(inputs, chunks, i); };
  } else {
    spec.same_input = true;
    spec.source = [&](int64_t) { return in; };
  }
  spec.caller_tensors = in;
  detail::TimeStepOutputs outs(T, reduce, chunks);
  spec.sink = [&](int64_t i, Tensors o) {
    if (chunks.multi()) {
      outs.add_chunk(method, n_stages - 1, i, std::move(o));
    } else {
      outs.add(i, std::move(o));
    }
  };
  if (loss) {
    spec.training = spec.chained = true;
    if (target.defined()) spec.caller_tensors.push_back(target);
    spec.chain_loss = [&] {  // on the last stage, its stream current
      return loss(detail::for_caller(outs.results(method, n_stages - 1, /*stack=*/false)));
    };
  }
  execute(spec, threaded);
  if (remote && !remote->last()) return {};
  if (loss) return {spec.losses.back()};
  return detail::for_caller(outs.results(method, n_stages - 1, /*stack=*/false));
}

MPIPE_FUNC detail::CallInfo ModelPipelineImpl::State::constant_call_info(
    const char* method, const std::vector<Input>& inputs, int64_t T, int64_t chunk) const {
  detail::batch_size(method, inputs, 0);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::", method,
              ": T (the number of time steps) must be positive, got ", T);
  detail::CallInfo c;
  c.n_items = T;
  c.chunk = resolve_chunk(chunk, T);
  return c;
}

MPIPE_FUNC Tensors ModelPipelineImpl::State::constant_forward(const std::vector<Input>& inputs,
                                                              int64_t T, bool reduce, int64_t chunk,
                                                              bool graphable_call) {
  std::vector<bool> batched;
  for (const auto& in : inputs) batched.push_back(in.batched);
  if (distributed()) {
    return guarded("constant_forward", [&] {
      return across("constant_forward", [&](detail::RemoteCall& call) {
        const auto info = agree(call, "constant_forward", [&] {
          detail::CallInfo c = constant_call_info("constant_forward", inputs, T, chunk);
          c.reduce = reduce;
          return c;
        });
        return run_constant("constant_forward",
                            call.first() ? detail::tensors_of(inputs) : Tensors{}, info.n_items,
                            info.reduce != 0, info.chunk, self.options.worker_threads(), &call,
                            batched);
      });
    });
  }
  detail::batch_size("constant_forward", inputs, 0);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::constant_forward: T (the number of time steps) "
              "must be positive, got ", T);
  const Tensors in = detail::tensors_of(inputs);
  chunk = resolve_chunk(chunk, T);
  return guarded("constant_forward", [&]() -> Tensors {
    if (graphable_call && graphable(in[0])) {
      at::Tensor out = graphed_or_eager(
          detail::key_of("constant_forward", T, reduce, in[0], self.is_training(), chunk),
          in[0], [&](const at::Tensor& x, bool threaded) {
            return detail::one_output("constant_forward",
                          run_constant("constant_forward", {x}, T, reduce, chunk, threaded));
          });
      if (out.defined()) return {out};
    }
    return run_constant("constant_forward", in, T, reduce, chunk, self.options.worker_threads(),
                        nullptr, batched);
  });
}

MPIPE_FUNC Tensors ModelPipelineImpl::State::sequence_items(const std::vector<Input>& in, int64_t T,
                                                            bool reduce, int64_t chunk,
                                                            bool threaded,
                                                            detail::RemoteCall* remote) {
  const int64_t n_stages = executor.n_total();
  const detail::TimeChunks chunks{T, chunk};  // Note [Time chunks]
  CallSpec spec;
  spec.method = "sequence_forward";
  spec.item_name = chunks.multi() ? "time chunk" : "time step";
  spec.n_items = chunks.count();
  spec.time_chunks = chunks;
  spec.remote = remote;
  spec.programs = schedules::forward_only(spec.n_items, n_stages);
  spec.source = [&](int64_t i) {
    return chunks.multi() ? detail::sequence_chunk(in, chunks, i) : detail::time_step(in, i);
  };
  spec.caller_tensors = detail::tensors_of(in);
  detail::TimeStepOutputs outs(T, reduce, chunks);
  spec.sink = [&](int64_t i, Tensors o) {
    if (chunks.multi()) {
      outs.add_chunk("sequence_forward", n_stages - 1, i, std::move(o));
    } else {
      outs.add(i, std::move(o));
    }
  };
  execute(spec, threaded);
  if (remote && !remote->last()) return {};
  return detail::for_caller(outs.results("sequence_forward", n_stages - 1, /*stack=*/true));
}

namespace detail {
/// sequence_forward's T, from its inputs (checked).
MPIPE_FUNC int64_t sequence_length(const std::vector<Input>& inputs) {
  const int64_t T = detail::batch_size("sequence_forward", inputs, 0);
  TORCH_CHECK(T != -1, "mpipe::ModelPipeline::sequence_forward: no input is batched; a "
              "batched input is [T, N, ...]");
  detail::batch_size("sequence_forward", inputs, 1);
  TORCH_CHECK(T > 0, "mpipe::ModelPipeline::sequence_forward: the sequence has no time steps "
              "(T = 0)");
  return T;
}
}  // namespace detail

MPIPE_FUNC Tensors ModelPipelineImpl::State::sequence_forward(const std::vector<Input>& inputs,
                                                              bool reduce, int64_t chunk,
                                                              bool graphable_call) {
  if (distributed()) {
    return guarded("sequence_forward", [&] {
      return across("sequence_forward", [&](detail::RemoteCall& call) {
        const auto info = agree(call, "sequence_forward", [&] {
          detail::CallInfo c;
          c.n_items = detail::sequence_length(inputs);
          c.reduce = reduce;
          c.chunk = resolve_chunk(chunk, c.n_items);
          return c;
        });
        return sequence_items(call.first() ? inputs : std::vector<Input>{}, info.n_items,
                              info.reduce != 0, info.chunk, self.options.worker_threads(), &call);
      });
    });
  }
  const int64_t T = detail::sequence_length(inputs);
  chunk = resolve_chunk(chunk, T);
  auto eager = [&](const std::vector<Input>& in, bool threaded) {
    return sequence_items(in, T, reduce, chunk, threaded, nullptr);
  };
  return guarded("sequence_forward", [&]() -> Tensors {
    if (graphable_call && graphable(inputs[0].tensor)) {
      at::Tensor out =
          graphed_or_eager(detail::key_of("sequence_forward", 0, reduce, inputs[0].tensor,
                                              self.is_training(), chunk),
                           inputs[0].tensor, [&](const at::Tensor& x, bool threaded) {
                             return detail::one_output("sequence_forward", eager({x}, threaded));
                           });
      if (out.defined()) return {out};
    }
    return eager(inputs, self.options.worker_threads());
  });
}

}  // namespace mpipe
