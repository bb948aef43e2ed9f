// Multi-step SNN layers (StepMode::Multi): neurons over [T, N, ...] against T
// single steps (values and BPTT gradients, tolerance 0), SeqToANN, MultiStep,
// SpikingConvBlock, and the pipeline's time chunks.

#include "common.h"

#include <mpipe/snn.h>

using namespace mpipe_test;
using mpipe::snn::IFNode;
using mpipe::snn::IFNodeOptions;
using mpipe::snn::LIFNode;
using mpipe::snn::LIFNodeOptions;
using mpipe::snn::NeuronBase;
using mpipe::snn::StepMode;
using mpipe::snn::Surrogate;

namespace {

/// Every neuron variant the options allow (IF, LIF with and without
/// decay_input; hard, negative-hard and soft reset; detach_reset; both
/// surrogates), fused or not, with float_membrane as given.
std::vector<std::pair<std::string, std::function<std::shared_ptr<NeuronBase>()>>> neuron_variants(
    bool fused, bool float_membrane = true) {
  std::vector<std::pair<std::string, std::function<std::shared_ptr<NeuronBase>()>>> out;
  for (bool lif : {false, true}) {
    for (std::optional<double> v_reset :
         {std::optional<double>(0.0), std::optional<double>(-0.2), std::optional<double>()}) {
      for (bool decay_input : {true, false}) {
        for (bool detach_reset : {false, true}) {
          for (int kind = 0; kind < 2; ++kind) {
            if (!lif && !decay_input) continue;
            const Surrogate s = kind == 0 ? Surrogate::atan() : Surrogate::sigmoid(3.0);
            const std::string name = std::string(lif ? "LIF" : "IF") +
                                     " v_reset=" + (v_reset ? std::to_string(*v_reset) : "soft") +
                                     " decay_input=" + std::to_string(decay_input) +
                                     " detach_reset=" + std::to_string(detach_reset) +
                                     " surrogate=" + s.name() + " fused=" + std::to_string(fused);
            out.emplace_back(name, [=]() -> std::shared_ptr<NeuronBase> {
              if (lif) {
                return LIFNode(LIFNodeOptions()
                                   .tau(2.5)
                                   .v_threshold(0.8)
                                   .v_reset(v_reset)
                                   .decay_input(decay_input)
                                   .detach_reset(detach_reset)
                                   .surrogate(s)
                                   .fused(fused)
                                   .float_membrane(float_membrane))
                    .ptr();
              }
              return IFNode(IFNodeOptions()
                                .v_threshold(0.8)
                                .v_reset(v_reset)
                                .detach_reset(detach_reset)
                                .surrogate(s)
                                .fused(fused)
                                .float_membrane(float_membrane))
                  .ptr();
            });
          }
        }
      }
    }
  }
  return out;
}

/// Spikes and gradients of T steps: one warm-up single step on x0 (so the
/// state carried in has a gradient path), then the sequence xs [T, ...] as
/// single steps (chunks empty) or as multi-step calls of the given lengths.
struct StepsResult {
  torch::Tensor spikes, grad_xs, grad_x0, v_last;
};
StepsResult run_steps(NeuronBase& node, const torch::Tensor& x0, const torch::Tensor& xs,
                      const std::vector<int64_t>& chunks) {
  node.reset_state();
  auto x0g = x0.clone().requires_grad_();
  auto xsg = xs.clone().requires_grad_();
  std::vector<torch::Tensor> parts{node.single_step(x0g * 1.5).unsqueeze(0)};
  const int64_t T = xs.size(0);
  if (chunks.empty()) {
    for (int64_t t = 0; t < T; ++t) parts.push_back(node.single_step(xsg[t] * 1.3).unsqueeze(0));
  } else {
    int64_t t = 0;
    for (int64_t k : chunks) {
      parts.push_back(node.multi_step(xsg.slice(0, t, t + k) * 1.3));
      t += k;
    }
    EXPECT_EQ(t, T) << "the chunks must cover the sequence";
  }
  auto spikes = torch::cat(parts);
  const auto weights = torch::arange(1, spikes.size(0) + 1, spikes.options()).view({-1, 1, 1});
  const auto v_last = node.membrane_potentials().at(0);
  // The last state enters the loss too: its gradient flows back through time.
  ((spikes.to(torch::kDouble) * weights.to(torch::kDouble)).sum() +
   v_last.to(torch::kDouble).pow(2).sum() * 0.5)
      .backward();
  return {spikes.detach(), xsg.grad(), x0g.grad(), v_last.detach()};
}

void expect_equal_steps(const StepsResult& a, const StepsResult& b, const std::string& what) {
  expect_close(a.spikes, b.spikes, 0.0, what + ": spikes");
  expect_close(a.v_last, b.v_last, 0.0, what + ": last membrane potential");
  expect_close(a.grad_xs, b.grad_xs, 0.0, what + ": gradient of the sequence");
  expect_close(a.grad_x0, b.grad_x0, 0.0, what + ": gradient through the state carried in");
}

}  // namespace

