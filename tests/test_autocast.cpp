// Autocast: the caller's autocast state reaching every stage of every call
// kind (threaded and inline, with checkpointing), stages with bf16 weights,
// and mpipe::Linear's cached casts and per-step cast gradients. Loss scaling
// is in test_grad_scaler.cpp; neurons in half and bfloat16 in test_snn.cpp.

#include "common.h"

#include <mpipe/autocast.h>
#include <mpipe/grad_scaler.h>
#include <mpipe/linear.h>
#include <mpipe/snn.h>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cmath>
#include <limits>

using namespace mpipe_test;
using mpipe::AutocastGuard;
using mpipe::Checkpoint;
using mpipe::GradScaler;
using mpipe::GradScalerOptions;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Schedule;
using mpipe::TrainStepOptions;

namespace {

void expect_rel_grads(const std::map<std::string, torch::Tensor>& a,
                      const std::map<std::string, torch::Tensor>& b, double rtol) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& kv : a) {
    ASSERT_TRUE(kv.second.defined() && b.at(kv.first).defined()) << kv.first;
    expect_rel(kv.second, b.at(kv.first), rtol, "grad of " + kv.first);
  }
}

/// Leaky that tells when it holds state, so that calls may run as CUDA graphs.
struct TrackedLeakyImpl : LeakyImpl {
  using LeakyImpl::LeakyImpl;
  bool holds_state() const override { return !state.slots().empty(); }
};
TORCH_MODULE(TrackedLeaky);

/// Three stages in float32: Linear+Tanh, a stateful Linear+leaky stage, Linear.
struct Model {
  explicit Model(int64_t width) {
    stages.push_back(mlp_stage(width, width, 1));
    torch::nn::Sequential leaky;
    leaky->push_back(TrackedLeaky(width, 0.6));
    stages.push_back(leaky);
    torch::nn::Sequential last;
    last->push_back(torch::nn::Linear(width, width));
    stages.push_back(last);
  }
  ModelPipeline pipeline(bool threads, Checkpoint checkpoint = Checkpoint::Never) const {
    ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads).checkpoint(checkpoint));
    for (auto s : stages) pipe->append(s, "cpu");
    return pipe;
  }
  torch::Tensor plain(torch::Tensor x) const {
    for (auto s : stages) x = s->forward(x);
    return x;
  }
  void reset() const {
    for (auto s : stages) mpipe::reset_states(*s);
  }
  std::map<std::string, torch::Tensor> grads() const {
    std::map<std::string, torch::Tensor> out;
    for (size_t j = 0; j < stages.size(); ++j) {
      for (const auto& kv : grads_of(*torch::nn::Sequential(stages[j]))) out[std::to_string(j) + "." + kv.first] = kv.second;
    }
    return out;
  }
  void zero() const {
    for (auto s : stages) zero_grads(*s);
  }
  std::vector<torch::nn::Sequential> stages;
};

/// The rows of micro-batch i of `x` split `split` rows at a time.
torch::Tensor rows(const torch::Tensor& x, int64_t i, int64_t split) {
  return x.narrow(0, i * split, std::min(split, x.size(0) - i * split));
}

class AutocastCall : public ::testing::TestWithParam<bool> {};

}  // namespace

