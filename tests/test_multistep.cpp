// Multi-step SNN layers (StepMode::Multi): neurons over [T, N, ...] against T
// single steps (values and BPTT gradients, tolerance 0), SeqToANN, MultiStep,
// SpikingConvBlock, and the pipeline's time chunks.

#include "common.h"

#include <mpipe/autocast.h>
#include <mpipe/snn.h>

#include "mpipe/detail/snn/fused_neuron.h"  // the kernel launch count

#include <cmath>

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
/// decay_input; hard, negative-hard and soft reset; detach_reset; every
/// surrogate, the last three on LIF only), fused or not, with float_membrane
/// as given; and, unfused, ParametricLIFNode with each reset and charge.
std::vector<std::pair<std::string, std::function<std::shared_ptr<NeuronBase>()>>> neuron_variants(
    bool fused, bool float_membrane = true) {
  std::vector<std::pair<std::string, std::function<std::shared_ptr<NeuronBase>()>>> out;
  for (bool lif : {false, true}) {
    for (std::optional<double> v_reset :
         {std::optional<double>(0.0), std::optional<double>(-0.2), std::optional<double>()}) {
      for (bool decay_input : {true, false}) {
        for (bool detach_reset : {false, true}) {
          for (int kind = 0; kind < 5; ++kind) {
            if (!lif && !decay_input) continue;
            if (!lif && kind >= 2) continue;  // the newer surrogates: on LIF, every reset
            const Surrogate s = kind == 0   ? Surrogate::atan()
                                : kind == 1 ? Surrogate::sigmoid(3.0)
                                : kind == 2 ? Surrogate::piecewise_quadratic(0.8)
                                : kind == 3 ? Surrogate::soft_sign()
                                            : Surrogate::erf(1.5);
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
  if (!fused) {
    for (std::optional<double> v_reset : {std::optional<double>(0.0), std::optional<double>()}) {
      for (bool decay_input : {true, false}) {
        const std::string name = std::string("ParametricLIF v_reset=") +
                                 (v_reset ? "0" : "soft") +
                                 " decay_input=" + std::to_string(decay_input);
        out.emplace_back(name, [=]() -> std::shared_ptr<NeuronBase> {
          return mpipe::snn::ParametricLIFNode(mpipe::snn::ParametricLIFNodeOptions()
                                                   .init_tau(2.5)
                                                   .v_threshold(0.8)
                                                   .v_reset(v_reset)
                                                   .decay_input(decay_input)
                                                   .float_membrane(float_membrane))
              .ptr();
        });
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
  // One product over T*N rows may round differently from T over N rows
  // (MKL does; Debian's CPU build does not): equal to the last bits.
  expect_close(seq_fc(x), torch::stack(per_step), 1e-13, "SeqToANN(Linear)");

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
  expect_close(ga, xg.grad(), 1e-13, "their input gradients");

  MPIPE_EXPECT_ERROR(seq_fc(torch::zeros({6})), "SeqToANN", "[T, N, ...]", "[6]");
  MPIPE_EXPECT_ERROR(ms(torch::Tensor()), "MultiStep", "undefined");
  mpipe::snn::SeqToANN bad(torch::nn::Flatten(torch::nn::FlattenOptions().start_dim(0)));
  MPIPE_EXPECT_ERROR(bad(torch::zeros({2, 3, 4})), "SeqToANN", "6 rows", "keep dim 0");
}

TEST(MultiStepContainers, SpikingConvBlockMultiStepEqualsSingleSteps) {
  using mpipe::snn::SpikingConvBlock;
  using mpipe::snn::SpikingConvBlockOptions;
  const int64_t T = 4, N = 3;
  for (const std::string neuron : {"IF", "LIF", "ParametricLIF"}) {
    for (bool training : {true, false}) {
      for (int64_t pool : {0, 2}) {
        SCOPED_TRACE(neuron + " training=" + std::to_string(training) +
                     " pool=" + std::to_string(pool));
        auto options = SpikingConvBlockOptions(2, 4).pool(pool);
        if (neuron == "LIF") options.neuron(LIFNodeOptions().surrogate(Surrogate::atan()));
        // Its learnable time constant gets a gradient summed over the steps.
        if (neuron == "ParametricLIF") {
          options.neuron(mpipe::snn::ParametricLIFNodeOptions().init_tau(3).surrogate(Surrogate::atan()));
        }
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
        const int64_t launches = mpipe::detail::fused_cuda_kernel_launches();
        const StepsResult got = run_steps(*multi, x0, xs, {T});
        // Warm-up step and the T steps: one kernel each way for each.
        EXPECT_EQ(mpipe::detail::fused_cuda_kernel_launches() - launches, 4);
        expect_equal_steps(got, ref, what);
        expect_equal_steps(run_steps(*multi, x0, xs, {5, 11}), ref, what + " chunks 5, 11");
      }
    }
  }
}

namespace {

using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::snn::SeqToANN;

/// Three stages of Linear + LIF (the last Linear + IF), as single-step
/// stages and as multi-step stages sharing the same Linear layers.
struct TwinStages {
  std::vector<torch::nn::Linear> fc;
  std::vector<torch::nn::Sequential> single, multi;
  explicit TwinStages(int64_t width = 8, torch::Dtype dtype = torch::kDouble) {
    torch::manual_seed(17);
    for (int s = 0; s < 3; ++s) {
      fc.emplace_back(torch::nn::Linear(width, width));
      fc.back()->to(dtype);
      const bool last = s == 2;
      auto neuron = [&](StepMode mode) -> torch::nn::AnyModule {
        // Low thresholds: every layer spikes, so every weight gets a gradient.
        if (last) return torch::nn::AnyModule(IFNode(IFNodeOptions().v_threshold(0.5).step_mode(mode)));
        return torch::nn::AnyModule(
            LIFNode(LIFNodeOptions().v_threshold(0.2).v_reset(std::nullopt).step_mode(mode)));
      };
      single.emplace_back(torch::nn::Sequential(fc.back()));
      single.back()->push_back(neuron(StepMode::Single));
      multi.emplace_back(torch::nn::Sequential(SeqToANN(fc.back())));
      multi.back()->push_back(neuron(StepMode::Multi));
    }
  }
  ModelPipeline pipeline(bool multi_step, ModelPipelineOptions options = {}) const {
    ModelPipeline pipe(options);
    for (const auto& stage : multi_step ? multi : single) pipe->append(stage, "cpu");
    return pipe;
  }
};

}  // namespace

TEST(TimeChunks, EveryChunkSizeEqualsSingleStepStages) {
  TwinStages twin;
  const int64_t T = 10, N = 4;
  auto x = torch::rand({N, 8}, torch::kDouble) * 1.5;
  auto seq = torch::rand({T, N, 8}, torch::kDouble) * 1.5;
  for (bool threads : {true, false}) {
    SCOPED_TRACE("worker_threads=" + std::to_string(threads));
    auto single = twin.pipeline(false, ModelPipelineOptions().worker_threads(threads));
    auto multi = twin.pipeline(true, ModelPipelineOptions().worker_threads(threads));
    const auto sum_ref = single->constant_forward(x, T, true);
    const auto cat_ref = single->constant_forward(x, T, false);
    const auto seq_ref = single->sequence_forward(seq, false);
    const auto seq_sum_ref = single->sequence_forward(seq, true);
    ASSERT_GT(sum_ref.sum().item<double>(), 0.0) << "the test should make spikes";
    ASSERT_LT(cat_ref.mean().item<double>(), 0.9) << "and not spike everywhere";
    for (int64_t k : {1, 2, 3, 4, 10, 25}) {
      SCOPED_TRACE("time_chunk " + std::to_string(k));
      expect_close(multi->constant_forward(x, T, true, k), sum_ref, 0.0, "constant_forward sum");
      expect_close(multi->constant_forward(x, T, false, k), cat_ref, 0.0,
                   "constant_forward, steps concatenated");
      expect_close(multi->sequence_forward(seq, false, k), seq_ref, 0.0, "sequence_forward");
      expect_close(multi->sequence_forward(seq, true, k), seq_sum_ref, 0.0,
                   "sequence_forward sum");
      EXPECT_EQ(mpipe::reset_states(*multi), 3);
    }
    mpipe::reset_states(*single);
  }
  // The options give the default chunk.
  auto by_options = twin.pipeline(
      true, ModelPipelineOptions().step_mode(StepMode::Multi).time_chunk(3));
  auto reference = twin.pipeline(false);
  expect_close(by_options->constant_forward(x, T), reference->constant_forward(x, T), 0.0,
               "ModelPipelineOptions::time_chunk");
}

TEST(TimeChunks, RunUnderBFloat16Autocast) {
  TwinStages twin(8, torch::kFloat);
  auto multi = twin.pipeline(true);
  const int64_t T = 6;
  auto x = torch::rand({5, 8}) * 2;
  mpipe::AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
  // The plain multi-step stages on all T steps, summed step by step.
  for (auto stage : twin.multi) mpipe::reset_states(*stage);
  torch::Tensor h = x.unsqueeze(0).expand({T, 5, 8});
  for (auto stage : twin.multi) h = stage->forward(h);
  for (auto stage : twin.multi) mpipe::reset_states(*stage);
  torch::Tensor want = h[0];
  for (int64_t t = 1; t < T; ++t) want = want + h[t];
  EXPECT_EQ(want.scalar_type(), torch::kBFloat16) << "autocast reaches the Linear layers";
  ASSERT_GT(want.sum().item<double>(), 0.0) << "the test should make spikes";
  for (int64_t k : {int64_t{6}, int64_t{2}, int64_t{1}}) {
    SCOPED_TRACE("time_chunk " + std::to_string(k));
    const auto got = multi->constant_forward(x, T, true, k);
    mpipe::reset_states(*multi);
    EXPECT_EQ(got.scalar_type(), torch::kBFloat16);
    expect_close(got, want, 0.0, "spike counts under bf16 autocast");
  }
  // A training step under autocast gives float gradients, and the first
  // layer's reach it (the later layers' inputs may not spike here).
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor&) { return out.to(torch::kFloat).mean(); };
  for (auto& fc : twin.fc) fc->zero_grad();
  const auto loss = multi->constant_train_step(x, T, torch::Tensor(), loss_fn, 2);
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  for (auto& fc : twin.fc) {
    ASSERT_TRUE(fc->weight.grad().defined());
    EXPECT_EQ(fc->weight.grad().scalar_type(), torch::kFloat);
    EXPECT_TRUE(torch::isfinite(fc->weight.grad()).all().item<bool>());
  }
  EXPECT_GT(twin.fc[0]->weight.grad().abs().sum().item<double>(), 0.0);
}

TEST(TimeChunks, ConstantTrainStepEqualsSingleStepStagesForEveryChunk) {
  TwinStages twin;
  const int64_t T = 7, N = 5;
  auto x = torch::rand({N, 8}, torch::kDouble) * 1.5;
  auto target = torch::rand({N, 8}, torch::kDouble);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return (out - y).pow(2).mean();
  };
  auto single = twin.pipeline(false);
  auto xs = x.clone().requires_grad_();
  const auto loss_ref = single->constant_train_step(xs, T, target, loss_fn);
  // Both pipelines share the Linear layers: compare their gradients by layer.
  auto fc_grads = [&] {
    std::map<std::string, torch::Tensor> g;
    for (size_t s = 0; s < twin.fc.size(); ++s) {
      for (const auto& kv : grads_of(*twin.fc[s])) g[std::to_string(s) + "." + kv.first] = kv.second;
    }
    return g;
  };
  const auto grads_ref = fc_grads();
  ASSERT_EQ(grads_ref.size(), 6u);
  for (const auto& kv : grads_ref) {
    EXPECT_GT(kv.second.abs().sum().item<double>(), 0.0) << "no gradient reached " << kv.first;
  }
  const auto x_grad_ref = xs.grad().clone();
  ASSERT_GT(x_grad_ref.abs().sum().item<double>(), 0.0) << "gradients must reach the input";
  for (bool threads : {true, false}) {
    for (int64_t k : {1, 2, 3, 7, 9}) {
      SCOPED_TRACE("worker_threads=" + std::to_string(threads) + " time_chunk " +
                   std::to_string(k));
      auto multi = twin.pipeline(true, ModelPipelineOptions().worker_threads(threads));
      zero_grads(*multi);
      auto xm = x.clone().requires_grad_();
      const auto loss = multi->constant_train_step(xm, T, target, loss_fn, k);
      expect_close(loss, loss_ref, 0.0, "loss");
      // A weight's (and x's) gradient sums over steps: in one reduction per
      // chunk instead of per step, so only the last bits may differ.
      expect_same_grads(fc_grads(), grads_ref, 1e-12);
      expect_close(xm.grad(), x_grad_ref, 1e-12, "gradient of x");
      EXPECT_FALSE(multi->stage(0)->children()[1]->as<LIFNode>()->holds_state())
          << "constant_train_step resets the state after the step";
    }
  }
}

TEST(TimeChunks, SpikingConvBlocksInTrainingEqualSingleStepStages) {
  using mpipe::snn::SpikingConvBlock;
  using mpipe::snn::SpikingConvBlockOptions;
  const int64_t T = 5, N = 3;
  auto make = [&](StepMode mode) {
    torch::manual_seed(23);
    ModelPipeline pipe;
    pipe->append(SpikingConvBlock(SpikingConvBlockOptions(1, 4).pool(2).neuron(
                     IFNodeOptions().step_mode(mode))),
                 "cpu");
    pipe->append(SpikingConvBlock(SpikingConvBlockOptions(4, 4).neuron(
                     LIFNodeOptions().step_mode(mode))),
                 "cpu");
    pipe->to(torch::kDouble);
    return pipe;
  };
  auto x = torch::rand({N, 1, 8, 8}, torch::kDouble) * 2;
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor&) { return out.mean(); };
  auto single = make(StepMode::Single);
  const auto out_ref = single->constant_forward(x, T, false);
  mpipe::reset_states(*single);
  const auto loss_ref = single->constant_train_step(x, T, torch::Tensor(), loss_fn);
  const auto grads_ref = grads_of(*single);
  ASSERT_GT(out_ref.sum().item<double>(), 0.0) << "the test should make spikes";
  for (int64_t k : {1, 2, 5}) {
    SCOPED_TRACE("time_chunk " + std::to_string(k));
    auto multi = make(StepMode::Multi);
    expect_close(multi->constant_forward(x, T, false, k), out_ref, 0.0, "spikes");
    mpipe::reset_states(*multi);
    expect_close(multi->constant_train_step(x, T, torch::Tensor(), loss_fn, k), loss_ref, 0.0,
                 "loss");
    expect_same_grads(grads_of(*multi), grads_ref, 1e-12);
    for (size_t s = 0; s < 2; ++s) {
      auto a = single->stage(s)->as<mpipe::snn::SpikingConvBlockImpl>();
      auto b = multi->stage(s)->as<mpipe::snn::SpikingConvBlockImpl>();
      expect_close(a->bn->running_mean, b->bn->running_mean, 0.0, "running mean");
      expect_close(a->bn->running_var, b->bn->running_var, 0.0, "running variance");
    }
  }
}

namespace {
/// A multi-step stage that fails at one time step, or returns the wrong
/// number of steps.
struct ChunkProbeImpl : torch::nn::Module {
  int64_t fail_at = -1;     // a global step; -1: never
  bool drop_step = false;   // return one step fewer
  bool drop_time = false;   // return [N, ...]: no time dimension
  int64_t seen = 0;
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t k = x.size(0);
    const int64_t first = seen;
    seen += k;
    TORCH_CHECK(!(fail_at >= first && fail_at < first + k), "probe failure at step ", fail_at);
    if (drop_time) return x.select(0, 0) * 2;
    return drop_step ? x.narrow(0, 0, k - 1) * 2 : x * 2;
  }
};
TORCH_MODULE(ChunkProbe);
}  // namespace

TEST(TimeChunks, ErrorsNameStageChunkAndStepsAndThePipelineStaysUsable) {
  TwinStages twin;
  auto pipe = twin.pipeline(true);
  ChunkProbe probe;
  pipe->append(probe, "cpu");
  auto x = torch::rand({2, 8}, torch::kDouble);
  const auto good = pipe->constant_forward(x, 10, true, 4);
  mpipe::reset_states(*pipe);
  probe->seen = 0;

  probe->fail_at = 6;
  MPIPE_EXPECT_ERROR(pipe->constant_forward(x, 10, true, 4), "constant_forward", "stage 3",
                     "time chunk 1 of 3", "time steps 4 to 7 of 10", "probe failure at step 6");
  probe->fail_at = -1;
  probe->seen = 0;
  EXPECT_FALSE(pipe->stage(0)->children()[1]->as<LIFNode>()->holds_state())
      << "a failed call leaves the state it found";
  expect_close(pipe->constant_forward(x, 10, true, 4), good, 0.0, "after the error");
  mpipe::reset_states(*pipe);
  probe->seen = 0;

  // A chunk of the wrong length, or without its time dimension: the call,
  // stage and chunk are named once, then what the stage returned.
  auto message = [&] {
    std::string msg;
    try {
      pipe->sequence_forward(torch::rand({10, 2, 8}, torch::kDouble), false, 4);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    probe->seen = 0;
    mpipe::reset_states(*pipe);
    EXPECT_EQ(msg.find("mpipe::ModelPipeline::", 1), std::string::npos) << msg;
    return msg;
  };
  const std::string start =
      "mpipe::ModelPipeline::sequence_forward: stage 3 (on cpu) failed at time chunk 0 of 3 "
      "(time steps 0 to 3 of 10): the stage returned shape ";
  const std::string end = "; a multi-step stage returns [k, N, ...] with k = 4 steps along dim 0";
  probe->drop_step = true;
  EXPECT_EQ(message().substr(0, start.size() + 9 + end.size()), start + "[3, 2, 8]" + end);
  probe->drop_step = false;
  probe->drop_time = true;
  EXPECT_EQ(message().substr(0, start.size() + 6 + end.size()), start + "[2, 8]" + end);
  probe->drop_time = false;

  probe->fail_at = 9;
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor&) { return out.mean(); };
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 10, torch::Tensor(), loss_fn, 4),
                     "constant_train_step", "stage 3", "time chunk 2 of 3",
                     "time steps 8 to 9 of 10");
  probe->fail_at = -1;
  probe->seen = 0;
  EXPECT_TRUE(pipe->constant_train_step(x, 10, torch::Tensor(), loss_fn, 4).defined());

  MPIPE_EXPECT_ERROR(pipe->constant_forward(x, 10, true, 0), "constant_forward",
                     "time_chunk (time steps per stage call) must be >= 1, got 0");
  MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::rand({3, 2, 8}), false, -2),
                     "sequence_forward", "got -2");
  auto bad = twin.pipeline(true, ModelPipelineOptions().step_mode(StepMode::Multi).time_chunk(-3));
  MPIPE_EXPECT_ERROR(bad->constant_forward(x, 10), "ModelPipelineOptions::time_chunk", "got -3");
}