TEST(MultiStepNeurons, EqualTSingleStepsExactlyForEveryOption) {
  torch::manual_seed(3);
  const int64_t T = 8;
  // float_membrane(false) with bfloat16 keeps state and gradients in bfloat16:
  // the rounding after every step is part of what must match.
  struct Case {
    torch::Dtype dtype;
    bool float_membrane;
  };
  for (const Case& c : {Case{torch::kDouble, true}, Case{torch::kFloat, true},
                        Case{torch::kBFloat16, true}, Case{torch::kBFloat16, false}}) {
    for (bool fused : {true, false}) {
      for (const auto& variant : neuron_variants(fused, c.float_membrane)) {
        const std::string what = variant.first + " dtype=" + c10::toString(c.dtype) +
                                 " float_membrane=" + std::to_string(c.float_membrane);
        SCOPED_TRACE(what);
        const auto x0 = torch::randn({4, 16}).to(c.dtype);
        const auto xs = (torch::randn({T, 4, 16}) + 0.3).to(c.dtype);
        auto single = variant.second();
        auto multi = variant.second();
        const StepsResult ref = run_steps(*single, x0, xs, {});
        ASSERT_GT(ref.spikes.sum().item<double>(), 0.0) << "the test should make spikes";
        for (const std::vector<int64_t>& chunks :
             std::vector<std::vector<int64_t>>{{T}, {1, 1, 1, 1, 1, 1, 1, 1}, {3, 4, 1}, {2, 6}}) {
          expect_equal_steps(run_steps(*multi, x0, xs, chunks), ref,
                             what + " chunks of " + c10::str(chunks));
        }
      }
    }
  }
}