TEST(Autocast, GuardSetsAndRestoresTheThreadsState) {
  auto probe = [] {  // what a Linear returns is the state's witness
    torch::NoGradGuard no_grad;
    return torch::nn::Linear(2, 2)(torch::ones({1, 2})).scalar_type();
  };
  EXPECT_EQ(probe(), torch::kFloat);
  {
    AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(probe(), torch::kBFloat16);
    {
      AutocastGuard off(torch::kCPU, torch::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(probe(), torch::kFloat);
    }
    EXPECT_EQ(probe(), torch::kBFloat16);
  }
  EXPECT_EQ(probe(), torch::kFloat);
  MPIPE_EXPECT_ERROR((void)AutocastGuard(torch::kCPU, torch::kFloat), "BFloat16 or Half", "Float");
  MPIPE_EXPECT_ERROR((void)AutocastGuard(torch::kMeta), "CPU or CUDA");
  EXPECT_EQ(probe(), torch::kFloat) << "a refused guard changes nothing";
}

TEST_P(AutocastCall, ForwardCallsRunEveryStageUnderTheCallersAutocast) {
  torch::manual_seed(31);
  const Model model(16);
  auto pipe = model.pipeline(GetParam());
  const auto x = torch::randn({12, 16});
  torch::NoGradGuard no_grad;
  AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
  {  // forward, 3 micro-batches of 4 rows
    model.reset();
    const auto y = pipe->forward(x, 4);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16) << "the last stage's Linear ran under autocast";
    std::vector<torch::Tensor> parts;
    for (int64_t i = 0; i < 3; ++i) {
      model.reset();
      parts.push_back(model.plain(rows(x, i, 4)));
    }
    expect_close(y, torch::cat(parts), 0, "forward");
  }
  for (bool reduce : {true, false}) {  // constant_forward: 5 steps, state carried
    SCOPED_TRACE(reduce ? "reduce" : "no reduce");
    model.reset();
    const auto y = pipe->constant_forward(x, 5, reduce);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    model.reset();
    std::vector<torch::Tensor> outs;
    for (int t = 0; t < 5; ++t) outs.push_back(model.plain(x));
    expect_rel(y, reduce ? torch::stack(outs).sum(0) : torch::cat(outs), reduce ? 2e-2 : 0,
               "constant_forward");
  }
  {  // sequence_forward: 4 steps, time-major
    const auto seq = torch::randn({4, 6, 16});
    model.reset();
    const auto y = pipe->sequence_forward(seq);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    model.reset();
    std::vector<torch::Tensor> outs;
    for (int64_t t = 0; t < 4; ++t) outs.push_back(model.plain(seq[t]));
    expect_close(y, torch::stack(outs), 0, "sequence_forward");
  }
  model.reset();
}

TEST_P(AutocastCall, TrainStepMatchesPlainAutocastUnderEveryScheduleAndCheckpointing) {
  torch::manual_seed(32);
  const Model model(16);
  const auto x = torch::randn({12, 16});
  const auto target = torch::randn({12, 16});
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); };
  // The reference: the same micro-batches under autocast, one backward each
  // outside it. Casts are not cached on either side, so each micro-batch has
  // its own cast of the weights, as each of the pipeline's backwards does.
  model.zero();
  torch::Tensor loss_ref;
  for (int64_t i = 0; i < 3; ++i) {
    torch::Tensor loss;
    model.reset();
    {
      AutocastGuard bf16(torch::kCPU, torch::kBFloat16, true, /*cache=*/false);
      loss = loss_fn(model.plain(rows(x, i, 4)), rows(target, i, 4)) * (4.0 / 12);
    }
    EXPECT_EQ(loss.scalar_type(), torch::kFloat) << "mse_loss runs in float32 under autocast";
    loss.backward();
    loss_ref = loss_ref.defined() ? loss_ref + loss.detach() : loss.detach();
  }
  const auto grads_ref = model.grads();
  model.zero();
  model.reset();
  for (auto checkpoint : {Checkpoint::Never, Checkpoint::Always}) {
    auto pipe = model.pipeline(GetParam(), checkpoint);
    for (auto schedule : all_schedules()) {
      SCOPED_TRACE(schedule_name(schedule) +
                   (checkpoint == Checkpoint::Never ? "" : ", checkpointed"));
      torch::Tensor loss;
      {
        AutocastGuard bf16(torch::kCPU, torch::kBFloat16, true, /*cache=*/false);
        loss = pipe->train_step(x, target, loss_fn, schedule_options(schedule, 4, 3));
      }
      // A stage run in float32 (no autocast on its worker, or in its
      // recompute) would move these by ~1e-3.
      expect_rel(loss, loss_ref, 1e-5, "loss");
      expect_rel_grads(model.grads(), grads_ref, 1e-5);
      model.zero();
      model.reset();
    }
  }
}

