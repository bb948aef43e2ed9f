#include "mpipe/balance.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <numeric>

namespace mpipe {
namespace balance {

namespace {

void check_costs(const std::vector<double>& costs, const char* who) {
  for (size_t i = 0; i < costs.size(); ++i) {
    TORCH_CHECK(std::isfinite(costs[i]) && costs[i] >= 0, "mpipe::balance::", who, ": cost of layer ",
                i, " must be finite and >= 0, got ", costs[i]);
  }
}

}  // namespace

std::vector<int64_t> partition(const std::vector<double>& costs, int64_t n_blocks) {
  check_costs(costs, "partition");
  const auto n_layers = static_cast<int64_t>(costs.size());
  TORCH_CHECK(n_blocks >= 1, "mpipe::balance::partition: need at least one block, got ", n_blocks);
  TORCH_CHECK(n_layers >= n_blocks, "mpipe::balance::partition: ", n_layers,
              " layer(s) cannot fill ", n_blocks, " non-empty blocks");
  std::vector<double> prefix(static_cast<size_t>(n_layers) + 1, 0.0);
  for (int64_t i = 0; i < n_layers; ++i) prefix[i + 1] = prefix[i] + costs[i];
  auto sum = [&](int64_t a, int64_t b) { return prefix[b] - prefix[a]; };  // layers [a, b)
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: smallest largest-block sum splitting layers [0, i) into k blocks;
  // cut[k][i]: where the last of those blocks starts.
  std::vector<std::vector<double>> best(static_cast<size_t>(n_blocks) + 1,
                                        std::vector<double>(static_cast<size_t>(n_layers) + 1, inf));
  std::vector<std::vector<int64_t>> cut(best.size(),
                                        std::vector<int64_t>(static_cast<size_t>(n_layers) + 1, 0));
  best[0][0] = 0;
  for (int64_t k = 1; k <= n_blocks; ++k) {
    for (int64_t i = k; i <= n_layers - (n_blocks - k); ++i) {
      // Scanning j downwards and keeping strict improvements makes the last
      // block as short as possible, so earlier blocks are the longest.
      for (int64_t j = i - 1; j >= k - 1; --j) {
        const double candidate = std::max(best[k - 1][j], sum(j, i));
        if (candidate < best[k][i]) {
          best[k][i] = candidate;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> sizes(static_cast<size_t>(n_blocks));
  for (int64_t k = n_blocks, i = n_layers; k >= 1; --k) {
    sizes[k - 1] = i - cut[k][i];
    i = cut[k][i];
  }
  return sizes;
}

double max_block_cost(const std::vector<double>& costs, const std::vector<int64_t>& sizes) {
  check_costs(costs, "max_block_cost");
  int64_t at = 0;
  double worst = 0;
  for (size_t b = 0; b < sizes.size(); ++b) {
    TORCH_CHECK(sizes[b] > 0, "mpipe::balance::max_block_cost: block ", b,
                " must hold at least one layer, got ", sizes[b]);
    TORCH_CHECK(at + sizes[b] <= static_cast<int64_t>(costs.size()),
                "mpipe::balance::max_block_cost: the blocks hold more layers than the ",
                costs.size(), " given");
    double s = 0;
    for (int64_t i = at; i < at + sizes[b]; ++i) s += costs[i];
    worst = std::max(worst, s);
    at += sizes[b];
  }
  TORCH_CHECK(at == static_cast<int64_t>(costs.size()), "mpipe::balance::max_block_cost: the blocks "
              "hold ", at, " layers, not the ", costs.size(), " given");
  return worst;
}

ModelPipeline from_sequential(const torch::nn::Sequential& layers,
                              const std::vector<DeviceArg>& devices,
                              const std::vector<int64_t>& sizes, ModelPipelineOptions options) {
  const auto n_layers = static_cast<int64_t>(layers->size());
  TORCH_CHECK(sizes.size() == devices.size(), "mpipe::balance::from_sequential: ", sizes.size(),
              " stage size(s) for ", devices.size(), " device(s); give one size per device");
  TORCH_CHECK(!sizes.empty(), "mpipe::balance::from_sequential: no stages asked for");
  int64_t total = 0;
  for (size_t s = 0; s < sizes.size(); ++s) {
    TORCH_CHECK(sizes[s] > 0, "mpipe::balance::from_sequential: stage ", s,
                " must hold at least one layer, got ", sizes[s]);
    total += sizes[s];
  }
  TORCH_CHECK(total == n_layers, "mpipe::balance::from_sequential: the stage sizes add up to ",
              total, " layers, but the Sequential has ", n_layers);
  ModelPipeline pipe(options);
  auto it = layers->begin();
  for (size_t s = 0; s < sizes.size(); ++s) {
    torch::nn::Sequential stage;
    for (int64_t l = 0; l < sizes[s]; ++l, ++it) stage->push_back(*it);
    pipe->append(stage, devices[s]);
  }
  return pipe;
}

}  // namespace balance
}  // namespace mpipe
