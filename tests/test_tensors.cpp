// Stages with several tensors (mpipe/tensors.h) and skip connections across
// stages (mpipe/skip.h): values and gradients against the plain model under
// every call kind, schedule, checkpointing mode and runtime mode, and the
// errors of wrong use.

#include "common.h"

#include <mpipe/mpipe.h>

#include <functional>
#include <tuple>

using namespace mpipe_test;
using mpipe::Checkpoint;
using mpipe::Input;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Schedule;
using mpipe::Tensors;
using mpipe::TrainStepOptions;

namespace {

constexpr int64_t W = 6;

// ---------------------------------------------------------------------------
// A three-stage model whose stages pass (features, mask): stage 0 takes two
// tensors and returns a tuple, stage 1 takes and returns mpipe::Tensors and
// keeps a state per micro-batch, stage 2 takes two tensors and returns one (or
// two, for the forward-type calls).

struct MaskedInImpl : torch::nn::Module {
  MaskedInImpl() { fc = register_module("fc", torch::nn::Linear(W, W)); }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor mask) {
    return {torch::tanh(fc(x)) * mask, mask};
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(MaskedIn);

struct MaskedStateImpl : torch::nn::Module, mpipe::Stateful {
  MaskedStateImpl() { fc = register_module("fc", torch::nn::Linear(W, W)); }
  Tensors forward(const Tensors& in) {
    torch::Tensor& v = state.get();
    const torch::Tensor h = fc(in[0]);
    v = v.defined() ? v * 0.5 + h : h;
    return {torch::tanh(v) + in[1], in[1]};
  }
  void reset_state() override { state.clear(); }
  bool supports_state_snapshots() const override { return true; }
  std::any save_state() const override { return state.save(); }
  void load_state(const std::any& s) override { state.load(s); }
  torch::nn::Linear fc{nullptr};
  mpipe::PerMicroBatch<torch::Tensor> state;
};
TORCH_MODULE(MaskedState);

struct MaskedOutImpl : torch::nn::Module {
  MaskedOutImpl() { fc = register_module("fc", torch::nn::Linear(W, 3)); }
  Tensors forward(const Tensors& in) {
    torch::Tensor y = fc(in[0] * in[1]);
    if (!two_outputs) return {y};
    return {y, (in[0] * in[1]).sum(1, /*keepdim=*/true)};
  }
  torch::nn::Linear fc{nullptr};
  bool two_outputs = true;
};
TORCH_MODULE(MaskedOut);

struct MaskedModel {
  MaskedModel(bool threaded, Checkpoint ckpt = Checkpoint::Never) {
    pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threaded).checkpoint(ckpt));
    pipe->append(s0, "cpu").append(s1, "cpu").append(s2, "cpu");
    pipe->to(torch::kDouble);
  }
  /// The plain model on whole tensors: what the pipeline must equal.
  Tensors plain(const torch::Tensor& x, const torch::Tensor& mask) {
    auto a = s0->forward(x, mask);
    auto b = s1->forward({std::get<0>(a), std::get<1>(a)});
    return s2->forward(b);
  }
  MaskedIn s0;
  MaskedState s1;
  MaskedOut s2;
  ModelPipeline pipe{nullptr};
};

/// Inputs of batch `n`: x [n, W] and the unbatched mask [W], both needing grad.
std::pair<torch::Tensor, torch::Tensor> masked_inputs(int64_t n) {
  auto x = torch::randn({n, W}, torch::kDouble);
  auto mask = torch::rand({W}, torch::kDouble) + 0.5;
  return {x, mask};
}

torch::Tensor leaf_copy(const torch::Tensor& t) { return t.detach().clone().requires_grad_(); }

/// Backpropagates sum(out_k^2) over the outputs and returns the outputs,
/// detached, with the inputs' gradients and the parameters' gradients.
struct Result {
  Tensors out;
  torch::Tensor gx, gmask;
  std::map<std::string, torch::Tensor> grads;
};