TEST_P(AutocastCall, ConstantTrainStepMatchesPlainAutocast) {
  torch::manual_seed(33);
  const Model model(8);
  auto pipe = model.pipeline(GetParam());
  const auto x = torch::randn({5, 8});
  const auto target = torch::randn({5, 8});
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) {
    return (o / 3 - t).pow(2).mean();
  };
  torch::Tensor loss;
  {
    AutocastGuard bf16(torch::kCPU, torch::kBFloat16, true, /*cache=*/false);
    loss = pipe->constant_train_step(x, 3, target, loss_fn);
  }
  const auto grads = model.grads();
  model.zero();
  model.reset();
  torch::Tensor loss_ref;
  {
    AutocastGuard bf16(torch::kCPU, torch::kBFloat16, true, /*cache=*/false);
    torch::Tensor out;
    for (int t = 0; t < 3; ++t) {
      auto y = model.plain(x);
      out = out.defined() ? out + y : y;
    }
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    loss_ref = loss_fn(out, target);
  }
  loss_ref.backward();
  // bf16 sums over the time steps, in another order: a few bf16 ulps apart at
  // most (a float32 stage would be ~1e-2 apart).
  expect_rel(loss, loss_ref, 1e-5, "loss");
  expect_rel_grads(grads, model.grads(), 1e-3);
  model.zero();
  model.reset();
}

TEST_P(AutocastCall, WorkersKeepNoCastOfOldWeightsBetweenCalls) {
  // Casts are cached by default. The caller's cache goes when it leaves its
  // autocast scope; LibTorch 1.13's per-worker caches must go too, or the next
  // call would use the bf16 copy of weights an optimizer has since changed.
  torch::manual_seed(34);
  const Model model(16);
  auto pipe = model.pipeline(GetParam());
  const auto x = torch::randn({8, 16});
  torch::NoGradGuard no_grad;
  {
    AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
    pipe->forward(x, 4);
  }
  for (auto& p : pipe->parameters()) p.add_(0.5);  // an optimizer step, in place
  model.reset();
  torch::Tensor y, ref;
  {
    AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
    y = pipe->forward(x, 8);
  }
  model.reset();
  {
    AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
    ref = model.plain(x);
  }
  model.reset();
  expect_close(y, ref, 0, "the second call sees the new weights");
}

TEST_P(AutocastCall, OneScopeAroundSeveralStepsSeesEveryUpdate) {
  // A guard around the whole loop: casts cached by one call must not reach
  // the next once the optimizer has changed the weights.
  torch::manual_seed(38);
  const Model model(16);
  auto pipe = model.pipeline(GetParam());
  const auto x = torch::randn({8, 16});
  const auto target = torch::randn({8, 16});
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); };
  torch::optim::SGD opt(pipe->parameters(), 0.5);
  AutocastGuard bf16(torch::kCPU, torch::kBFloat16);  // cache on, for the whole test
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    torch::Tensor want;
    {
      AutocastGuard fresh(torch::kCPU, torch::kBFloat16, true, /*cache=*/false);
      torch::NoGradGuard no_grad;
      model.reset();
      want = loss_fn(model.plain(x), target);
    }
    opt.zero_grad();
    model.reset();
    const auto loss = pipe->train_step(x, target, loss_fn, TrainStepOptions(8));
    expect_rel(loss, want, 1e-6, "the loss of the current weights");
    opt.step();
  }
  model.reset();
}

TEST_P(AutocastCall, StagesWithBFloat16WeightsMatchThePlainModel) {
  torch::manual_seed(35);
  Model model(16);
  for (auto& s : model.stages) s->to(torch::kBFloat16);
  const auto x = torch::randn({8, 16}).to(torch::kBFloat16);
  const auto target = torch::randn({8, 16}).to(torch::kBFloat16);
  for (auto checkpoint : {Checkpoint::Never, Checkpoint::ExceptLast}) {
    auto pipe = model.pipeline(GetParam(), checkpoint);
    {
      torch::NoGradGuard no_grad;
      model.reset();
      const auto y = pipe->forward(x, 8);
      EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
      model.reset();
      expect_close(y, model.plain(x), 0, "forward");
    }
    auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) {
      return (o - t).pow(2).mean();  // LibTorch 1.13's CPU mse_loss has no bf16 kernel
    };
    for (auto schedule : all_schedules()) {
      SCOPED_TRACE(schedule_name(schedule));
      model.reset();
      // One micro-batch: the same operations as the plain model, in bf16.
      const auto loss = pipe->train_step(x, target, loss_fn, schedule_options(schedule, 8, 3));
      EXPECT_EQ(loss.scalar_type(), torch::kBFloat16);
      const auto grads = model.grads();
      model.zero();
      model.reset();
      auto ref = loss_fn(model.plain(x), target);
      ref.backward();
      expect_close(loss, ref, 0, "loss");
      for (const auto& kv : model.grads()) {
        EXPECT_EQ(grads.at(kv.first).scalar_type(), torch::kBFloat16) << kv.first;
        expect_close(grads.at(kv.first), kv.second, 0, "grad of " + kv.first);
      }
      model.zero();
      // Two micro-batches: bf16 gradients summed in another order.
      model.reset();
      pipe->train_step(x, target, loss_fn, schedule_options(schedule, 4, 3));
      const auto split_grads = model.grads();
      model.zero();
      expect_rel_grads(split_grads, grads, 3e-2);
    }
  }
  model.reset();
}

