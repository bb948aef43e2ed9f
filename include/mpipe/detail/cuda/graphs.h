#pragma once

// Private: CUDA-graph capture and replay of whole pipeline calls (Note [CUDA
// graphs]). Compiled only against a CUDA build of LibTorch; with a CPU-only
// LibTorch, make_graph_cache() returns null and nothing is graphed.

#include "mpipe/detail/precision/autocast.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/StringUtil.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mpipe {
namespace detail {

class GraphCache;

/// What a captured graph is for: a call kind with its arguments and the
/// shapes and dtypes it saw. Calls with equal keys replay one graph.
struct GraphKey {
  std::string method;
  int64_t items = 0;       // micro-batches (forward, train_step) or T
  int64_t rows = 0;        // rows per micro-batch (0: one)
  bool reduce = false;     // constant_forward, sequence_forward
  int64_t time_chunk = 0;  // their steps per stage call (0: single steps)
  int schedule = -1;       // train_step: Schedule
  int64_t virtual_stages = 1;  // train_step: stages per worker (interleaved)
  int reduction = -1;      // train_step: LossReduction
  int64_t programs = 0;    // train_step under Tailored: its programs' fingerprint
  std::vector<int64_t> input_sizes;
  c10::ScalarType input_dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> target_sizes;
  c10::ScalarType target_dtype = c10::ScalarType::Undefined;
  bool training = false;   // the module's mode
  bool inference = false;  // c10::InferenceMode: its tensors cannot be updated outside it
  std::string autocast = AutocastState::current().str();  // the caller's autocast state
  std::string loss;        // training steps: which loss function (loss_identity)

  std::string str() const {
    return c10::str(method, "|", items, "|", rows, "|", reduce, "|", time_chunk, "|", schedule,
                    "|", virtual_stages, "|", reduction, "|", programs, "|",
                    c10::IntArrayRef(input_sizes), "|", input_dtype, "|",
                    c10::IntArrayRef(target_sizes), "|", target_dtype,
                    training ? "|train" : "|eval", inference ? "|inference" : "", "|", autocast,
                    "|", loss);
  }
};

/// A cache of captured calls, or null when this build has no CUDA.
std::shared_ptr<GraphCache> make_graph_cache();

/// How many graphs `cache` holds.
size_t graphs_held(const GraphCache& cache);

/// Whether `cache` holds a graph for the no-grad call `key`. A graph whose
/// `watched` tensors (the pipeline's parameters and buffers) moved to other
/// storage since its capture reads stale memory: it is dropped here (Moved).
enum class Held { None, Held, Moved };
Held holds_graph(GraphCache& cache, const std::string& key, const std::vector<at::Tensor>& watched);

/// Replays the graph captured for `key`, capturing it first (after one eager
/// warm-up run) if there is none, or if its `watched` tensors moved
/// (holds_graph): copies `x` into the graph's static input, replays on the
/// caller's current stream and returns a copy of the static output. `eager`
/// runs the call on a given input; `reset` is called before the capture.
/// Returns an undefined tensor when the cache is full or capturing `key`
/// failed before.
at::Tensor run_graphed(GraphCache& cache, const std::string& key, const at::Tensor& x,
                       const std::vector<at::Tensor>& watched,
                       const std::function<at::Tensor(const at::Tensor&)>& eager,
                       const std::function<void()>& reset);

/// Whether `cache` holds a training step's graph for `key`; one whose
/// parameters moved to other storage, or changed requires_grad, since its
/// capture is dropped here (Moved).
Held holds_step(GraphCache& cache, const std::string& key, const std::vector<at::Tensor>& params);

/// Whether a capture on `device` leaves room for eager work: the caching
/// allocator has reserved at most half the device's memory. A captured graph
/// keeps its own copy of the call's activations (Note [Automatic CUDA graphs]).
bool room_for_capture(c10::Device device);

/// A training step (forward and backward) as a graph. The first time a key is
/// seen, runs `step(inputs)` eagerly (the warm-up) and returns its loss.
/// Returns an undefined tensor when the caller must run the step eagerly
/// itself: the cache is full, capturing this key failed before, or an earlier
/// autograd graph still holds a parameter, or someone other than the
/// parameter holds a static .grad that the replay would zero or overwrite
/// (a gradient kept from an earlier step; the key then stays eager). Otherwise captures `step` on the
/// second sight of a key, then replays: `inputs` are copied into static
/// copies, every parameter in `params` that requires grad accumulates into a
/// static .grad (Note [Graphed training steps]), and a copy of the step's
/// returned loss comes back. `reset` is called before the capture. A capture
/// that fails marks `key` failed and rethrows with `failure_throws`; without,
/// it calls `reset` and returns undefined.
at::Tensor run_graphed_step(GraphCache& cache, const std::string& key,
                            const std::vector<at::Tensor>& inputs,
                            const std::vector<at::Tensor>& params,
                            const std::function<at::Tensor(const std::vector<at::Tensor>&)>& step,
                            const std::function<void()>& reset, bool failure_throws);

}  // namespace detail
}  // namespace mpipe