TEST(TimeChunks, TheDefaultChunkIsAllStepsOnOneDevice) {
  TwinStages twin;
  auto pipe = twin.pipeline(true, ModelPipelineOptions().step_mode(StepMode::Multi));
  ChunkProbe probe;
  std::vector<int64_t> sizes;
  pipe->append(torch::nn::Sequential(probe), "cpu");
  auto x = torch::rand({2, 8}, torch::kDouble);
  probe->fail_at = 100;  // a step never reached: the probe only counts
  pipe->constant_forward(x, 10);
  EXPECT_EQ(probe->seen, 10);
  // One chunk: the probe saw all 10 steps at once, so failing at step 9
  // names chunk 0 of 1.
  mpipe::reset_states(*pipe);
  probe->seen = 0;
  probe->fail_at = 9;
  MPIPE_EXPECT_ERROR(pipe->constant_forward(x, 10), "time chunk 0 of 1", "time steps 0 to 9 of 10");
}

TEST(TimeChunks, EqualSingleStepStagesOnTheGpuEagerAndGraphed_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  TwinStages twin(64);
  for (auto& fc : twin.fc) fc->to(torch::kCUDA);
  const int64_t T = 12;
  auto x = torch::rand({32, 64}, torch::TensorOptions(torch::kCUDA).dtype(torch::kDouble)) * 1.5;
  for (bool graphs : {false, true}) {
    ModelPipeline single(ModelPipelineOptions().cuda_graphs(graphs));
    ModelPipeline multi(ModelPipelineOptions().cuda_graphs(graphs));
    for (size_t s = 0; s < 3; ++s) {
      single->append(twin.single[s], "cuda:0");
      multi->append(twin.multi[s], "cuda:0");
    }
    torch::NoGradGuard no_grad;
    const auto ref = single->constant_forward(x, T, false);
    mpipe::reset_states(*single);
    ASSERT_GT(ref.sum().item<double>(), 0.0);
    for (int64_t k : {1, 4, 5, 12}) {
      SCOPED_TRACE("cuda_graphs=" + std::to_string(graphs) + " time_chunk " + std::to_string(k));
      for (int rep = 0; rep < 2; ++rep) {  // a graphed call is captured, then replayed
        // cuBLAS may sum a product in another order for another row count.
        expect_close(multi->constant_forward(x, T, false, k), ref, 1e-12, "spikes");
        mpipe::reset_states(*multi);
      }
    }
  }
}