template <typename Call>
Result run_and_backprop(torch::nn::Module& model, const torch::Tensor& x0,
                        const torch::Tensor& mask0, Call call) {
  auto x = leaf_copy(x0), mask = leaf_copy(mask0);
  Tensors out = call(x, mask);
  torch::Tensor total = torch::zeros({}, torch::kDouble);
  for (const auto& o : out) total = total + o.pow(2).sum();
  total.backward();
  Result r;
  for (const auto& o : out) r.out.push_back(o.detach());
  r.gx = x.grad();
  r.gmask = mask.grad();
  r.grads = grads_of(model);
  zero_grads(model);
  return r;
}

void expect_same(const Result& a, const Result& b, double tol = 1e-12) {
  ASSERT_EQ(a.out.size(), b.out.size());
  for (size_t k = 0; k < a.out.size(); ++k) {
    expect_close(a.out[k], b.out[k], tol, "output " + std::to_string(k));
  }
  expect_close(a.gx, b.gx, tol, "grad of x");
  expect_close(a.gmask, b.gmask, tol, "grad of the unbatched mask");
  expect_same_grads(a.grads, b.grads, tol);
}

class MultiTensor : public ::testing::TestWithParam<bool> {};

TEST_P(MultiTensor, ForwardSplitsBatchedInputsAndGivesUnbatchedOnesWhole) {
  torch::manual_seed(1);
  MaskedModel m(GetParam());
  const auto inputs = masked_inputs(7);
  const torch::Tensor x = inputs.first, mask = inputs.second;
  mpipe::reset_states(*m.pipe);
  const Result plain = run_and_backprop(*m.pipe, x, mask, [&](auto x_, auto mask_) {
    auto out = m.plain(x_, mask_);
    mpipe::reset_states(*m.pipe);
    return out;
  });
  for (int64_t split : {1, 3, 7, 100}) {
    SCOPED_TRACE("split_size " + std::to_string(split));
    const Result piped = run_and_backprop(*m.pipe, x, mask, [&](auto x_, auto mask_) {
      auto out = m.pipe->forward({x_, mpipe::unbatched(mask_)}, split);
      mpipe::reset_states(*m.pipe);
      return out;
    });
    expect_same(piped, plain);
  }
}

TEST_P(MultiTensor, TimeStepCallsEqualAPlainLoop) {
  torch::manual_seed(2);
  MaskedModel m(GetParam());
  const auto inputs = masked_inputs(4);
  const torch::Tensor x = inputs.first, mask = inputs.second;
  const int64_t T = 3;
  for (bool reduce : {true, false}) {
    SCOPED_TRACE(reduce ? "reduce" : "no reduce");
    mpipe::reset_states(*m.pipe);
    const Result plain = run_and_backprop(*m.pipe, x, mask, [&](auto x_, auto mask_) {
      std::vector<Tensors> steps;
      for (int64_t t = 0; t < T; ++t) steps.push_back(m.plain(x_, mask_));
      mpipe::reset_states(*m.pipe);
      Tensors out;
      for (size_t k = 0; k < steps[0].size(); ++k) {
        std::vector<torch::Tensor> parts;
        for (auto& s : steps) parts.push_back(s[k]);
        out.push_back(reduce ? torch::stack(parts).sum(0) : torch::cat(parts));
      }
      return out;
    });
    const Result piped = run_and_backprop(*m.pipe, x, mask, [&](auto x_, auto mask_) {
      auto out = m.pipe->constant_forward({x_, mpipe::unbatched(mask_)}, T, reduce);
      mpipe::reset_states(*m.pipe);
      return out;
    });
    expect_same(piped, plain);
  }
  // sequence_forward: batched inputs are [T, N, ...], step t gets row t.
  auto x_seq = torch::randn({T, 4, W}, torch::kDouble);
  const Result plain = run_and_backprop(*m.pipe, x_seq, mask, [&](auto xs, auto mask_) {
    std::vector<torch::Tensor> ys, zs;
    for (int64_t t = 0; t < T; ++t) {
      auto o = m.plain(xs[t], mask_);
      ys.push_back(o[0]);
      zs.push_back(o[1]);
    }
    mpipe::reset_states(*m.pipe);
    return Tensors{torch::stack(ys), torch::stack(zs)};
  });
  const Result piped = run_and_backprop(*m.pipe, x_seq, mask, [&](auto xs, auto mask_) {
    auto out = m.pipe->sequence_forward({xs, mpipe::unbatched(mask_)});
    mpipe::reset_states(*m.pipe);
    return out;
  });
  expect_same(piped, plain);
}

