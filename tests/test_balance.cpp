// Balancing: the exact partition against brute force, and pipelines built from
// a Sequential with a manual split.

#include "common.h"

#include <mpipe/balance.h>
#include <mpipe/snn.h>

#include <functional>
#include <random>

using namespace mpipe_test;
namespace balance = mpipe::balance;

namespace {

/// The largest block sum of the split `sizes` of `costs`.
double max_block_cost(const std::vector<double>& costs, const std::vector<int64_t>& sizes) {
  const auto sums = balance::stage_sums(costs, sizes);
  return *std::max_element(sums.begin(), sums.end());
}

/// Smallest largest-block sum over every split of `costs` into n blocks.
double brute_force(const std::vector<double>& costs, int64_t n) {
  double best = std::numeric_limits<double>::infinity();
  std::vector<int64_t> sizes;
  std::function<void(int64_t, int64_t)> rec = [&](int64_t at, int64_t left) {
    const auto L = static_cast<int64_t>(costs.size());
    if (left == 1) {
      sizes.push_back(L - at);
      best = std::min(best, max_block_cost(costs, sizes));
      sizes.pop_back();
      return;
    }
    for (int64_t len = 1; at + len <= L - (left - 1); ++len) {
      sizes.push_back(len);
      rec(at + len, left - 1);
      sizes.pop_back();
    }
  };
  rec(0, n);
  return best;
}

}  // namespace

TEST(Balance, PartitionIsOptimalAgainstBruteForce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t L = 1 + static_cast<int64_t>(rng() % 10);
    const int64_t n = 1 + static_cast<int64_t>(rng() % L);
    std::vector<double> costs;
    for (int64_t i = 0; i < L; ++i) costs.push_back(static_cast<double>(rng() % 20));  // exact sums
    const auto sizes = balance::partition(costs, n);
    ASSERT_EQ(static_cast<int64_t>(sizes.size()), n);
    EXPECT_EQ(max_block_cost(costs, sizes), brute_force(costs, n))
        << "trial " << trial << ", " << L << " layers, " << n << " blocks";
  }
}

TEST(Balance, KnownSplits) {
  // A greedy split that fills blocks up to the mean (15 / 3 = 5) takes [5], [1, 1, 1, 1],
  // [1, 5]: largest 6. The optimum is 5: [5], [1, 1, 1, 1, 1], [5].
  EXPECT_EQ(balance::partition({5, 1, 1, 1, 1, 1, 5}, 3), (std::vector<int64_t>{1, 5, 1}));
  EXPECT_EQ(balance::partition({1, 1, 1, 1}, 2), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(balance::partition({3, 0, 0}, 3), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(balance::partition({2, 2, 2}, 1), (std::vector<int64_t>{3}));
  EXPECT_DOUBLE_EQ(max_block_cost({1, 2, 3, 4}, {2, 2}), 7.0);
}

TEST(Balance, BadInputsAreRefused) {
  MPIPE_EXPECT_ERROR(balance::partition({1, 2}, 3), "2 layer(s) cannot fill 3 non-empty blocks");
  MPIPE_EXPECT_ERROR(balance::partition({1, 2}, 0), "at least one block, got 0");
  MPIPE_EXPECT_ERROR(balance::partition({1, -2}, 1), "cost of layer 1", "got -2");
  MPIPE_EXPECT_ERROR(balance::stage_sums({1, 2, 3}, {1, 1}), "hold 2 layer(s), the values are of 3");
  MPIPE_EXPECT_ERROR(balance::stage_sums({1, 2, 3}, {2, 0, 1}), "stage 1", "got 0");
}

TEST(Balance, FromSequentialSplitsTheLayersAsAsked) {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 6),
                              torch::nn::Tanh(), torch::nn::Linear(6, 2));
  model->to(torch::kDouble);
  auto pipe = balance::from_sequential(model, {"cpu", "cpu", torch::kCPU}, {2, 2, 1});
  ASSERT_EQ(pipe->size(), 3u);
  EXPECT_EQ(pipe->stage(0)->as<torch::nn::Sequential>()->size(), 2u);
  EXPECT_EQ(pipe->stage(2)->as<torch::nn::Sequential>()->size(), 1u);
  // The same layers, so the same function and gradients.
  auto x = torch::randn({7, 4}, torch::kDouble);
  expect_transparent(
      *pipe, x, [&](const torch::Tensor& in) { return pipe->forward(in, 3); },
      [&](const torch::Tensor& in) { return model->forward(in); });

  MPIPE_EXPECT_ERROR(balance::from_sequential(model, {"cpu", "cpu"}, {2, 2}),
                     "add up to 4 layers, but the Sequential has 5");
  MPIPE_EXPECT_ERROR(balance::from_sequential(model, {"cpu"}, {2, 3}), "2 stage size(s) for 1");
  MPIPE_EXPECT_ERROR(balance::from_sequential(model, {"cpu", "cpu"}, {5, 0}), "stage 1",
                     "at least one layer, got 0");
}

