// CPU-only LibTorch: no CUDA graphs (Note [CUDA graphs] in graphs_cuda.cpp).
#include "graphs.h"

namespace mpipe {
namespace detail {

class GraphCache {};

std::shared_ptr<GraphCache> make_graph_cache() { return nullptr; }

size_t graphs_held(const GraphCache&) { return 0; }

at::Tensor run_graphed(GraphCache&, const std::string&, const at::Tensor&,
                       const std::function<at::Tensor(const at::Tensor&)>&,
                       const std::function<void()>&) {
  return at::Tensor();
}

at::Tensor run_graphed_step(GraphCache&, const std::string&, const std::vector<at::Tensor>&,
                            const std::vector<at::Tensor>&,
                            const std::function<at::Tensor(const std::vector<at::Tensor>&)>&,
                            const std::function<void()>&) {
  return at::Tensor();
}

}  // namespace detail
}  // namespace mpipe