TEST_P(AutocastCall, AFailedCallLeavesNoAutocastStateBehind) {
  torch::manual_seed(37);
  auto first = mlp_stage(8, 8, 1), last = mlp_stage(8, 8, 1);
  Failing failing(1);  // throws at its second call: micro-batch 1
  ModelPipeline pipe(ModelPipelineOptions().worker_threads(GetParam()));
  pipe->append(first, "cpu").append(failing, "cpu").append(last, "cpu");
  const auto x = torch::randn({8, 8});
  {
    torch::NoGradGuard no_grad;
    AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
    MPIPE_EXPECT_ERROR(pipe->forward(x, 4), "stage 1", "micro-batch 1 of 2", "planted failure");
  }
  // The workers and the caller are back to no autocast: float32 everywhere.
  torch::NoGradGuard no_grad;
  const auto y = pipe->forward(x, 4);
  EXPECT_EQ(y.scalar_type(), torch::kFloat);
  expect_close(y, last->forward(failing(first->forward(x))), 1e-6, "the next call, without autocast");
  EXPECT_EQ(torch::nn::Linear(2, 2)(torch::ones({1, 2})).scalar_type(), torch::kFloat);
}

namespace {

/// Counts the casts of float32 tensors of `shape` (aten::_to_copy) made while
/// it lives, on this thread and on the threads that take this thread's state
/// (the pipeline's workers and the autograd engine's threads do). A callback
/// of this thread, not a global one: removing a global callback takes a mutex
/// inside LibTorch that ThreadSanitizer cannot see.
class CastCounter {
 public:
  explicit CastCounter(std::vector<int64_t> shape) {
    shape_ = std::move(shape);
    count_ = 0;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (std::string(fn.name()) != "aten::_to_copy") return nullptr;
              const auto inputs = fn.inputs();
              if (!inputs.empty() && inputs[0].isTensor()) {
                const auto& t = inputs[0].toTensor();
                if (t.scalar_type() == torch::kFloat && t.sizes().vec() == shape_) ++count_;
              }
              return nullptr;
            })
            .needsInputs(true)
            .scopes({at::RecordScope::FUNCTION}));
  }
  ~CastCounter() { at::removeCallback(handle_); }
  CastCounter(const CastCounter&) = delete;
  CastCounter& operator=(const CastCounter&) = delete;
  int count() const { return count_.load(); }

 private:
  static std::vector<int64_t> shape_;
  static std::atomic<int> count_;
  at::CallbackHandle handle_;
};
std::vector<int64_t> CastCounter::shape_;
std::atomic<int> CastCounter::count_{0};

/// Casts of the [24, 24] weights in a plain loop over micro-batches and in
/// the pipeline, forward (8 micro-batches) and training step (4).
struct CastCounts {
  int plain_forward = 0, forward = 0, plain_train = 0, train = 0;
};

