#pragma once

// Private: which of a pipeline's calls run from CUDA graphs, and the graphs
// it holds (one of the PipelineParts, pipeline/session.h). The graphs
// themselves are cuda/graphs.h's.

#include "mpipe/model_pipeline.h"

#include "mpipe/detail/cuda/graphs.h"
#include "mpipe/detail/pipeline/stages.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace mpipe {
namespace detail {

class GraphPolicy {
 public:
  /// A call run eagerly on `x` (and a step's target), threaded or inline.
  using Eager = std::function<at::Tensor(const at::Tensor& x, bool threaded)>;
  using EagerStep =
      std::function<at::Tensor(const at::Tensor& x, const at::Tensor& target, bool threaded)>;

  GraphPolicy() : cache_(make_graph_cache()) {}

  /// The policy's first test, cheap enough for every call: false when call()
  /// or step() would surely say no (a CPU input; both graph options off), so
  /// that the caller builds no key for them.
  static bool may_replay(const ModelPipelineOptions& options, const at::Tensor& x) {
    return x.is_cuda() && (options.cuda_graphs() || options.auto_cuda_graphs());
  }
  /// A no-grad call of one tensor `x` of `pipeline`: replayed from a CUDA
  /// graph (ModelPipelineOptions::cuda_graphs), or run as Note [Automatic
  /// CUDA graphs] decides (auto_cuda_graphs). Undefined when the call runs
  /// eagerly instead, which the caller then does.
  at::Tensor call(ModelPipelineImpl& pipeline, const Stages& stages, const GraphKey& key,
                  const at::Tensor& x, const Eager& eager);
  /// A training step: replayed from a CUDA graph (options.cuda_graphs), or
  /// run as Note [Automatic CUDA graphs] decides; undefined when the caller
  /// is to run it eagerly.
  at::Tensor step(ModelPipelineImpl& pipeline, const Stages& stages, const GraphKey& key,
                  const at::Tensor& x, const at::Tensor& target, const EagerStep& eager);

  size_t held() const { return cache_ ? graphs_held(*cache_) : 0; }
  /// Drops every graph: parameters moved or stages changed.
  void drop();

 private:
  /// Note [Automatic CUDA graphs]: what auto-capture knows of each key.
  struct AutoGraph {
    int eager_runs = 0;    // eager runs of this key so far
    int moved = 0;         // graphs dropped because parameters moved
    bool refused = false;  // it drew random numbers, or its capture failed
  };

  bool could_graph(const ModelPipelineImpl& pipeline, const Stages& stages,
                   const at::Tensor& x) const;
  bool auto_graphable(const ModelPipelineImpl& pipeline, const Stages& stages,
                      const at::Tensor& x) const;
  /// The call run from a graph, captured first if need be; undefined when
  /// the cache is full.
  at::Tensor replay(ModelPipelineImpl& pipeline, const std::string& key,
                    const std::vector<at::Tensor>& watched, const at::Tensor& x,
                    const Eager& eager);
  at::Tensor auto_graphed(ModelPipelineImpl& pipeline, const Stages& stages,
                          const GraphKey& key, const at::Tensor& x, const Eager& eager);
  /// A training step from its graph, captured first if need be; undefined
  /// when it is to run eagerly (run_graphed_step). A failed capture throws
  /// with `failure_throws`, else gives undefined.
  at::Tensor replay_step(ModelPipelineImpl& pipeline, const std::string& key,
                         const std::vector<at::Tensor>& params, const at::Tensor& x,
                         const at::Tensor& target, const EagerStep& eager, bool failure_throws);
  /// The bookkeeping of Note [Automatic CUDA graphs] for `key`: the entry,
  /// emptied when the map grows past its bound.
  AutoGraph& seen(const std::string& key);

  std::shared_ptr<GraphCache> cache_;  // null without CUDA
  std::map<std::string, AutoGraph> auto_graphs_;
};

}  // namespace detail
}  // namespace mpipe
