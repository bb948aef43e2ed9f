// Activation checkpointing: a recomputed stage draws the random numbers of
// its forward (dropout), gives the gradients of the run without
// checkpointing, runs nothing again in eval mode; and stateful stages
// (neurons, a user's module) under every schedule and checkpointing mode
// equal the plain model, with their state saved and put back around each
// recompute (Note [State snapshots]).

#include "common.h"

#include <mpipe/mpipe.h>
#include <mpipe/snn.h>

#include <string>
#include <tuple>
#include <vector>

using namespace mpipe_test;
using mpipe::Checkpoint;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Schedule;
using mpipe::TrainStepOptions;
namespace snn = mpipe::snn;

namespace {

/// Multiplies by a fresh uniform mask and records the mask drawn in each call,
/// by micro-batch and by whether the call was a recompute.
struct MaskImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    auto mask = torch::rand_like(x);
    const int64_t mb = mpipe::current_micro_batch().index;
    (mpipe::is_recomputing() ? recomputed : original)[mb] = mask;
    ++calls;
    return x * mask;
  }
  std::map<int64_t, torch::Tensor> original, recomputed;
  int64_t calls = 0;
};
TORCH_MODULE(Mask);

}  // namespace

TEST(Checkpointing, RecomputeDrawsTheSameRandomNumbers) {
  for (bool threads : {true, false}) {
    for (auto schedule : all_schedules()) {
      SCOPED_TRACE(std::string(threads ? "threads, " : "inline, ") + schedule_name(schedule));
      // Three stages on one device share its generator.
      std::vector<Mask> masks(3);
      auto pipe = ModelPipeline(
          ModelPipelineOptions().worker_threads(threads).checkpoint(Checkpoint::Always));
      pipe->append(torch::nn::Linear(4, 4), "cpu");
      for (auto& m : masks) pipe->append(m, "cpu");
      auto x = torch::randn({8, 4});
      pipe->train_step(x, torch::zeros({8, 4}),
                       [](const torch::Tensor& o, const torch::Tensor& y) {
                         return torch::mse_loss(o, y);
                       },
                       schedule_options(schedule, 2, 4));
      for (auto& m : masks) {
        ASSERT_EQ(m->original.size(), 4u);
        ASSERT_EQ(m->recomputed.size(), 4u);
        EXPECT_EQ(m->calls, 8);  // each micro-batch twice
        for (int64_t i = 0; i < 4; ++i) {
          expect_close(m->recomputed[i], m->original[i], 0.0, "mask " + std::to_string(i));
        }
        // Different micro-batches got different masks: the check can fail.
        EXPECT_GT((m->original[0] - m->original[1]).abs().max().item<double>(), 0.0);
      }
    }
  }
}

TEST(Checkpointing, DropoutGradientsMatchTheRunWithoutCheckpointing) {
  auto grads_with = [](Checkpoint c) {
    torch::manual_seed(21);
    std::vector<torch::nn::Sequential> stages;
    for (int j = 0; j < 3; ++j) {
      stages.emplace_back(torch::nn::Linear(6, 6), torch::nn::Dropout(0.5), torch::nn::Tanh());
    }
    auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(false).checkpoint(c));
    for (auto& s : stages) pipe->append(s, "cpu");
    torch::manual_seed(22);
    pipe->train_step(torch::randn({9, 6}), torch::randn({9, 6}),
                     [](const torch::Tensor& o, const torch::Tensor& y) {
                       return torch::mse_loss(o, y);
                     },
                     TrainStepOptions(2).schedule(Schedule::OneFOneB));
    return grads_of(*pipe);
  };
  auto never = grads_with(Checkpoint::Never);
  expect_same_grads(never, grads_with(Checkpoint::Always), 0.0);
  expect_same_grads(never, grads_with(Checkpoint::ExceptLast), 0.0);
}

TEST(Checkpointing, DropoutOnTheGpuDrawsTheForwardsMaskThreadedAndInline_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  for (bool threads : {true, false}) {
    SCOPED_TRACE(threads ? "threads" : "inline");
    auto grads_with = [&](Checkpoint c) {
      torch::manual_seed(21);
      std::vector<torch::nn::Sequential> stages;
      for (int j = 0; j < 3; ++j) {
        stages.emplace_back(torch::nn::Linear(64, 64), torch::nn::Dropout(0.5), torch::nn::Tanh());
      }
      // Stages on the GPU and the CPU: each draws from its own device's generators.
      const std::vector<torch::Device> where = {g, torch::kCPU, g};
      auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads).checkpoint(c));
      for (int j = 0; j < 3; ++j) pipe->append(stages[static_cast<size_t>(j)], where[static_cast<size_t>(j)]);
      pipe->to(torch::kDouble);
      torch::manual_seed(22);
      auto x = torch::randn({16, 64}, torch::TensorOptions(g).dtype(torch::kDouble));
      auto y = torch::randn({16, 64}, torch::TensorOptions(g).dtype(torch::kDouble));
      pipe->train_step(x, y, [](const torch::Tensor& o, const torch::Tensor& t) {
        return torch::mse_loss(o, t);
      }, TrainStepOptions(4).schedule(Schedule::OneFOneB));
      return grads_of(*pipe);
    };
    auto never = grads_with(Checkpoint::Never);
    double norm = 0;
    for (const auto& kv : never) norm += kv.second.abs().sum().item<double>();
    EXPECT_GT(norm, 0);
    expect_same_grads(never, grads_with(Checkpoint::Always), 0.0);
    expect_same_grads(never, grads_with(Checkpoint::ExceptLast), 0.0);
  }
}