TEST(MultiStepNeurons, FusedPathIsOneAutogradNodeAndModesDispatch) {
  LIFNode node(LIFNodeOptions().step_mode(StepMode::Multi));
  EXPECT_EQ(node->step_mode(), StepMode::Multi);
  auto x = torch::randn({6, 4, 5}, torch::requires_grad());
  auto y = node(x);
  EXPECT_EQ(y.sizes(), x.sizes());
  const std::string name = y.grad_fn()->name();
  EXPECT_NE(name.find("FusedNeuronSteps"), std::string::npos) << name;
  ASSERT_EQ(node->membrane_potentials().size(), 1u);
  EXPECT_EQ(node->membrane_potentials()[0].sizes(), (std::vector<int64_t>{4, 5}));

  // set_step_mode reaches every neuron of a tree; forward follows the mode.
  torch::nn::ModuleList model(torch::nn::Linear(5, 5), IFNode(), LIFNode(),
                              torch::nn::ModuleList(IFNode()));
  EXPECT_EQ(mpipe::snn::set_step_mode(*model, StepMode::Multi), 3);
  auto seq = torch::rand({3, 2, 5});
  EXPECT_EQ(model[1]->as<IFNode>()->forward(seq).sizes(), seq.sizes());
  EXPECT_EQ(mpipe::snn::set_step_mode(*model, StepMode::Single), 3);
  mpipe::reset_states(*model);
  EXPECT_EQ(model[1]->as<IFNode>()->forward(seq[0]).sizes(), seq[0].sizes());

  // T = 0 returns an empty sequence and leaves the state alone.
  node->reset_state();
  EXPECT_EQ(node(torch::zeros({0, 4, 5})).sizes(), (std::vector<int64_t>{0, 4, 5}));
  EXPECT_FALSE(node->holds_state());

  // Printing names the mode.
  std::ostringstream printed;
  printed << *node;
  EXPECT_NE(printed.str().find("step_mode=multi"), std::string::npos) << printed.str();

  // Reduced-precision input comes back in its dtype, the state in float.
  node->reset_state();
  auto h = node(torch::rand({3, 2, 2}).to(torch::kBFloat16));
  EXPECT_EQ(h.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(node->membrane_potentials()[0].scalar_type(), torch::kFloat);
}

TEST(MultiStepNeurons, BadInputsAreRefusedClearly) {
  IFNode node(IFNodeOptions().step_mode(StepMode::Multi));
  MPIPE_EXPECT_ERROR(node(torch::zeros({4})), "IFNode", "multi-step input is [T, N, ...]",
                     "[4]");
  node(torch::zeros({2, 3, 4}));
  MPIPE_EXPECT_ERROR(node(torch::zeros({2, 5, 4})), "IFNode", "multi-step input of shape",
                     "[2, 5, 4]", "[3, 4]", "mpipe::reset_states");
  MPIPE_EXPECT_ERROR(node(torch::zeros({2, 3, 4}, torch::kLong)), "floating point");
  MPIPE_EXPECT_ERROR(node(torch::Tensor()), "undefined");
  // After the errors the neuron works on.
  EXPECT_EQ(node(torch::ones({1, 3, 4})).sizes(), (std::vector<int64_t>{1, 3, 4}));
}

TEST(MultiStepContainers, SeqToANNAndMultiStepEqualStepByStepCalls) {
  torch::manual_seed(5);
  const int64_t T = 5, N = 3;
  torch::nn::Linear fc(6, 4);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(2, 3, 3).padding(1));
  torch::nn::BatchNorm2d bn(3);
  bn->eval();  // running statistics: one call over T*N rows equals T calls
  mpipe::snn::SeqToANN seq_fc(fc);
  mpipe::snn::SeqToANN seq_conv(conv, bn);
  EXPECT_EQ(seq_conv->layers()->size(), 2u);
  EXPECT_EQ(seq_conv->parameters().size(), conv->parameters().size() + bn->parameters().size());

  auto x = torch::randn({T, N, 6}, torch::kDouble);
  fc->to(torch::kDouble);
  std::vector<torch::Tensor> per_step;
  for (int64_t t = 0; t < T; ++t) per_step.push_back(fc(x[t]));
  expect_close(seq_fc(x), torch::stack(per_step), 0.0, "SeqToANN(Linear)");

  auto img = torch::randn({T, N, 2, 5, 5});
  per_step.clear();
  for (int64_t t = 0; t < T; ++t) per_step.push_back(bn(conv(img[t])));
  auto y = seq_conv(img);
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{T, N, 3, 5, 5}));
  expect_close(y, torch::stack(per_step), 1e-6, "SeqToANN(Conv2d, BatchNorm2d)");

  // MultiStep runs single-step (stateful) layers once per step: equal to a
  // multi-step neuron.
  mpipe::snn::MultiStep ms(torch::nn::Linear(6, 4), LIFNode());
  torch::nn::Linear lin(ms->layers()->ptr<torch::nn::LinearImpl>(0));
  lin->to(torch::kDouble);
  mpipe::snn::SeqToANN seq_lin(lin);  // the same Linear
  LIFNode multi(LIFNodeOptions().step_mode(StepMode::Multi));
  auto xg = x.clone().requires_grad_();
  auto a = ms(xg);
  a.sum().backward();
  auto ga = xg.grad().clone();
  xg.mutable_grad() = torch::Tensor();
  auto b = multi(seq_lin(xg));
  b.sum().backward();
  expect_close(a, b, 0.0, "MultiStep(Linear, LIF) vs SeqToANN(Linear) + multi-step LIF");
  expect_close(ga, xg.grad(), 0.0, "their input gradients");

  MPIPE_EXPECT_ERROR(seq_fc(torch::zeros({6})), "SeqToANN", "[T, N, ...]", "[6]");
  MPIPE_EXPECT_ERROR(ms(torch::Tensor()), "MultiStep", "undefined");
  mpipe::snn::SeqToANN bad(torch::nn::Flatten(torch::nn::FlattenOptions().start_dim(0)));
  MPIPE_EXPECT_ERROR(bad(torch::zeros({2, 3, 4})), "SeqToANN", "6 rows", "keep dim 0");
}

