// Bad input at every public entry point (each gets a clear error naming the
// argument, none crashes, the pipeline stays usable), what happens to
// non-contiguous, NaN/Inf and huge-split inputs, and several threads calling
// one pipeline at once (run under TSan by scripts/sanitize.sh).

#include "common.h"

#include <mpipe/snn.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <sstream>
#include <thread>

using namespace mpipe_test;
using mpipe::Checkpoint;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Schedule;
using mpipe::TrainStepOptions;
namespace snn = mpipe::snn;

namespace {

struct Net {
  std::vector<torch::nn::Sequential> stages;
  ModelPipeline pipe;
  explicit Net(ModelPipelineOptions options = {}) : pipe(options) {
    torch::manual_seed(61);
    stages = {mlp_stage(4, 4), mlp_stage(4, 4), mlp_stage(4, 4)};
    for (auto& s : stages) pipe->append(s, "cpu");
  }
  torch::Tensor plain(const torch::Tensor& x) {
    return plain_forward(stages, std::vector<torch::Device>(3, torch::kCPU), x);
  }
};

/// The pipeline still gives the plain model's output and gradients.
void expect_usable(Net& net) {
  const auto x = torch::randn({6, 4});
  zero_grads(*net.pipe);  // a failed call may leave partial gradients
  expect_transparent(
      *net.pipe, x, [&](const torch::Tensor& xi) { return net.pipe->forward(xi, 2); },
      [&](const torch::Tensor& xi) { return net.plain(xi); }, 1e-6);
}

}  // namespace

TEST(BadInput, AShapeMismatchBetweenStagesNamesTheShapeTheStageGot) {
  for (bool threads : {true, false}) {
    auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
    pipe->append(torch::nn::Linear(4, 8), "cpu").append(torch::nn::Linear(6, 2), "cpu");
    MPIPE_EXPECT_ERROR(pipe->forward(torch::randn({6, 4}), 3), "forward", "stage 1",
                       "micro-batch 0 of 2",
                       "(the stage's input: shape [3, 8], the output of stage 0)");
    MPIPE_EXPECT_ERROR(pipe->constant_forward(torch::randn({6, 5}), 2), "stage 0",
                       "(the stage's input: shape [6, 5], the call's)");
    auto fixed = ModelPipeline(ModelPipelineOptions().worker_threads(threads));
    fixed->append(torch::nn::Linear(4, 8), "cpu").append(torch::nn::Linear(8, 2), "cpu");
    EXPECT_EQ(fixed->forward(torch::randn({6, 4}), 3).sizes(), (std::vector<int64_t>{6, 2}));
  }
}

TEST(BadInput, ForwardTypeCalls) {
  for (bool threads : {true, false}) {
    Net net(ModelPipelineOptions().worker_threads(threads));
    auto& pipe = net.pipe;
    const auto x = torch::randn({6, 4});
    // Wrong dtype: the stage's own error, with the stage and the position.
    MPIPE_EXPECT_ERROR(pipe->forward(x.to(torch::kLong), 2), "forward", "stage 0",
                       "micro-batch 0 of 3");
    MPIPE_EXPECT_ERROR(pipe->constant_forward(x.to(torch::kInt), 3), "constant_forward",
                       "stage 0", "time step 0 of 3");
    // Wrong width: named the same way.
    MPIPE_EXPECT_ERROR(pipe->forward(torch::randn({6, 5}), 3), "stage 0", "micro-batch 0 of 2");
    // Empty input and bad sizes.
    MPIPE_EXPECT_ERROR(pipe->constant_forward(torch::randn({0, 4}), 3), "batch is empty");
    MPIPE_EXPECT_ERROR(pipe->constant_forward(torch::Tensor(), 3), "undefined");
    MPIPE_EXPECT_ERROR(pipe->constant_forward(x, std::numeric_limits<int64_t>::min()),
                       "T (the number of time steps) must be positive");
    MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::randn({4})), "x_seq must be [T, N, ...]",
                       "[4]");
    MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::randn({0, 6, 4})), "T = 0");
    MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::randn({3, 0, 4})), "batch is empty",
                       "dim 1");
    MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::Tensor()), "undefined");
    expect_usable(net);
  }
}