TEST(Checkpointing, NothingIsRecomputedInEvalMode) {
  std::vector<Recorder> recorders(2);
  auto pipe = ModelPipeline(ModelPipelineOptions().checkpoint(Checkpoint::Always));
  pipe->append(torch::nn::Linear(2, 2), "cpu");
  for (auto& r : recorders) pipe->append(r, "cpu");
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& y) { return torch::mse_loss(o, y); };
  pipe->train_step(torch::randn({4, 2}), torch::randn({4, 2}), loss_fn, TrainStepOptions(1));
  EXPECT_EQ(recorders[0]->seen.size(), 8u);  // training: forward + recompute
  recorders[0]->seen.clear();
  pipe->eval();
  pipe->train_step(torch::randn({4, 2}), torch::randn({4, 2}), loss_fn, TrainStepOptions(1));
  EXPECT_EQ(recorders[0]->seen.size(), 4u);
}

namespace {

/// Stages with a neuron or a user's stateful module between linear layers, so
/// that a wrong state shows in the gradients of earlier layers (double).
std::vector<torch::nn::Sequential> stateful_stages(bool fused) {
  torch::manual_seed(41);
  const int64_t width = 5;
  std::vector<torch::nn::Sequential> stages{
      torch::nn::Sequential(torch::nn::Linear(width, width),
                            snn::LIFNode(snn::LIFNodeOptions().v_threshold(0.2).fused(fused))),
      torch::nn::Sequential(torch::nn::Linear(width, width), Leaky(width, 0.5)),
      torch::nn::Sequential(torch::nn::Linear(width, width),
                            snn::IFNode(snn::IFNodeOptions().v_threshold(0.2).v_reset(std::nullopt)
                                            .fused(fused)),
                            torch::nn::Linear(width, 3))};
  for (auto& s : stages) s->to(torch::kDouble);
  return stages;
}

/// Per-micro-batch states of every neuron and Leaky in `m`, in module order.
std::vector<std::vector<torch::Tensor>> slots_of(torch::nn::Module& m) {
  std::vector<std::vector<torch::Tensor>> out;
  for (const auto& sub : m.modules(/*include_self=*/false)) {
    if (auto* n = dynamic_cast<snn::NeuronBase*>(sub.get())) out.push_back(n->membrane_potentials());
    if (auto* l = dynamic_cast<LeakyImpl*>(sub.get())) out.push_back(l->state.slots());
  }
  return out;
}

/// Detaches every state in `m` (truncated BPTT between steps).
void detach_states(torch::nn::Module& m) {
  for (const auto& sub : m.modules(/*include_self=*/false)) {
    auto* s = dynamic_cast<mpipe::Stateful*>(sub.get());
    if (!s) continue;
    auto slots = std::any_cast<std::vector<torch::Tensor>>(s->save_state());
    for (auto& v : slots) v = v.detach();
    s->load_state(slots);
  }
}

}  // namespace

// Issue: the recompute of a checkpointed stage ran its stateful modules again
// from the state the forward had already advanced.
class CheckpointedState
    : public ::testing::TestWithParam<std::tuple<Schedule, Checkpoint, bool, bool>> {};