/// With torch::nn::Linear, or mpipe::Linear (`aten_linear`).
CastCounts count_casts(const std::string& device, bool threads, bool aten_linear) {
  torch::manual_seed(39);
  ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads));
  std::vector<torch::nn::Sequential> stages;
  for (int s = 0; s < 3; ++s) {  // 3 [24, 24] weights
    if (aten_linear) {
      stages.push_back(torch::nn::Sequential(mpipe::Linear(24, 24), torch::nn::Tanh()));
    } else {
      stages.push_back(mlp_stage(24, 24, 1));
    }
    pipe->append(stages.back(), device);
  }
  const auto x = torch::randn({32, 24}, torch::Device(device));
  const auto target = torch::randn({32, 24}, torch::Device(device));
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); };
  auto plain = [&](torch::Tensor h) {
    for (auto& s : stages) h = s->forward(h);
    return h;
  };
  CastCounts out;
  AutocastGuard bf16(torch::Device(device).type(), torch::kBFloat16);
  {
    torch::NoGradGuard no_grad;
    {
      CastCounter casts({24, 24});
      for (int64_t i = 0; i < 8; ++i) plain(rows(x, i, 4));
      out.plain_forward = casts.count();
    }
    at::autocast::clear_cache();  // each call starts without cached casts
    CastCounter casts({24, 24});
    pipe->forward(x, 4);
    out.forward = casts.count();
  }
  {
    at::autocast::clear_cache();
    CastCounter casts({24, 24});
    for (int64_t i = 0; i < 4; ++i) loss_fn(plain(rows(x, i, 8)), rows(target, i, 8)).backward();
    out.plain_train = casts.count();
  }
  {
    CastCounter casts({24, 24});
    pipe->train_step(x, target, loss_fn, TrainStepOptions(8));
    out.train = casts.count();
  }
  return out;
}

}  // namespace

TEST_P(AutocastCall, WeightsAreCastOncePerCallWithMpipeLinear) {
  // torch::nn::Linear's weight is cast at every call (Note [Linear under
  // autocast]): the pipeline casts as often as a plain loop over the
  // micro-batches, no more. mpipe::Linear's is cast once per call, however
  // many micro-batches.
  {
    const auto n = count_casts("cpu", GetParam(), /*aten_linear=*/false);
    EXPECT_EQ(n.plain_forward, 24) << "torch::nn::Linear: 3 weights x 8 micro-batches";
    EXPECT_EQ(n.forward, n.plain_forward);
    EXPECT_EQ(n.train, n.plain_train);
  }
  const auto n = count_casts("cpu", GetParam(), /*aten_linear=*/true);
  EXPECT_EQ(n.plain_forward, 3);
  EXPECT_EQ(n.forward, 3) << "forward: one cast per weight, not one per micro-batch";
  EXPECT_EQ(n.plain_train, 3);
  EXPECT_EQ(n.train, 3) << "train_step: one cast per weight, not one per micro-batch";
}

TEST(MpipeLinear, IsTorchLinearWithACachedCast) {
  torch::manual_seed(5);
  torch::nn::Linear torch_linear(torch::nn::LinearOptions(6, 4));
  torch::manual_seed(5);
  mpipe::Linear linear(torch::nn::LinearOptions(6, 4));
  expect_close(linear->weight, torch_linear->weight, 0, "same initialisation");
  expect_close(linear->bias, torch_linear->bias, 0, "same initialisation");
  const auto x = torch::randn({5, 6});
  expect_close(linear(x), torch_linear(x), 0, "2-D input: the same addmm");
  const auto x3 = torch::randn({2, 5, 6});
  expect_close(linear(x3), torch_linear(x3), 1e-6, "3-D input");
  // Same names, so state dicts move between the two.
  std::vector<std::string> names, torch_names;
  for (const auto& p : linear->named_parameters()) names.push_back(p.key());
  for (const auto& p : torch_linear->named_parameters()) torch_names.push_back(p.key());
  EXPECT_EQ(names, torch_names);
  mpipe::Linear no_bias(torch::nn::LinearOptions(6, 4).bias(false));
  EXPECT_FALSE(no_bias->bias.defined());
  EXPECT_EQ(no_bias->parameters().size(), 1u);
  // A clone is an mpipe::Linear with its own parameters.
  auto copy = std::dynamic_pointer_cast<mpipe::LinearImpl>(linear->clone());
  ASSERT_TRUE(copy);
  EXPECT_NE(copy->weight.data_ptr(), linear->weight.data_ptr());
  expect_close(copy->forward(x), linear(x), 0, "clone");
  std::ostringstream printed;
  printed << *linear;
  EXPECT_EQ(printed.str(), "mpipe::Linear(in_features=6, out_features=4, bias=true)");
}