TEST(BadInput, InputsThatAreAcceptedBehaveLikeThePlainModel) {
  Net net;
  auto& pipe = net.pipe;
  torch::NoGradGuard no_grad;
  // A huge split is one micro-batch.
  const auto x = torch::randn({6, 4});
  expect_close(pipe->forward(x, std::numeric_limits<int64_t>::max()), net.plain(x), 1e-6,
               "huge split");
  // Non-contiguous input (a transposed view).
  const auto xt = torch::randn({4, 6}).t();
  ASSERT_FALSE(xt.is_contiguous());
  expect_close(pipe->forward(xt, 4), net.plain(xt), 1e-6, "non-contiguous forward");
  expect_close(pipe->constant_forward(xt, 2), net.plain(xt) * 2, 1e-5, "non-contiguous constant");
  // NaN and Inf are not checked: they propagate exactly as in the plain model.
  auto bad = torch::randn({6, 4});
  bad[1][2] = std::numeric_limits<float>::quiet_NaN();
  bad[4][0] = std::numeric_limits<float>::infinity();
  const auto y = pipe->forward(bad, 2), y_plain = net.plain(bad);
  EXPECT_TRUE(torch::equal(torch::isnan(y), torch::isnan(y_plain)));
  const auto finite = torch::isfinite(y_plain);
  EXPECT_TRUE(torch::isnan(y[1]).all().item<bool>()) << "the NaN row is NaN after a Linear";
  expect_close(y.masked_select(finite), y_plain.masked_select(finite), 1e-6, "finite values");
}

TEST(BadInput, TrainingSteps) {
  for (bool threads : {true, false}) {
    Net net(ModelPipelineOptions().worker_threads(threads));
    auto& pipe = net.pipe;
    const auto x = torch::randn({6, 4}), y = torch::randn({6, 4});
    MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::Tensor(), mse, 2),
                       "target needs the input's batch size (6)", "undefined");
    MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::tensor(1.0), mse, 2), "target",
                       "batch size (6)");
    MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({5, 4}), mse, 2), "target", "[5, 4]");
    MPIPE_EXPECT_ERROR(pipe->train_step(torch::randn({0, 4}), torch::randn({0, 4}), mse, 2),
                       "batch is empty");
    MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, -1), "split_size must be positive, got -1");
    // A target the loss cannot use: named as the loss function's failure.
    MPIPE_EXPECT_ERROR(pipe->train_step(x, torch::randn({6, 7}), mse, 2), "stage 2",
                       "loss of micro-batch 0 of 3", "the loss function failed");
    MPIPE_EXPECT_ERROR(pipe->train_step(x, y,
                                        [](const torch::Tensor&, const torch::Tensor&) {
                                          return torch::Tensor();
                                        },
                                        2),
                       "loss of micro-batch 0", "must return one value", "undefined");
    MPIPE_EXPECT_ERROR(pipe->train_step(x.to(torch::kDouble), y, mse, 3), "stage 0",
                       "forward of micro-batch 0 of 2");
    // A huge split is one micro-batch (it once overflowed the count).
    zero_grads(*pipe);
    const auto loss =
        pipe->train_step(x, y, mse, TrainStepOptions(std::numeric_limits<int64_t>::max()));
    const auto grads = grads_of(*pipe);
    zero_grads(*pipe);
    auto plain = mse(net.plain(x), y);
    plain.backward();
    expect_close(loss, plain, 1e-6, "loss with a huge split");
    expect_same_grads(grads, grads_of(*pipe), 1e-6);
    zero_grads(*pipe);
    // constant_train_step.
    MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, -1, y, mse), "T (the number of time steps)",
                       "got -1");
    MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 2, torch::randn({6, 7}), mse),
                       "constant_train_step", "the loss function failed");
    MPIPE_EXPECT_ERROR(pipe->constant_train_step(torch::randn({0, 4}), 2, y, mse),
                       "batch is empty");
    expect_usable(net);
  }
}

TEST(BadInput, ModulesAndHelpers) {
  MPIPE_EXPECT_ERROR(snn::LIFNode()(torch::ones({2, 3}, torch::kLong)), "LIFNode",
                     "floating point", "Long");
  snn::IFNode node;
  node(torch::rand({2, 3}));
  MPIPE_EXPECT_ERROR(node(torch::rand({4, 3})), "IFNode", "[4, 3]", "[2, 3]", "reset_states");
  MPIPE_EXPECT_ERROR(snn::LIFNode(snn::LIFNodeOptions().tau(0.5)), "tau", "0.5");
  MPIPE_EXPECT_ERROR(snn::IFNode(snn::IFNodeOptions().v_threshold(
                         std::numeric_limits<double>::infinity())),
                     "v_threshold must be finite");
  MPIPE_EXPECT_ERROR(snn::poisson_encode(torch::full({2, 2}, 1.5)), "[0, 1]");
  MPIPE_EXPECT_ERROR(mpipe::DeferredBatchNorm(0), "num_features must be positive, got 0");
  MPIPE_EXPECT_ERROR(mpipe::DeferredBatchNorm(3)(torch::randn({4, 5})), "[N, 3, ...]", "[4, 5]");
  MPIPE_EXPECT_ERROR(mpipe::balance::partition({1.0, 2.0}, 3), "3");
  MPIPE_EXPECT_ERROR(mpipe::balance::partition({1.0, 2.0}, 0), "0");
}