TEST(MultiStepContainers, SpikingConvBlockMultiStepEqualsSingleSteps) {
  using mpipe::snn::SpikingConvBlock;
  using mpipe::snn::SpikingConvBlockOptions;
  const int64_t T = 4, N = 3;
  for (bool lif : {false, true}) {
    for (bool training : {true, false}) {
      for (int64_t pool : {0, 2}) {
        SCOPED_TRACE(std::string(lif ? "LIF" : "IF") + " training=" + std::to_string(training) +
                     " pool=" + std::to_string(pool));
        auto options = SpikingConvBlockOptions(2, 4).pool(pool);
        if (lif) options.neuron(LIFNodeOptions().surrogate(Surrogate::atan()));
        torch::manual_seed(9);
        SpikingConvBlock single(options);
        torch::manual_seed(9);
        SpikingConvBlock multi(options);
        single->train(training);
        multi->train(training);
        multi->to(torch::kDouble);
        single->to(torch::kDouble);
        EXPECT_EQ(mpipe::snn::set_step_mode(*multi, StepMode::Multi), 1);
        auto x = torch::randn({T, N, 2, 6, 6}, torch::kDouble) * 2;
        auto xa = x.clone().requires_grad_(), xb = x.clone().requires_grad_();
        std::vector<torch::Tensor> per_step;
        for (int64_t t = 0; t < T; ++t) per_step.push_back(single(xa[t]));
        auto a = torch::stack(per_step);
        auto b = multi(xb);
        ASSERT_EQ(a.sizes(), b.sizes());
        EXPECT_GT(a.sum().item<double>(), 0.0) << "the test should make spikes";
        expect_close(a, b, 0.0, "spikes");
        const auto w = torch::rand_like(a);
        (a * w).sum().backward();
        (b * w).sum().backward();
        expect_close(xa.grad(), xb.grad(), 0.0, "input gradients");
        // A weight's gradient sums over the steps: T sums of N rows each, or
        // one of T*N rows. The order differs, so the last bits may.
        expect_same_grads(grads_of(*single), grads_of(*multi), 1e-12);
        expect_close(single->bn->running_mean, multi->bn->running_mean, 0.0, "running mean");
        expect_close(single->bn->running_var, multi->bn->running_var, 0.0, "running variance");
      }
    }
  }
  // step_batch_stats(false): one BatchNorm over all T*N rows.
  torch::manual_seed(9);
  SpikingConvBlock block(SpikingConvBlockOptions(2, 4).step_batch_stats(false).neuron(
      IFNodeOptions().step_mode(StepMode::Multi)));
  auto x = torch::randn({T, N, 2, 6, 6});
  auto y = block(x);
  block->neuron->reset_state();
  auto ref = block->neuron->multi_step(
      block->bn(block->conv(x.flatten(0, 1))).view({T, N, 4, 6, 6}));
  EXPECT_EQ(block->bn->num_batches_tracked.item<int64_t>(), 2);  // one call each
  expect_close(y, ref, 0.0, "one BatchNorm over T*N rows");
  MPIPE_EXPECT_ERROR(SpikingConvBlock(SpikingConvBlockOptions(1, 2).pool(-1)), "pool must be >= 0");
}

TEST(MultiStepNeurons, FusedKernelEqualsSingleSteps_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  if (!mpipe::snn::fused_cuda_kernels_built()) {
    GTEST_SKIP() << "built without nvcc: no fused CUDA kernels to test";
  }
  torch::manual_seed(4);
  const int64_t T = 16;
  const torch::Device g("cuda:0");
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    for (bool float_membrane : {true, false}) {
      if (!float_membrane && dtype != torch::kHalf && dtype != torch::kBFloat16) continue;
      for (const auto& variant : neuron_variants(true, float_membrane)) {
        const std::string what = variant.first + " dtype=" + c10::toString(dtype) +
                                 " float_membrane=" + std::to_string(float_membrane);
        SCOPED_TRACE(what);
        const auto x0 = torch::randn({64, 33}, g).to(dtype);
        const auto xs = torch::randn({T, 64, 33}, g).to(dtype);
        auto single = variant.second();
        auto multi = variant.second();
        const StepsResult ref = run_steps(*single, x0, xs, {});
        const int64_t launches = mpipe::snn::fused_cuda_kernel_launches();
        const StepsResult got = run_steps(*multi, x0, xs, {T});
        // Warm-up step and the T steps: one kernel each way for each.
        EXPECT_EQ(mpipe::snn::fused_cuda_kernel_launches() - launches, 4);
        expect_equal_steps(got, ref, what);
        expect_equal_steps(run_steps(*multi, x0, xs, {5, 11}), ref, what + " chunks 5, 11");
      }
    }
  }
}