TEST_P(CheckpointedState, StatefulStagesEqualThePlainModel) {
  const auto [schedule, checkpoint, threads, fused] = GetParam();
  const int64_t batch = 8, split = 2;
  auto stages = stateful_stages(fused);
  auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads).checkpoint(checkpoint));
  for (auto& s : stages) pipe->append(s, "cpu");
  // The reference: the same model in a pipeline that never checkpoints.
  auto ref_stages = stateful_stages(fused);
  auto ref = ModelPipeline(ModelPipelineOptions().worker_threads(false));
  for (auto& s : ref_stages) ref->append(s, "cpu");
  torch::manual_seed(42);
  const auto x = torch::randn({batch, 5}, torch::kDouble) * 2;
  const auto target = torch::randn({batch, 3}, torch::kDouble);
  const auto options = schedule_options(schedule, split, 3);

  // Step 0 from rest against the plain model on the whole batch.
  auto loss = pipe->train_step(x, target, mse, options);
  auto grads = grads_of(*pipe);
  zero_grads(*pipe);
  const auto slots = slots_of(*pipe);
  mpipe::reset_states(*pipe);
  auto plain_loss = mse(plain_forward(stages, std::vector<torch::Device>(3, torch::kCPU), x), target);
  plain_loss.backward();
  expect_close(loss, plain_loss, 1e-12, "loss of step 0");
  expect_same_grads(grads, grads_of(*pipe), 1e-12);
  zero_grads(*pipe);
  const auto plain_slots = slots_of(*pipe);
  ASSERT_EQ(slots.size(), 3u);
  for (size_t k = 0; k < slots.size(); ++k) {
    ASSERT_EQ(slots[k].size(), static_cast<size_t>(batch / split)) << "state " << k;
    ASSERT_EQ(plain_slots[k].size(), 1u);
    // One forward per micro-batch: the states equal the plain model's.
    expect_close(torch::cat(slots[k], 0), plain_slots[k][0], 1e-12, "state " + std::to_string(k));
  }

  // Steps 1 to 3 continue from the states (detached) against the reference.
  mpipe::reset_states(*pipe);
  ref->train_step(x, target, mse, options);  // the reference's step 0
  zero_grads(*ref);
  const auto ref_slots = slots_of(*ref);
  for (size_t k = 0; k < ref_slots.size(); ++k) {
    for (size_t i = 0; i < ref_slots[k].size(); ++i) {
      expect_close(ref_slots[k][i], slots[k][i], 1e-12, "the reference's state after step 0");
    }
  }
  // Put step 0's states back into the pipeline under test.
  {
    size_t k = 0;
    for (const auto& sub : pipe->modules(false)) {
      if (auto* s = dynamic_cast<mpipe::Stateful*>(sub.get())) s->load_state(slots[k++]);
    }
  }
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    detach_states(*pipe);
    detach_states(*ref);
    auto l1 = pipe->train_step(x, target, mse, options);
    auto g1 = grads_of(*pipe);
    zero_grads(*pipe);
    auto l2 = ref->train_step(x, target, mse, options);
    expect_close(l1, l2, 1e-12, "loss");
    expect_same_grads(g1, grads_of(*ref), 1e-12);
    zero_grads(*ref);
    const auto a = slots_of(*pipe), b = slots_of(*ref);
    for (size_t k = 0; k < a.size(); ++k) {
      ASSERT_EQ(a[k].size(), b[k].size());
      for (size_t i = 0; i < a[k].size(); ++i) expect_close(a[k][i], b[k][i], 1e-12, "state");
    }
  }
}

namespace {
std::string checkpointed_state_name(
    const ::testing::TestParamInfo<std::tuple<Schedule, Checkpoint, bool, bool>>& info) {
  const Schedule schedule = std::get<0>(info.param);
  const Checkpoint checkpoint = std::get<1>(info.param);
  std::string s = schedule_name(schedule);
  s += checkpoint == Checkpoint::Never        ? "_Never"
       : checkpoint == Checkpoint::ExceptLast ? "_ExceptLast"
                                              : "_Always";
  return s + (std::get<2>(info.param) ? "_Threads" : "_Inline") +
         (std::get<3>(info.param) ? "_Fused" : "_ATen");
}
}  // namespace

INSTANTIATE_TEST_SUITE_P(
    Reliability, CheckpointedState,
    ::testing::Combine(::testing::ValuesIn(all_schedules()),
                       ::testing::Values(Checkpoint::Never, Checkpoint::ExceptLast,
                                         Checkpoint::Always),
                       ::testing::Bool(), ::testing::Bool()),
    checkpointed_state_name);

TEST(StatefulCheckpointing, ModulesWithoutSnapshotsAreRefused) {
  Leaky leaky(3, 0.5);
  leaky->snapshots = false;
  auto pipe = ModelPipeline(ModelPipelineOptions().checkpoint(Checkpoint::ExceptLast));
  pipe->append(torch::nn::Linear(3, 3), "cpu")
      .append(torch::nn::Sequential(torch::nn::Linear(3, 3), leaky), "cpu");
  const auto x = torch::randn({4, 3}), y = torch::randn({4, 3});
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, 2), "train_step", "stage 1",
                     "without state snapshots", "LeakyImpl", "Checkpoint::Never");
  EXPECT_TRUE(leaky->state.slots().empty()) << "refused before anything ran";
  // Without checkpointing, or in eval mode, the same pipeline runs.
  pipe->options.checkpoint(Checkpoint::Never);
  EXPECT_NO_THROW(pipe->train_step(x, y, mse, 2));
  pipe->options.checkpoint(Checkpoint::Always);
  pipe->eval();
  mpipe::reset_states(*pipe);
  EXPECT_NO_THROW(pipe->train_step(x, y, mse, 2));
}

TEST(StatefulCheckpointing, LossFunctionRunsOncePerMicroBatch) {
  for (auto checkpoint : {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
    for (auto schedule : all_schedules()) {
      auto pipe = ModelPipeline(ModelPipelineOptions().checkpoint(checkpoint));
      pipe->append(torch::nn::Linear(3, 3), "cpu").append(torch::nn::Linear(3, 3), "cpu");
      int calls = 0;
      pipe->train_step(torch::randn({8, 3}), torch::randn({8, 3}),
                       [&calls](const torch::Tensor& o, const torch::Tensor& t) {
                         ++calls;
                         return mse(o, t);
                       },
                       TrainStepOptions(2).schedule(schedule));
      EXPECT_EQ(calls, 4) << "4 micro-batches";
    }
  }
}
