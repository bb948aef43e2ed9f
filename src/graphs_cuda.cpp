#include "graphs.h"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>

namespace mpipe {
namespace detail {

// Note [CUDA graphs]
// ~~~~~~~~~~~~~~~~~~
// With ModelPipelineOptions::cuda_graphs, a no-grad forward, constant_forward
// or sequence_forward whose stages and input all sit on one CUDA device is
// captured once per (method, arguments, input shape and dtype) and replayed
// afterwards, which removes the host's per-op cost. The capture runs the call
// from the caller's thread (no worker threads) on a side stream; the runtime's
// fork and join (Note [Pipeline runtime]) bring every stage stream into the
// capture and back, so the graph keeps the stages' concurrency. A replay reads
// a static input (the call's input is copied in) and the caller gets a copy
// of the static output. Stateful modules start every graphed call from their
// reset state (a call is graphed only when no module holds state) and are
// reset after it: state does not carry from one graphed call to the next.
// Calls with gradients, several devices, or held state run eagerly, as does
// any call once 16 shapes have been captured.

constexpr size_t kMaxGraphs = 16;

class GraphCache {
 public:
  struct Entry {
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    at::Tensor input, output;
  };
  std::map<std::string, Entry> entries;
};

std::shared_ptr<GraphCache> make_graph_cache() { return std::make_shared<GraphCache>(); }

at::Tensor run_graphed(GraphCache& cache, const std::string& key, const at::Tensor& x,
                       const std::function<at::Tensor(const at::Tensor&)>& eager,
                       const std::function<void()>& reset) {
  c10::cuda::CUDAGuard device_guard(x.device());
  auto it = cache.entries.find(key);
  if (it == cache.entries.end()) {
    if (cache.entries.size() >= kMaxGraphs) return at::Tensor();
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream();
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    GraphCache::Entry entry;
    entry.input = x.clone();
    at::cuda::CUDAEvent ready;
    ready.record(caller);
    ready.block(side);
    {
      c10::cuda::CUDAStreamGuard stream_guard(side);
      eager(entry.input);  // warm-up: library handles, workspaces, the allocator
      reset();
      entry.graph = std::make_unique<at::cuda::CUDAGraph>();
      entry.graph->capture_begin();
      entry.output = eager(entry.input);
      entry.graph->capture_end();
    }
    at::cuda::CUDAEvent captured;
    captured.record(side);
    captured.block(caller);
    it = cache.entries.emplace(key, std::move(entry)).first;
  }
  GraphCache::Entry& entry = it->second;
  entry.input.copy_(x);
  entry.graph->replay();
  return entry.output.clone();
}

}  // namespace detail
}  // namespace mpipe