TEST_P(MultiTensor, TrainStepsEqualThePlainModelUnderEveryScheduleAndCheckpointing) {
  torch::manual_seed(3);
  const auto inputs = masked_inputs(7);
  const torch::Tensor x = inputs.first, mask = inputs.second;
  auto target = torch::randn({7, 3}, torch::kDouble);
  for (Checkpoint ckpt : {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
    for (Schedule schedule : all_schedules()) {
      SCOPED_TRACE("checkpoint " + std::to_string(static_cast<int>(ckpt)) + ", schedule " +
                   schedule_name(schedule));
      torch::manual_seed(4);
      MaskedModel m(GetParam(), ckpt);
      m.s2->two_outputs = false;
      // The plain model, whole batch.
      auto x2 = leaf_copy(x), mask2 = leaf_copy(mask);
      mpipe::reset_states(*m.pipe);
      auto loss2 = mse(m.plain(x2, mask2)[0], target);
      loss2.backward();
      mpipe::reset_states(*m.pipe);
      auto plain_grads = grads_of(*m.pipe);
      zero_grads(*m.pipe);

      auto x1 = leaf_copy(x), mask1 = leaf_copy(mask);
      auto loss1 = m.pipe->train_step({x1, mpipe::unbatched(mask1)}, target, mse,
                                      schedule_options(schedule, 3, 3));
      mpipe::reset_states(*m.pipe);
      expect_close(loss1, loss2, 1e-12, "loss");
      expect_close(x1.grad(), x2.grad(), 1e-12, "grad of x");
      expect_close(mask1.grad(), mask2.grad(), 1e-12, "grad of the unbatched mask");
      expect_same_grads(grads_of(*m.pipe), plain_grads);
    }
  }
}

TEST_P(MultiTensor, ConstantTrainStepEqualsThePlainLoop) {
  torch::manual_seed(5);
  MaskedModel m(GetParam());
  m.s2->two_outputs = false;
  const auto inputs = masked_inputs(4);
  const torch::Tensor x = inputs.first, mask = inputs.second;
  auto target = torch::randn({4, 3}, torch::kDouble);
  const int64_t T = 4;
  auto x2 = leaf_copy(x), mask2 = leaf_copy(mask);
  mpipe::reset_states(*m.pipe);
  torch::Tensor sum;
  for (int64_t t = 0; t < T; ++t) {
    auto y = m.plain(x2, mask2)[0];
    sum = sum.defined() ? sum + y : y;
  }
  auto loss2 = mse(sum, target);
  loss2.backward();
  mpipe::reset_states(*m.pipe);
  auto plain_grads = grads_of(*m.pipe);
  zero_grads(*m.pipe);

  auto x1 = leaf_copy(x), mask1 = leaf_copy(mask);
  auto loss1 = m.pipe->constant_train_step({x1, mpipe::unbatched(mask1)}, T, target, mse);
  expect_close(loss1, loss2, 1e-12, "loss");
  expect_close(x1.grad(), x2.grad(), 1e-12, "grad of x");
  expect_close(mask1.grad(), mask2.grad(), 1e-12, "grad of the mask");
  expect_same_grads(grads_of(*m.pipe), plain_grads);
}

TEST_P(MultiTensor, WrongInputsAreRefusedClearly) {
  MaskedModel m(GetParam());
  auto x = torch::randn({5, W}, torch::kDouble);
  auto mask = torch::rand({W}, torch::kDouble);
  // Batched inputs of different batch sizes.
  MPIPE_EXPECT_ERROR(m.pipe->forward({x, torch::randn({4, W}, torch::kDouble)}, 2), "forward",
                     "inputs 0 and 1", "(5 and 4)");
  // No batched input: nothing to split.
  MPIPE_EXPECT_ERROR(m.pipe->forward({mpipe::unbatched(x), mpipe::unbatched(mask)}, 2),
                     "forward", "batched");
  // The first stage takes two tensors.
  MPIPE_EXPECT_ERROR(m.pipe->forward(x, 2), "stage 0", "micro-batch 0", "takes 2 tensor(s)", "given 1");
  // An undefined input.
  MPIPE_EXPECT_ERROR(m.pipe->forward({x, torch::Tensor()}, 2), "input 1", "undefined");
  // A sequence whose batched inputs lack a time dimension.
  MPIPE_EXPECT_ERROR(m.pipe->sequence_forward({torch::randn({W}, torch::kDouble),
                                               mpipe::unbatched(mask)}),
                     "sequence_forward", "input 0");
  // train_step's loss takes one tensor: two outputs are refused.
  MPIPE_EXPECT_ERROR(m.pipe->train_step({x, mpipe::unbatched(mask)}, torch::randn({5, 3}), mse,
                                        TrainStepOptions(2)),
                     "stage 2", "returned 2 tensors");
  // Still usable, and still exact.
  mpipe::reset_states(*m.pipe);
  auto piped = m.pipe->forward({x, mpipe::unbatched(mask)}, 2);
  mpipe::reset_states(*m.pipe);
  auto plain = m.plain(x, mask);
  mpipe::reset_states(*m.pipe);
  ASSERT_EQ(piped.size(), 2u);
  expect_close(piped[0], plain[0], 1e-12, "output 0 after the errors");
  expect_close(piped[1], plain[1], 1e-12, "output 1 after the errors");
}

// An input that needs grad but that no stage uses: autograd gives no gradient
// for it in any micro-batch, and the pipeline hands back zeros (the plain
// model leaves .grad undefined); the used input's gradient is the plain one.
struct IgnoresSecondImpl : torch::nn::Module {
  IgnoresSecondImpl() { fc = register_module("fc", torch::nn::Linear(W, W)); }
  Tensors forward(const Tensors& in) { return {torch::tanh(fc(in[0]))}; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(IgnoresSecond);

TEST_P(MultiTensor, AnInputNoStageUsesGetsZeroGradients) {
  torch::manual_seed(6);
  IgnoresSecond s0;
  torch::nn::Linear s1(W, 3);
  ModelPipeline pipe(ModelPipelineOptions().worker_threads(GetParam()));
  pipe->append(s0, "cpu").append(s1, "cpu");
  pipe->to(torch::kDouble);
  auto x = torch::randn({6, W}, torch::kDouble), extra = torch::randn({6, 2}, torch::kDouble);
  auto target = torch::randn({6, 3}, torch::kDouble);
  for (Schedule schedule : all_schedules()) {
    SCOPED_TRACE(schedule_name(schedule));
    auto x2 = leaf_copy(x);
    auto loss2 = mse(s1(s0->forward({x2, extra})[0]), target);
    loss2.backward();
    auto plain_grads = grads_of(*pipe);
    zero_grads(*pipe);
    auto x1 = leaf_copy(x), extra1 = leaf_copy(extra);
    auto loss1 = pipe->train_step({x1, extra1}, target, mse, schedule_options(schedule, 2, 2));
    expect_close(loss1, loss2, 1e-12, "loss");
    expect_close(x1.grad(), x2.grad(), 1e-12, "grad of x");
    ASSERT_TRUE(extra1.grad().defined());
    EXPECT_EQ(extra1.grad().abs().max().item<double>(), 0.0);
    expect_same_grads(grads_of(*pipe), plain_grads);
    zero_grads(*pipe);
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, MultiTensor, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Threads" : "Inline"; });

// ---------------------------------------------------------------------------
// Skip connections: a U-Net-like model over four stages. Stage 0 stashes
// "enc0" for stage 3, stage 1 stashes "enc1" for stage 2 and one name it pops
// itself; stage 2 keeps a state per micro-batch.

enum class SkipFault { None, PopMissing, StashTwice, NeverPopped, OwnNeverPopped, LastStashes };

struct Down0Impl : torch::nn::Module {
  Down0Impl() { fc = register_module("fc", torch::nn::Linear(W, W)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(fc(x));
    mpipe::stash("enc0", h);
    return h * 0.5;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Down0);

struct Down1Impl : torch::nn::Module {
  Down1Impl() {
    fc = register_module("fc", torch::nn::Linear(W, W));
    fc2 = register_module("fc2", torch::nn::Linear(W, W));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(fc(x));
    mpipe::stash("enc1", h);
    mpipe::stash("own", h * h);  // popped by this stage itself
    if (*fault == SkipFault::StashTwice) mpipe::stash("enc0", h);
    if (*fault == SkipFault::OwnNeverPopped) return torch::tanh(fc2(h));
    return torch::tanh(fc2(h)) + mpipe::pop("own");
  }
  torch::nn::Linear fc{nullptr}, fc2{nullptr};
  std::shared_ptr<SkipFault> fault;
};
TORCH_MODULE(Down1);

struct Up2Impl : torch::nn::Module {
  Up2Impl() { leaky = register_module("leaky", Leaky(W)); }
  torch::Tensor forward(const torch::Tensor& x) {
    if (*fault == SkipFault::PopMissing) mpipe::pop("nowhere");
    // .to(): outside a pipeline pop returns the tensor where it was stashed.
    return leaky(x) * mpipe::pop("enc1").to(x.device());
  }
  Leaky leaky{nullptr};
  std::shared_ptr<SkipFault> fault;
};
TORCH_MODULE(Up2);

struct Up3Impl : torch::nn::Module {
  Up3Impl() { fc = register_module("fc", torch::nn::Linear(W, 2)); }
  torch::Tensor forward(const torch::Tensor& x) {
    if (*fault == SkipFault::NeverPopped) return fc(x);
    if (*fault == SkipFault::LastStashes) mpipe::stash("tail", x);
    return fc(x + mpipe::pop("enc0").to(x.device()));
  }
  torch::nn::Linear fc{nullptr};
  std::shared_ptr<SkipFault> fault;
};
TORCH_MODULE(Up3);

struct UNet {
  explicit UNet(bool threaded, Checkpoint ckpt = Checkpoint::Never,
                std::vector<torch::Device> devices = std::vector<torch::Device>(4, torch::kCPU),
                int64_t lanes = 1)
      : devices(devices) {
    s1->fault = s2->fault = s3->fault = fault;
    pipe = ModelPipeline(
        ModelPipelineOptions().worker_threads(threaded).checkpoint(ckpt).lanes(lanes));
    pipe->append(s0, devices[0]).append(s1, devices[1]).append(s2, devices[2]);
    pipe->append(s3, devices[3]);
    pipe->to(torch::kDouble);
  }
  /// The same modules, one after another on the whole batch, outside a pipeline.
  torch::Tensor plain(torch::Tensor x) {
    x = s0(x.to(devices[0]));
    x = s1(x.to(devices[1]));
    x = s2(x.to(devices[2]));
    return s3(x.to(devices[3]));
  }
  std::vector<torch::Device> devices;
  std::shared_ptr<SkipFault> fault = std::make_shared<SkipFault>(SkipFault::None);
  Down0 s0;
  Down1 s1;
  Up2 s2;
  Up3 s3;
  ModelPipeline pipe{nullptr};
};

/// Checks forward, every schedule of train_step and the time-step calls of
/// `net` against its plain run.
void expect_unet_equals_plain(UNet& net, double tol) {
  const auto in_dev = net.devices.front(), out_dev = net.devices.back();
  auto opts = torch::TensorOptions().dtype(torch::kDouble).device(in_dev);
  auto x = torch::randn({5, W}, opts);
  auto target = torch::randn({5, 2}, torch::TensorOptions().dtype(torch::kDouble).device(out_dev));
  auto forget = [&] { mpipe::reset_states(*net.pipe); };

  // forward, several splits, gradients through the graph of the call.
  for (int64_t split : {1, 2, 5}) {
    SCOPED_TRACE("forward, split_size " + std::to_string(split));
    forget();
    expect_transparent(
        *net.pipe, x,
        [&](const torch::Tensor& xi) {
          auto y = net.pipe->forward(xi, split);
          forget();
          return y;
        },
        [&](const torch::Tensor& xi) {
          auto y = net.plain(xi);
          forget();
          return y;
        },
        tol);
  }
  // train_step: every schedule (the pipeline's checkpoint mode applies).
  for (Schedule schedule : all_schedules()) {
    SCOPED_TRACE("train_step, schedule " + schedule_name(schedule));
    auto x2 = leaf_copy(x);
    forget();
    auto loss2 = mse(net.plain(x2), target);
    loss2.backward();
    forget();
    auto plain_grads = grads_of(*net.pipe);
    zero_grads(*net.pipe);
    auto x1 = leaf_copy(x);
    auto loss1 = net.pipe->train_step(x1, target, mse, schedule_options(schedule, 2, 4));
    forget();
    expect_close(loss1, loss2, tol, "loss");
    expect_close(x1.grad(), x2.grad(), tol, "grad of x");
    expect_same_grads(grads_of(*net.pipe), plain_grads, tol);
    zero_grads(*net.pipe);
  }
  // constant_forward and constant_train_step: T steps, state carried.
  const int64_t T = 3;
  {
    SCOPED_TRACE("constant_forward");
    forget();
    expect_transparent(
        *net.pipe, x,
        [&](const torch::Tensor& xi) {
          auto y = net.pipe->constant_forward(xi, T, /*reduce=*/false);
          forget();
          return y;
        },
        [&](const torch::Tensor& xi) {
          std::vector<torch::Tensor> ys;
          for (int64_t t = 0; t < T; ++t) ys.push_back(net.plain(xi));
          forget();
          return torch::cat(ys);
        },
        tol);
  }
  {
    SCOPED_TRACE("constant_train_step");
    auto x2 = leaf_copy(x);
    forget();
    torch::Tensor sum = net.plain(x2);
    for (int64_t t = 1; t < T; ++t) sum = sum + net.plain(x2);
    auto loss2 = mse(sum, target);
    loss2.backward();
    forget();
    auto plain_grads = grads_of(*net.pipe);
    zero_grads(*net.pipe);
    auto x1 = leaf_copy(x);
    auto loss1 = net.pipe->constant_train_step(x1, T, target, mse);
    expect_close(loss1, loss2, tol, "loss");
    expect_close(x1.grad(), x2.grad(), tol, "grad of x");
    expect_same_grads(grads_of(*net.pipe), plain_grads, tol);
    zero_grads(*net.pipe);
  }
  {
    SCOPED_TRACE("sequence_forward");
    auto xs = torch::randn({T, 3, W}, opts);
    forget();
    expect_transparent(
        *net.pipe, xs,
        [&](const torch::Tensor& xi) {
          auto y = net.pipe->sequence_forward(xi);
          forget();
          return y;
        },
        [&](const torch::Tensor& xi) {
          std::vector<torch::Tensor> ys;
          for (int64_t t = 0; t < T; ++t) ys.push_back(net.plain(xi[t]));
          forget();
          return torch::stack(ys);
        },
        tol);
  }
}

struct SkipCase {
  Checkpoint checkpoint;
  bool threaded;
};

class Skips : public ::testing::TestWithParam<SkipCase> {};

TEST_P(Skips, UNetEqualsThePlainModelInEveryCall) {
  torch::manual_seed(6);
  UNet net(GetParam().threaded, GetParam().checkpoint);
  expect_unet_equals_plain(net, 1e-12);
}

TEST_P(Skips, WrongUseNamesTheStagesAndThePipelineStaysUsable) {
  torch::manual_seed(7);
  UNet net(GetParam().threaded, GetParam().checkpoint);
  auto x = torch::randn({4, W}, torch::kDouble);
  auto target = torch::randn({4, 2}, torch::kDouble);
  auto both_calls = [&](SkipFault f, const std::vector<std::string>& pieces) {
    *net.fault = f;
    for (int call = 0; call < 3; ++call) {
      SCOPED_TRACE("fault " + std::to_string(static_cast<int>(f)) + ", call " +
                   std::to_string(call));
      try {
        if (call == 0) net.pipe->forward(x, 2);
        if (call == 1) net.pipe->train_step(x, target, mse, TrainStepOptions(2));
        if (call == 2) net.pipe->constant_forward(x, 2);
        ADD_FAILURE() << "expected an error";
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        for (const auto& p : pieces) {
          EXPECT_NE(msg.find(p), std::string::npos) << "lacks \"" << p << "\": " << msg;
        }
      }
      mpipe::reset_states(*net.pipe);
      zero_grads(*net.pipe);
    }
    *net.fault = SkipFault::None;
  };
  both_calls(SkipFault::PopMissing, {"stage 2", "pop('nowhere')", "no earlier stage stashed",
                                     " 0 of "});
  both_calls(SkipFault::StashTwice, {"stage 1", "stash('enc0')", "stage 0 already stashed"});
  // A stash nobody popped is its stasher's error, found after the item's last
  // stage: the message names the stasher, the name and the item, not the
  // stage or the loss where it was found.
  const std::string never = "but no stage popped it (neither stage ";
  both_calls(SkipFault::NeverPopped,
             {"stage 0 (on cpu) stashed 'enc0' for ", never + "0 itself nor a later stage did"});
  both_calls(SkipFault::OwnNeverPopped,
             {"stage 1 (on cpu) stashed 'own' for ", never + "1 itself nor a later stage did"});
  both_calls(SkipFault::LastStashes, {"stage 3 (on cpu) stashed 'tail' for ",
                                      "but no stage popped it (stage 3 did not, and no stage "
                                      "follows it; each stash is popped once"});
  // The whole message, from its start.
  auto message_of = [&](SkipFault f, const std::function<void()>& call) {
    *net.fault = f;
    std::string msg;
    try {
      call();
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    mpipe::reset_states(*net.pipe);
    zero_grads(*net.pipe);
    *net.fault = SkipFault::None;
    EXPECT_EQ(msg.find("loss"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("failed at"), std::string::npos) << msg;
    return msg;
  };
  auto starts_with = [](const std::string& msg, const std::string& start) {
    return msg.compare(0, start.size(), start) == 0;
  };
  std::string msg = message_of(SkipFault::NeverPopped, [&] {
    net.pipe->train_step(x, target, mse, TrainStepOptions(2));
  });
  EXPECT_TRUE(starts_with(msg, "mpipe::ModelPipeline::train_step: stage 0 (on cpu) stashed 'enc0' "
                               "for micro-batch 0 of 2, but no stage popped it (neither stage 0 "
                               "itself nor a later stage did; each stash is popped once, by the "
                               "stashing stage or a later one)"))
      << msg;
  msg = message_of(SkipFault::OwnNeverPopped, [&] { net.pipe->constant_forward(x, 2); });
  EXPECT_TRUE(starts_with(msg, "mpipe::ModelPipeline::constant_forward: stage 1 (on cpu) stashed "
                               "'own' for time step 0 of 2, but no stage popped it (neither "
                               "stage 1 itself nor a later stage did;"))
      << msg;
  msg = message_of(SkipFault::LastStashes, [&] { net.pipe->forward(x, 2); });
  EXPECT_TRUE(starts_with(msg, "mpipe::ModelPipeline::forward: stage 3 (on cpu) stashed 'tail' "
                               "for micro-batch 0 of 2, but no stage popped it (stage 3 did not, "
                               "and no stage follows it;"))
      << msg;
  // After every failure, the next calls are exact again.
  expect_unet_equals_plain(net, 1e-12);
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, Skips,
    ::testing::Values(SkipCase{Checkpoint::Never, true}, SkipCase{Checkpoint::Never, false},
                      SkipCase{Checkpoint::ExceptLast, true},
                      SkipCase{Checkpoint::ExceptLast, false}, SkipCase{Checkpoint::Always, true},
                      SkipCase{Checkpoint::Always, false}),
    [](const auto& info) {
      const char* c = info.param.checkpoint == Checkpoint::Never        ? "Never"
                      : info.param.checkpoint == Checkpoint::ExceptLast ? "ExceptLast"
                                                                        : "Always";
      return std::string(c) + (info.param.threaded ? "_Threads" : "_Inline");
    });

TEST(SkipsOutsideAPipeline, StashAndPopUseTheThreadsOwnStore) {
  MPIPE_EXPECT_ERROR(mpipe::pop("x"), "pop('x')", "nothing was stashed");
  mpipe::stash("x", torch::ones({2}));
  MPIPE_EXPECT_ERROR(mpipe::stash("x", torch::ones({2})), "stash('x')", "already stashed");
  MPIPE_EXPECT_ERROR(mpipe::stash("y", torch::Tensor()), "stash('y')", "undefined");
  EXPECT_TRUE(torch::equal(mpipe::pop("x"), torch::ones({2})));
  MPIPE_EXPECT_ERROR(mpipe::pop("x"), "nothing was stashed");
  mpipe::stash("z", torch::ones({1}));
  mpipe::clear_stashed();
  MPIPE_EXPECT_ERROR(mpipe::pop("z"), "nothing was stashed");
}

TEST(SkipsAcrossDevices, SkipsMoveBetweenDevices_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device cpu(torch::kCPU), gpu(torch::kCUDA, 0);
  for (bool threaded : {true, false}) {
    for (Checkpoint ckpt : {Checkpoint::Never, Checkpoint::Always}) {
      SCOPED_TRACE(std::string(threaded ? "threads" : "inline") +
                   (ckpt == Checkpoint::Never ? "" : ", checkpointing"));
      torch::manual_seed(8);
      // enc0 goes from the GPU to the CPU, enc1 from the CPU to the GPU.
      UNet net(threaded, ckpt, {gpu, cpu, gpu, cpu});
      expect_unet_equals_plain(net, 1e-10);
    }
  }
}

TEST(SkipsAcrossDevices, SkipsCrossLanes_CUDA) {
  // Note [Lanes]: stashed and popped on the micro-batch's lane of its device
  // (one lane per stage before), on one GPU and across the CPU.
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device cpu(torch::kCPU), gpu(torch::kCUDA, 0);
  for (bool threaded : {true, false}) {
    for (int64_t lanes : {2, 3}) {
      SCOPED_TRACE(std::string(threaded ? "threads" : "inline") + ", lanes " +
                   std::to_string(lanes));
      torch::manual_seed(9);
      UNet net(threaded, Checkpoint::Never, {gpu, gpu, gpu, gpu}, lanes);
      expect_unet_equals_plain(net, 1e-10);
      UNet mixed(threaded, Checkpoint::Never, {gpu, cpu, gpu, gpu}, lanes);
      expect_unet_equals_plain(mixed, 1e-10);
    }
  }
}

}  // namespace