namespace {

/// Three stages of mpipe::Linear (Tanh, ReLU between) on `device`.
struct LinearModel {
  LinearModel(int64_t width, const std::string& device) {
    torch::manual_seed(37);
    for (int s = 0; s < 3; ++s) {
      torch::nn::Sequential stage(mpipe::Linear(width, width));
      if (s == 0) stage->push_back(torch::nn::Tanh());
      if (s == 1) stage->push_back(torch::nn::ReLU());
      stage->to(torch::Device(device));
      stages.push_back(stage);
    }
  }
  std::vector<mpipe::LinearImpl*> linears() const {
    std::vector<mpipe::LinearImpl*> out;
    for (auto s : stages) out.push_back(s[0]->as<mpipe::LinearImpl>());
    return out;
  }
  std::map<std::string, torch::Tensor> grads() const {
    std::map<std::string, torch::Tensor> out;
    for (size_t j = 0; j < stages.size(); ++j) {
      for (const auto& kv : grads_of(*stages[j])) out[std::to_string(j) + "." + kv.first] = kv.second;
    }
    return out;
  }
  void zero() const {
    for (auto s : stages) zero_grads(*s);
  }
  /// The step of Note [Cast gradients per step] written out: one bf16 leaf
  /// copy of each weight, the micro-batches' backwards summing into it, one
  /// addition to .grad at the end. `copies` false: the weights themselves
  /// (each micro-batch's gradient converted and added on its own).
  torch::Tensor reference_step(const torch::Tensor& x, const torch::Tensor& target, int64_t split,
                               torch::DeviceType type, bool copies) const {
    std::vector<torch::Tensor> ws;
    for (auto* l : linears()) {
      ws.push_back(copies ? l->weight.detach().to(torch::kBFloat16).requires_grad_() : l->weight);
    }
    torch::Tensor total;
    const int64_t n = (x.size(0) + split - 1) / split;
    for (int64_t i = 0; i < n; ++i) {
      torch::Tensor loss;
      {
        AutocastGuard bf16(type, torch::kBFloat16);
        torch::Tensor h = rows(x, i, split);
        const auto ls = linears();
        for (size_t j = 0; j < ls.size(); ++j) {
          h = at::linear(h, ws[j], ls[j]->bias);
          if (j == 0) h = torch::tanh(h);
          if (j == 1) h = torch::relu(h);
        }
        loss = torch::mse_loss(h, rows(target, i, split)) *
               (static_cast<double>(rows(x, i, split).size(0)) / static_cast<double>(x.size(0)));
      }
      loss.backward();
      total = total.defined() ? total + loss.detach() : loss.detach();
    }
    if (copies) {
      const auto ls = linears();
      for (size_t j = 0; j < ls.size(); ++j) {
        torch::NoGradGuard no_grad;
        auto& g = ls[j]->weight.mutable_grad();
        g = g.defined() ? g + ws[j].grad() : ws[j].grad().to(torch::kFloat);
      }
    }
    return total;
  }
  std::vector<torch::nn::Sequential> stages;
};

/// train_step under bf16 autocast with mpipe::Linear stages sums each cast
/// weight's gradients per step: the same numbers as the step written out,
/// under every schedule, with and without checkpointing; with the option off,
/// those of the plain loop; a failed step adds nothing; two steps add up.
void check_cast_grads(const std::string& device, bool threads, double tol) {
  const auto type = torch::Device(device).type();
  const LinearModel model(16, device);
  const auto x = torch::randn({12, 16}, torch::Device(device));
  const auto target = torch::randn({12, 16}, torch::Device(device));
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); };
  for (bool on : {true, false}) {
    model.zero();
    const auto loss_ref = model.reference_step(x, target, 4, type, /*copies=*/on);
    const auto ref = model.grads();
    model.zero();
    for (auto checkpoint : {Checkpoint::Never, Checkpoint::Always}) {
      ModelPipeline pipe(ModelPipelineOptions()
                             .worker_threads(threads)
                             .checkpoint(checkpoint)
                             .accumulate_cast_grads(on));
      for (auto s : model.stages) pipe->append(s, device);
      for (auto schedule : all_schedules()) {
        SCOPED_TRACE(schedule_name(schedule) + (on ? ", summed per step" : ", option off") +
                     (checkpoint == Checkpoint::Never ? "" : ", checkpointed"));
        torch::Tensor loss;
        {
          AutocastGuard bf16(type, torch::kBFloat16);
          loss = pipe->train_step(x, target, loss_fn, schedule_options(schedule, 4, 3));
        }
        expect_close(loss, loss_ref, tol, "loss");
        expect_same_grads(model.grads(), ref, tol);
        model.zero();
      }
    }
  }
  // Both ways agree within bf16's rounding.
  model.reference_step(x, target, 4, type, true);
  const auto summed = model.grads();
  model.zero();
  model.reference_step(x, target, 4, type, false);
  expect_rel_grads(summed, model.grads(), 1e-2);
  model.zero();

  ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads));
  for (auto s : model.stages) pipe->append(s, device);
  AutocastGuard bf16(type, torch::kBFloat16);
  // A step that fails at micro-batch 2 adds none of its gradients.
  int calls = 0;
  auto failing = [&](const torch::Tensor& o, const torch::Tensor& t) {
    TORCH_CHECK(++calls != 3, "loss refused");
    return torch::mse_loss(o, t);
  };
  EXPECT_THROW(pipe->train_step(x, target, failing, TrainStepOptions(4)), c10::Error);
  for (const auto& kv : model.grads()) {
    EXPECT_FALSE(kv.second.defined() && kv.second.abs().sum().item<double>() != 0) << kv.first;
  }
  model.zero();
  // Then two steps without zeroing: twice one step's gradients.
  pipe->train_step(x, target, loss_fn, TrainStepOptions(4));
  const auto once = model.grads();
  pipe->train_step(x, target, loss_fn, TrainStepOptions(4));
  for (const auto& kv : model.grads()) expect_close(kv.second, once.at(kv.first) * 2, tol, kv.first);
  model.zero();
}

}  // namespace