// Two threads calling one pipeline are serialised; calls that race with
// clear_cuda_graphs, to(dtype) and load wait for each other. Every result
// equals the plain model's. scripts/sanitize.sh runs this under TSan.
TEST(Concurrency, CallsFromSeveralThreadsAreSerialised) {
  for (bool threads : {true, false}) {
    Net net(ModelPipelineOptions().worker_threads(threads).checkpoint(Checkpoint::ExceptLast));
    auto& pipe = net.pipe;
    std::stringstream saved;
    torch::save(pipe, saved);
    const std::string archive = saved.str();
    const auto x = torch::randn({6, 4}), y = torch::randn({6, 4});
    torch::Tensor expected, expected_loss;
    {
      torch::NoGradGuard no_grad;
      expected = net.plain(x);
    }
    expected_loss = mse(net.plain(x), y).detach();
    std::atomic<int> mismatches{0}, failures{0};
    auto caller = [&](int id) {
      for (int i = 0; i < 25; ++i) {
        try {
          if (id % 2 == 0) {
            torch::NoGradGuard no_grad;
            const auto out = pipe->forward(x, 1 + (i % 3));
            if (!torch::allclose(out, expected, 1e-5, 1e-6)) ++mismatches;
          } else {
            const auto loss =
                pipe->train_step(x, y, mse, TrainStepOptions(2).schedule(
                                                 i % 2 ? Schedule::GPipe : Schedule::OneFOneB));
            if (!torch::allclose(loss, expected_loss, 1e-5, 1e-6)) ++mismatches;
          }
        } catch (...) {
          ++failures;
        }
      }
    };
    auto disturber = [&] {
      for (int i = 0; i < 25; ++i) {
        try {
          pipe->clear_cuda_graphs();
          pipe->to(torch::kFloat);  // the same dtype: a no-op that takes the call lock
          std::stringstream in(archive);
          torch::load(pipe, in);  // the same values
          (void)pipe->memory_report();
          (void)pipe->timeline();
        } catch (...) {
          ++failures;
        }
      }
    };
    std::vector<std::thread> pool;
    for (int id = 0; id < 4; ++id) pool.emplace_back(caller, id);
    pool.emplace_back(disturber);
    for (auto& t : pool) t.join();
    EXPECT_EQ(mismatches.load(), 0);
    EXPECT_EQ(failures.load(), 0);
    expect_usable(net);
  }
}

// append() races calls: each call describes, checks and runs the stages that
// were there when it took the call lock, never a pipeline half-appended. The
// result of every call is some prefix of the stages' plain model.
// scripts/sanitize.sh runs this under TSan.
TEST(Concurrency, AppendRacesCallsAndEachCallSeesWholeStages) {
  torch::manual_seed(7);
  constexpr int kStages = 8;
  std::vector<torch::nn::Linear> layers;
  for (int s = 0; s < kStages; ++s) layers.emplace_back(4, 4);
  const auto x = torch::randn({6, 4}), y = torch::randn({6, 4});
  std::vector<torch::Tensor> prefix_out, prefix_loss;  // [k - 1]: the first k stages
  {
    torch::Tensor h = x;
    for (int s = 0; s < kStages; ++s) {
      h = layers[static_cast<size_t>(s)](h);
      prefix_out.push_back(h.detach());
      prefix_loss.push_back(mse(h, y).detach());
    }
  }
  auto matches_prefix = [](const torch::Tensor& got, const std::vector<torch::Tensor>& want) {
    for (const auto& w : want) {
      if (got.sizes() == w.sizes() && torch::allclose(got, w, 1e-5, 1e-6)) return true;
    }
    return false;
  };
  for (bool threads : {true, false}) {
    ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads));
    pipe->append(layers[0], "cpu");
    std::atomic<int> mismatches{0}, failures{0};
    std::atomic<bool> appending{true};
    auto caller = [&](int id) {
      int calls = 0;
      while (appending.load() || calls < 10) {
        ++calls;
        try {
          if (id == 0) {
            torch::NoGradGuard no_grad;
            if (!matches_prefix(pipe->forward(x, 2), prefix_out)) ++mismatches;
          } else {
            const auto loss = pipe->train_step(x, y, mse, TrainStepOptions(3));
            if (!matches_prefix(loss, prefix_loss)) ++mismatches;
          }
        } catch (...) {
          ++failures;
        }
      }
    };
    std::vector<std::thread> pool;
    for (int id = 0; id < 2; ++id) pool.emplace_back(caller, id);
    for (int s = 1; s < kStages; ++s) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      pipe->append(layers[static_cast<size_t>(s)], "cpu");
    }
    appending = false;
    for (auto& t : pool) t.join();
    EXPECT_EQ(mismatches.load(), 0);
    EXPECT_EQ(failures.load(), 0);
    EXPECT_EQ(pipe->size(), static_cast<size_t>(kStages));
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::allclose(pipe->forward(x, 2), prefix_out.back(), 1e-5, 1e-6));
  }
}