namespace {

/// The steps of `seq` [T, ...] added one at a time, as single steps add them.
torch::Tensor loop_sum(const torch::Tensor& seq) {
  torch::Tensor acc = seq[0];
  for (int64_t t = 1; t < seq.size(0); ++t) acc = acc + seq[t];
  return acc;
}

}  // namespace

// Note [Summing a chunk's steps]: on CUDA, float chunks are summed by one
// cumsum kernel, which must add exactly as the loop does. The last stage is a
// Linear, so its outputs are not spikes and the order of additions shows.
TEST(TimeChunks, SumsOverStepsAddInStepOrderAndGraphedCallsReplay_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  TwinStages twin(64, torch::kFloat);
  for (auto& fc : twin.fc) fc->to(torch::kCUDA);
  torch::nn::Linear head(64, 16);
  head->to(torch::kCUDA);
  const int64_t T = 12, N = 32;
  auto x = torch::rand({N, 64}, torch::TensorOptions(torch::kCUDA)) * 1.5;
  auto frames = torch::rand({T, N, 64}, torch::TensorOptions(torch::kCUDA)) * 1.5;
  torch::NoGradGuard no_grad;
  for (bool graphs : {false, true}) {
    HostCalls counting;
    ModelPipeline multi(ModelPipelineOptions().cuda_graphs(graphs).reset_state_each_call(true));
    for (size_t s = 0; s < 3; ++s) multi->append(twin.multi[s], "cuda:0");
    multi->append(torch::nn::Sequential(counting, SeqToANN(head)), "cuda:0");
    for (int64_t k : {1, 3, 4, 12}) {
      SCOPED_TRACE("cuda_graphs=" + std::to_string(graphs) + " time_chunk " + std::to_string(k));
      const auto steps = multi->constant_forward(x, T, false, k).view({T, N, 16});
      ASSERT_GT(steps.abs().sum().item<double>(), 0.0);
      const auto seq_steps = multi->sequence_forward(frames, false, k);
      int64_t calls = 0;
      for (int rep = 0; rep < 3; ++rep) {  // graphed: captured, then replayed
        if (rep == 2) calls = counting->calls;
        EXPECT_TRUE(torch::equal(multi->constant_forward(x, T, true, k), loop_sum(steps)));
        EXPECT_TRUE(torch::equal(multi->sequence_forward(frames, true, k), loop_sum(seq_steps)));
      }
      if (graphs) EXPECT_EQ(counting->calls, calls) << "the third calls must be replays";
    }
    if (graphs) EXPECT_EQ(multi->cuda_graphs_captured(), 16u) << "2 methods x 2 reductions x 4 chunks";
  }
}