TEST_P(AutocastCall, MpipeLinearSumsCastGradientsPerStep) { check_cast_grads("cpu", GetParam(), 0); }

INSTANTIATE_TEST_SUITE_P(Cpu, AutocastCall, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Threads" : "Inline";
                         });

#ifdef MPIPE_TEST_WITH_CUDA
TEST(AutocastCuda, EachWeightIsCastOncePerCall_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  for (bool threads : {true, false}) {
    SCOPED_TRACE(threads ? "threads" : "inline");
    {  // torch::nn::Linear: a cast per call (Note [Linear under autocast])
      const auto n = count_casts("cuda:0", threads, /*aten_linear=*/false);
      EXPECT_EQ(n.plain_forward, 24);
      EXPECT_EQ(n.forward, 24);
      EXPECT_EQ(n.plain_train, 12);
      EXPECT_EQ(n.train, 12);
    }
    const auto n = count_casts("cuda:0", threads, /*aten_linear=*/true);
    EXPECT_EQ(n.plain_forward, 3) << "a plain loop casts each weight once";
    EXPECT_EQ(n.forward, 3) << "forward: one cast per weight, not one per micro-batch";
    EXPECT_EQ(n.plain_train, 3);
    EXPECT_EQ(n.train, 3) << "train_step: one cast per weight, not one per micro-batch";
  }
}

TEST(AutocastCuda, AGraphCastsEachWeightOnceAndReplaysSeeNewWeights_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  torch::manual_seed(40);
  ModelPipeline pipe(ModelPipelineOptions().cuda_graphs(true));
  std::vector<torch::nn::Sequential> stages;
  for (int s = 0; s < 3; ++s) {
    stages.push_back(torch::nn::Sequential(mpipe::Linear(24, 24), torch::nn::Tanh()));
    pipe->append(stages.back(), "cuda:0");
  }
  const auto x = torch::randn({32, 24}, torch::kCUDA);
  auto plain = [&] {  // the micro-batches one after another, fresh casts
    AutocastGuard bf16(torch::kCUDA, torch::kBFloat16);
    std::vector<torch::Tensor> parts;
    for (int64_t i = 0; i < 8; ++i) {
      auto h = rows(x, i, 4);
      for (auto& s : stages) h = s->forward(h);
      parts.push_back(h);
    }
    return torch::cat(parts);
  };
  torch::NoGradGuard no_grad;
  for (int call = 0; call < 4; ++call) {  // capture, then replays
    SCOPED_TRACE("call " + std::to_string(call));
    torch::Tensor y;
    int casts = 0;
    {
      AutocastGuard bf16(torch::kCUDA, torch::kBFloat16);
      CastCounter counter({24, 24});
      y = pipe->forward(x, 4);
      casts = counter.count();
    }
    // The first call warms up and captures, one cast per weight each; a
    // replay dispatches no op, its casts are kernels in the graph.
    EXPECT_EQ(casts, call == 0 ? 6 : 0);
    expect_close(y, plain(), 0, "the graph's result");
    for (auto& p : pipe->parameters()) p.mul_(0.9);  // an optimizer step: replays cast anew
  }
  EXPECT_EQ(pipe->cuda_graphs_captured(), 1u);
}

