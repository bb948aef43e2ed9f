#pragma once

#include "mpipe/detail/config.h"

// CPU-only LibTorch: no CUDA graphs (Note [CUDA graphs] in graphs_cuda-inl.h).
#include "mpipe/detail/cuda/graphs.h"

namespace mpipe {
namespace detail {

class GraphCache {};

MPIPE_FUNC std::shared_ptr<GraphCache> make_graph_cache() { return nullptr; }

MPIPE_FUNC size_t graphs_held(const GraphCache&) { return 0; }

MPIPE_FUNC Held holds_graph(GraphCache&, const std::string&, const std::vector<at::Tensor>&) {
  return Held::None;
}

MPIPE_FUNC at::Tensor run_graphed(GraphCache&, const std::string&, const at::Tensor&,
                                  const std::vector<at::Tensor>&,
                                  const std::function<at::Tensor(const at::Tensor&)>&,
                                  const std::function<void()>&) {
  return at::Tensor();
}

MPIPE_FUNC Held holds_step(GraphCache&, const std::string&, const std::vector<at::Tensor>&) {
  return Held::None;
}

MPIPE_FUNC bool room_for_capture(c10::Device) { return false; }

MPIPE_FUNC at::Tensor run_graphed_step(
    GraphCache&, const std::string&, const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
    const std::function<at::Tensor(const std::vector<at::Tensor>&)>&,
    const std::function<void()>&, bool) {
  return at::Tensor();
}

}  // namespace detail
}  // namespace mpipe