TEST(Balance, ProfilingLeavesTheModelAsItWas) {
  torch::manual_seed(5);
  torch::nn::Sequential model(torch::nn::Linear(8, 64), torch::nn::BatchNorm1d(64),
                              torch::nn::Linear(64, 64), mpipe::snn::LIFNode(),
                              torch::nn::Linear(64, 4));
  auto sample = torch::randn({16, 8});
  model->forward(sample).sum().backward();  // some gradients to keep
  mpipe::reset_states(*model);
  std::map<std::string, torch::Tensor> before;
  for (const auto& p : model->named_parameters()) before[p.key()] = p.value().detach().clone();
  for (const auto& b : model->named_buffers()) before[b.key()] = b.value().clone();
  const auto grads = grads_of(*model);

  const auto time = mpipe::balance::profile_time(model, sample, 2);
  ASSERT_EQ(time.size(), 5u);
  for (double t : time) EXPECT_GT(t, 0.0);
  const auto mem = mpipe::balance::profile_memory(model, sample, 2.0);
  ASSERT_EQ(mem.size(), 5u);
  // Linear(8, 64): (8*64 + 64) floats x (1 + 2) + the [16, 64] output.
  EXPECT_DOUBLE_EQ(mem[0], (8 * 64 + 64) * 4.0 * 3 + 16 * 64 * 4.0);
  EXPECT_DOUBLE_EQ(mem[3], 16 * 64 * 4.0);  // the neuron: no parameters

  for (const auto& p : model->named_parameters()) expect_close(p.value(), before[p.key()], 0.0, p.key());
  for (const auto& b : model->named_buffers()) expect_close(b.value(), before[b.key()], 0.0, b.key());
  expect_same_grads(grads, grads_of(*model), 0.0);
  EXPECT_TRUE(model[3]->as<mpipe::snn::LIFNodeImpl>()->membrane_potentials().empty());

  auto pipe = mpipe::balance::balanced(model, {"cpu", "cpu"}, mem);
  EXPECT_EQ(pipe->size(), 2u);
  MPIPE_EXPECT_ERROR(mpipe::balance::balanced(model, {"cpu"}, {1.0}), "1 cost(s) for 5 layer(s)");
}

TEST(Balance, StageCostsForTheScheduleChoice) {
  torch::nn::Sequential model(torch::nn::Linear(8, 64), torch::nn::ReLU(), torch::nn::Linear(64, 4));
  const auto act = mpipe::balance::profile_activations(model, torch::randn({16, 8}));
  EXPECT_EQ(act, (std::vector<double>{16 * 64 * 4.0, 16 * 64 * 4.0, 16 * 4 * 4.0}));
  // Per stage, scaled to a micro-batch of 4 rows of the 16-row sample.
  EXPECT_EQ(mpipe::balance::stage_sums(act, {2, 1}, 0.25),
            (std::vector<double>{2 * 16 * 64.0, 16 * 4.0}));
  const auto costs = mpipe::balance::stage_costs({3, 6, 9}, {1, 2}, 2.0);
  ASSERT_EQ(costs.size(), 2u);
  EXPECT_DOUBLE_EQ(costs[0].forward, 2);  // 3 * 2 / 3
  EXPECT_DOUBLE_EQ(costs[1].backward_input, 10);  // (6 + 9) * 2 / 3
  EXPECT_DOUBLE_EQ(costs[1].backward_weight, 10);
  EXPECT_DOUBLE_EQ(costs[1].transfer, 0);
  MPIPE_EXPECT_ERROR(mpipe::balance::stage_costs({1, 2}, {1, 2}), "stage_costs",
                     "the stages hold 3 layer(s), the values are of 2");
  MPIPE_EXPECT_ERROR(mpipe::balance::stage_costs({1, 2, 3}, {2, 0, 1}), "stage 1 must hold");
  MPIPE_EXPECT_ERROR(mpipe::balance::stage_costs({1, -2}, {2}), "cost of layer 1");
  MPIPE_EXPECT_ERROR(mpipe::balance::stage_sums({1, 2, 3}, {1, 1}), "the stages hold 2 layer(s)");
  // Auto with those costs: 3 micro-batches over the 2 stages, each on its own device.
  const auto choice = mpipe::choose_schedule(
      3, 2, mpipe::TrainStepOptions(4).stage_costs(costs).activation_bytes({2048, 64}));
  EXPECT_EQ(choice.candidates.size(), 4u);  // GPipe, 1F1B, ZB-H1, Tailored
  EXPECT_DOUBLE_EQ(choice.candidates[0].peak_memory, 3 * 2048);  // GPipe holds all 3
}