TEST(AutocastCuda, MpipeLinearSumsCastGradientsPerStep_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  for (bool threads : {true, false}) check_cast_grads("cuda:0", threads, 1e-6);
}

TEST(AutocastCuda, EveryCallKindInBFloat16EagerAndGraphed_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  torch::manual_seed(36);
  Model model(64);
  for (auto& s : model.stages) s->to(torch::kCUDA);
  const auto x = torch::randn({32, 64}, torch::kCUDA);
  const auto target = torch::randn({32, 64}, torch::kCUDA);
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) { return torch::mse_loss(o, t); };
  for (bool graphs : {false, true}) {
    for (bool threads : {true, false}) {
      SCOPED_TRACE(std::string(graphs ? "graphed" : "eager") + (threads ? ", threads" : ", inline"));
      ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads).cuda_graphs(graphs));
      for (auto s : model.stages) pipe->append(s, "cuda:0");
      {
        torch::NoGradGuard no_grad;
        AutocastGuard bf16(torch::kCUDA, torch::kBFloat16);
        for (int rep = 0; rep < 2; ++rep) {  // graphed: capture, then replay
          model.reset();
          const auto y = pipe->forward(x, 8);
          EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
          std::vector<torch::Tensor> parts;
          for (int64_t i = 0; i < 4; ++i) {
            model.reset();
            parts.push_back(model.plain(rows(x, i, 8)));
          }
          expect_rel(y, torch::cat(parts), 1e-2, "forward");
          model.reset();
          const auto c = pipe->constant_forward(x, 3, false);
          EXPECT_EQ(c.scalar_type(), torch::kBFloat16);
        }
        if (graphs) EXPECT_GE(pipe->cuda_graphs_captured(), 2u) << "forward and constant_forward";
      }
      model.zero();
      torch::Tensor ref_loss;
      for (int64_t i = 0; i < 4; ++i) {
        model.reset();
        torch::Tensor l;
        {
          AutocastGuard bf16(torch::kCUDA, torch::kBFloat16, true, false);
          l = loss_fn(model.plain(rows(x, i, 8)), rows(target, i, 8)) * 0.25;
        }
        l.backward();
        ref_loss = ref_loss.defined() ? ref_loss + l.detach() : l.detach();
      }
      const auto ref = model.grads();
      model.zero();
      for (auto schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubbleH1}) {
        model.reset();
        torch::Tensor loss;
        {
          AutocastGuard bf16(torch::kCUDA, torch::kBFloat16, true, false);
          loss = pipe->train_step(x, target, loss_fn, schedule_options(schedule, 8, 3));
        }
        expect_rel(loss, ref_loss, 1e-3, "loss");
        expect_rel_grads(model.grads(), ref, 1e-3);
        model.zero();
      }
      if (graphs) {  // cached casts of eager steps must not keep the step from being captured
        const auto before = pipe->cuda_graphs_captured();
        AutocastGuard bf16(torch::kCUDA, torch::kBFloat16);  // cache on
        for (int k = 0; k < 3; ++k) {
          model.reset();
          pipe->train_step(x, target, loss_fn, schedule_options(Schedule::GPipe, 8, 3));
        }
        EXPECT_GT(pipe->cuda_graphs_captured(), before) << "the graphed step was captured";
        model.zero();
      }
    }
  }
  model.reset();
}
#endif