// ParametricLIFNode through the pipeline: constant_train_step with single-step
// stages and with time chunks, threaded and inline, checkpointed or not,
// against a plain loop over T steps; the loss, every Linear's and every
// neuron's w gradient.
TEST(TimeChunks, ParametricLIFStagesTrainLikeAPlainLoop) {
  using mpipe::snn::ParametricLIFNode;
  using mpipe::snn::ParametricLIFNodeOptions;
  const int64_t T = 6, N = 4, W = 8;
  struct Net {
    std::vector<torch::nn::Linear> fc;
    std::vector<ParametricLIFNode> neuron;
  };
  auto make = [&](StepMode mode) {
    torch::manual_seed(31);
    Net net;
    for (int s = 0; s < 3; ++s) {
      net.fc.emplace_back(W, W);
      net.fc.back()->to(torch::kDouble);
      net.neuron.emplace_back(ParametricLIFNodeOptions()
                                  .init_tau(1.5 + s)
                                  .v_threshold(0.3)
                                  .v_reset(s == 1 ? std::nullopt : std::optional<double>(0.0))
                                  .step_mode(mode));
      net.neuron.back()->to(torch::kDouble);
    }
    return net;
  };
  torch::manual_seed(32);
  const auto x = torch::rand({N, W}, torch::kDouble) * 1.5;
  const auto target = torch::rand({N, W}, torch::kDouble);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) { return (out - y).pow(2).mean(); };
  auto grads = [](const Net& net) {
    std::vector<torch::Tensor> g;
    for (size_t s = 0; s < 3; ++s) {
      g.push_back(net.fc[s]->weight.grad());
      g.push_back(net.neuron[s]->w.grad());
    }
    return g;
  };
  // The plain loop.
  Net ref = make(StepMode::Single);
  torch::Tensor sum;
  for (int64_t t = 0; t < T; ++t) {
    torch::Tensor h = x;
    for (size_t s = 0; s < 3; ++s) h = ref.neuron[s](ref.fc[s](h));
    sum = sum.defined() ? sum + h : h;
  }
  const auto loss_ref = loss_fn(sum, target);
  loss_ref.backward();
  const auto want = grads(ref);
  for (const auto& g : want) {
    ASSERT_TRUE(g.defined());
    ASSERT_GT(g.abs().sum().item<double>(), 0.0) << "every layer must get a gradient";
  }
  for (int64_t k : {0, 1, 4, 6}) {  // 0: single-step stages
    for (bool threads : {true, false}) {
      for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::Always}) {
        SCOPED_TRACE("chunk " + std::to_string(k) + " threads=" + std::to_string(threads) +
                     " checkpoint=" + std::to_string(static_cast<int>(checkpoint)));
        Net net = make(k == 0 ? StepMode::Single : StepMode::Multi);
        auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threads).checkpoint(checkpoint));
        for (size_t s = 0; s < 3; ++s) {
          torch::nn::Sequential stage;
          if (k == 0) {
            stage->push_back(net.fc[s]);
          } else {
            stage->push_back(SeqToANN(net.fc[s]));
          }
          stage->push_back(net.neuron[s]);
          pipe->append(stage, "cpu");
        }
        const auto loss = k == 0 ? pipe->constant_train_step(x, T, target, loss_fn)
                                 : pipe->constant_train_step(x, T, target, loss_fn, k);
        expect_close(loss, loss_ref, 1e-14, "loss");
        const auto got = grads(net);
        for (size_t i = 0; i < got.size(); ++i) {
          expect_close(got[i], want[i], 1e-12, (i % 2 ? "w of neuron " : "weight of Linear ") +
                                                    std::to_string(i / 2));
        }
      }
    }
  }
}
