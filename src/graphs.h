#pragma once

// Private: CUDA-graph capture and replay of whole no-grad pipeline calls
// (Note [CUDA graphs]). Compiled only against a CUDA build of LibTorch; with
// a CPU-only LibTorch, make_graph_cache() returns null and nothing is graphed.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>

namespace mpipe {
namespace detail {

class GraphCache;

/// A cache of captured calls, or null when this build has no CUDA.
std::shared_ptr<GraphCache> make_graph_cache();

/// Replays the graph captured for `key`, capturing it first (after one eager
/// warm-up run) if there is none: copies `x` into the graph's static input,
/// replays on the caller's current stream and returns a copy of the static
/// output. `eager` runs the call on a given input; `reset` is called before
/// the capture. Returns an undefined tensor when the cache is full.
at::Tensor run_graphed(GraphCache& cache, const std::string& key, const at::Tensor& x,
                       const std::function<at::Tensor(const at::Tensor&)>& eager,
                       const std::function<void()>& reset);

}  // namespace detail
}  // namespace mpipe
