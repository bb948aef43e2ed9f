// The SNN toolkit: surrogate gradients against finite differences, neuron
// dynamics against independent reference loops, resets, per-micro-batch state
// through a pipeline, sequence_forward, encoders and rate decoding, and the
// neurons in half and bfloat16 against their ATen path.

#include "common.h"

#include <mpipe/snn.h>

#include "mpipe/detail/snn/fused_neuron.h"  // the kernel launch count

#include <cmath>

using namespace mpipe_test;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::snn::IFNode;
using mpipe::snn::IFNodeOptions;
using mpipe::snn::LIFNode;
using mpipe::snn::LIFNodeOptions;
using mpipe::snn::Surrogate;

namespace {

/// SpikingJelly's surrogate functions (their primitive_function, as written
/// in spikingjelly/activation_based/surrogate.py), not taken from mpipe.
struct RefSurrogate {
  enum Kind { Sigmoid, ATan, PiecewiseQuadratic, SoftSign, Erf } kind;
  double alpha;
  torch::Tensor smooth(const torch::Tensor& x) const {
    switch (kind) {
      case Sigmoid:
        return torch::sigmoid(alpha * x);
      case ATan:
        return torch::atan(M_PI / 2 * alpha * x) / M_PI + 0.5;
      case PiecewiseQuadratic: {
        const auto mask0 = (x > 1 / alpha).to(x.scalar_type());
        const auto mask1 = (x.abs() <= 1 / alpha).to(x.scalar_type());
        return mask0 + mask1 * (-(alpha * alpha) / 2 * x.square() * x.sign() + alpha * x + 0.5);
      }
      case SoftSign:
        return (x / (1 / alpha + x.abs()) + 1) / 2;
      case Erf:
        return torch::special_erfc(-alpha * x) / 2;
    }
    return {};
  }
  /// Heaviside(x) forward (1 at x >= 0), g'(x) backward.
  torch::Tensor spike(const torch::Tensor& x) const {
    const torch::Tensor g = smooth(x);
    return x.ge(0).to(x.scalar_type()) + (g - g.detach());
  }
};

}  // namespace

TEST(Surrogate, ForwardIsTheStepAndBackwardMatchesFiniteDifferences) {
  // An even count: no point at 0, where the piecewise quadratic's and soft
  // sign's derivatives have a kink that central differences would smear.
  auto x = torch::linspace(-2.05, 2.05, 82, torch::kDouble);
  const std::vector<std::pair<Surrogate, RefSurrogate>> cases = {
      {Surrogate::sigmoid(), {RefSurrogate::Sigmoid, 4.0}},
      {Surrogate::sigmoid(1.5), {RefSurrogate::Sigmoid, 1.5}},
      {Surrogate::atan(), {RefSurrogate::ATan, 2.0}},
      {Surrogate::atan(5.0), {RefSurrogate::ATan, 5.0}},
      {Surrogate::piecewise_quadratic(), {RefSurrogate::PiecewiseQuadratic, 1.0}},
      {Surrogate::piecewise_quadratic(1.3), {RefSurrogate::PiecewiseQuadratic, 1.3}},
      {Surrogate::soft_sign(), {RefSurrogate::SoftSign, 2.0}},
      {Surrogate::soft_sign(0.7), {RefSurrogate::SoftSign, 0.7}},
      {Surrogate::erf(), {RefSurrogate::Erf, 2.0}},
      {Surrogate::erf(3.0), {RefSurrogate::Erf, 3.0}}};
  for (const auto& c : cases) {
    const Surrogate& s = c.first;
    SCOPED_TRACE(s.name());
    auto xg = x.clone().requires_grad_();
    auto spikes = s(xg);
    expect_close(spikes, x.ge(0).to(torch::kDouble), 0.0, "forward");
    spikes.sum().backward();
    // The gradient is g'(x) of the independently written g (central differences).
    const double h = 1e-6;
    auto numeric = (c.second.smooth(x + h) - c.second.smooth(x - h)) / (2 * h);
    expect_close(xg.grad(), numeric, 1e-7, "surrogate gradient vs finite differences");
    expect_close(s.derivative(x), numeric, 1e-7, "derivative()");
    expect_close(s.smooth(x), c.second.smooth(x), 1e-12, "smooth()");
  }
  // The documented closed forms at x = 0.
  EXPECT_NEAR(Surrogate::sigmoid(4).derivative(torch::zeros({1}, torch::kDouble)).item<double>(),
              1.0, 1e-12);
  EXPECT_NEAR(Surrogate::atan(2).derivative(torch::zeros({1}, torch::kDouble)).item<double>(),
              1.0, 1e-12);
  EXPECT_NEAR(Surrogate::piecewise_quadratic(1).derivative(torch::zeros({1}, torch::kDouble))
                  .item<double>(), 1.0, 1e-12);
  EXPECT_EQ(Surrogate::piecewise_quadratic(1).derivative(torch::full({1}, 1.5, torch::kDouble))
                .item<double>(), 0.0) << "no gradient outside |x| <= 1 / alpha";
  EXPECT_NEAR(Surrogate::soft_sign(2).derivative(torch::zeros({1}, torch::kDouble)).item<double>(),
              1.0, 1e-12);
  EXPECT_NEAR(Surrogate::erf(2).derivative(torch::zeros({1}, torch::kDouble)).item<double>(),
              2 / std::sqrt(M_PI), 1e-12);
  EXPECT_EQ(Surrogate::erf(2).name(), "Erf(alpha=2)");
  MPIPE_EXPECT_ERROR(Surrogate::soft_sign(0.0), "alpha must be positive", "got 0");
  MPIPE_EXPECT_ERROR(Surrogate::sigmoid(0.0), "alpha must be positive", "got 0");
  MPIPE_EXPECT_ERROR(Surrogate::atan(-1.0), "got -1");
}

namespace {

/// SpikingJelly's equations written out independently of mpipe's neurons and
/// surrogates.
struct Reference {
  bool lif;
  double tau, v_threshold;
  std::optional<double> v_reset;
  bool decay_input, detach_reset;
  RefSurrogate surrogate;

  std::vector<torch::Tensor> run(const std::vector<torch::Tensor>& xs) const {
    const double vr = v_reset.value_or(0.0);
    torch::Tensor v = torch::full_like(xs[0], vr);
    std::vector<torch::Tensor> out;
    for (const auto& x : xs) {
      if (!lif) {
        v = v + x;
      } else if (decay_input) {
        v = v + (x - (v - vr)) / tau;
      } else {
        v = v - (v - vr) / tau + x;
      }
      auto spike = surrogate.spike(v - v_threshold);
      auto s = detach_reset ? spike.detach() : spike;
      v = v_reset ? v * (1 - s) + *v_reset * s : v - v_threshold * s;
      out.push_back(spike);
    }
    return out;
  }
};

}  // namespace

TEST(Neurons, DynamicsAndGradientsMatchTheEquations) {
  torch::manual_seed(0);
  const int64_t T = 12;
  for (bool lif : {false, true}) {
    for (std::optional<double> v_reset :
         {std::optional<double>(0.0), std::optional<double>(-0.2), std::optional<double>()}) {
      for (bool decay_input : {true, false}) {
        for (bool detach_reset : {false, true}) {
          for (bool fused : {true, false}) {  // one kernel, or ATen ops (Note [Fused neurons])
            for (int kind = 0; kind < 5; ++kind) {
              if (!lif && !decay_input) continue;  // IF has no decay
              const std::vector<Surrogate> surrogates = {
                  Surrogate::atan(), Surrogate::sigmoid(3.0), Surrogate::piecewise_quadratic(0.8),
                  Surrogate::soft_sign(), Surrogate::erf(1.5)};
              const std::vector<RefSurrogate> refs = {
                  {RefSurrogate::ATan, 2.0}, {RefSurrogate::Sigmoid, 3.0},
                  {RefSurrogate::PiecewiseQuadratic, 0.8}, {RefSurrogate::SoftSign, 2.0},
                  {RefSurrogate::Erf, 1.5}};
              const Surrogate surrogate = surrogates[static_cast<size_t>(kind)];
              const RefSurrogate ref_surrogate = refs[static_cast<size_t>(kind)];
              Reference ref{lif, 2.5, 0.8, v_reset, decay_input, detach_reset, ref_surrogate};
              SCOPED_TRACE(std::string(lif ? "LIF" : "IF") +
                           " v_reset=" + (v_reset ? std::to_string(*v_reset) : "soft") +
                           " decay_input=" + std::to_string(decay_input) +
                           " detach_reset=" + std::to_string(detach_reset) +
                           " fused=" + std::to_string(fused) + " surrogate=" + surrogate.name());
              torch::nn::AnyModule node;
              if (lif) {
                node = torch::nn::AnyModule(LIFNode(LIFNodeOptions()
                                                        .tau(2.5)
                                                        .v_threshold(0.8)
                                                        .v_reset(v_reset)
                                                        .decay_input(decay_input)
                                                        .detach_reset(detach_reset)
                                                        .surrogate(surrogate)
                                                        .fused(fused)));
              } else {
                node = torch::nn::AnyModule(IFNode(IFNodeOptions()
                                                       .v_threshold(0.8)
                                                       .v_reset(v_reset)
                                                       .detach_reset(detach_reset)
                                                       .surrogate(surrogate)
                                                       .fused(fused)));
              }
              auto w = torch::randn({T, 3, 4}, torch::kDouble);
              auto run = [&](bool mine, torch::Tensor& grad) {
                auto wg = w.clone().requires_grad_();
                std::vector<torch::Tensor> xs;
                for (int64_t t = 0; t < T; ++t) xs.push_back(wg[t] * 1.3);
                std::vector<torch::Tensor> out;
                if (mine) {
                  for (auto& x : xs) out.push_back(node.forward(x));
                } else {
                  out = ref.run(xs);
                }
                auto spikes = torch::stack(out);
                (spikes * torch::arange(1, T + 1, torch::kDouble).view({T, 1, 1})).sum().backward();
                grad = wg.grad();
                return spikes;
              };
              torch::Tensor g_mine, g_ref;
              auto s_mine = run(true, g_mine);
              auto s_ref = run(false, g_ref);
              expect_close(s_mine, s_ref, 0.0, "spikes");
              EXPECT_GT(s_mine.sum().item<double>(), 0.0) << "the test should make some spikes";
              expect_close(g_mine, g_ref, 1e-12, "gradients through time");
            }
          }
        }
      }
    }
  }
}

TEST(Neurons, FusedStepIsOneAutogradNode) {
  LIFNode fused, plain(LIFNodeOptions().fused(false));
  auto x = torch::randn({4, 5}, torch::requires_grad());
  const std::string fused_name = fused(x).grad_fn()->name();
  const std::string plain_name = plain(x).grad_fn()->name();
  EXPECT_NE(fused_name.find("FusedNeuronStep"), std::string::npos) << fused_name;
  EXPECT_EQ(plain_name.find("FusedNeuronStep"), std::string::npos) << plain_name;
  // Float and the reduced types run too, and agree with the ATen path.
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    auto xs = torch::randn({64}).mul(2).to(dtype);
    fused->reset_state();
    plain->reset_state();
    for (int t = 0; t < 3; ++t) {
      auto a = fused(xs), b = plain(xs);
      EXPECT_EQ(a.scalar_type(), dtype);
      EXPECT_LE((a.to(torch::kDouble) - b.to(torch::kDouble)).abs().sum().item<double>(), 1.0)
          << "at most one spike may differ by rounding, step " << t;
    }
  }
}

TEST(Neurons, ResetStatesReachesEveryNeuronInATree) {
  torch::nn::Sequential inner(torch::nn::Linear(3, 3), IFNode());
  LIFNode lif;
  IFNode last;
  torch::nn::ModuleList model(inner, lif, torch::nn::Linear(3, 2), last);  // a tree
  auto x = torch::randn({2, 3});
  last(model[2]->as<torch::nn::Linear>()->forward(lif(inner->forward(x))));
  ASSERT_EQ(lif->membrane_potentials().size(), 1u);
  EXPECT_EQ(mpipe::reset_states(*model), 3);
  EXPECT_TRUE(lif->membrane_potentials().empty());

  // Through a pipeline too.
  auto pipe = ModelPipeline();
  pipe->append(torch::nn::Sequential(torch::nn::Linear(3, 3), IFNode()), "cpu")
      .append(torch::nn::Sequential(torch::nn::Linear(3, 3), LIFNode()), "cpu");
  pipe->constant_forward(x, 3);
  EXPECT_EQ(mpipe::reset_states(*pipe), 2);
}

TEST(Neurons, StateFollowsDtypeAndWorksWithoutGradAndInEval) {
  LIFNode node;
  auto x = torch::full({2, 2}, 0.8);
  node(x);
  EXPECT_EQ(node->membrane_potentials()[0].scalar_type(), torch::kFloat);
  auto y = node(x.to(torch::kDouble));  // the state converts
  EXPECT_EQ(y.scalar_type(), torch::kDouble);
  node->reset_state();

  node->eval();
  torch::NoGradGuard no_grad;
  auto a = node(torch::full({1, 1}, 1.5));
  auto b = node(torch::full({1, 1}, 1.5));
  EXPECT_FALSE(a.requires_grad());
  // LIF tau 2: v = 0.75 (no spike), then 0.75 + (1.5 - 0.75)/2 = 1.125 (spike).
  EXPECT_EQ(a.item<float>(), 0.0f);
  EXPECT_EQ(b.item<float>(), 1.0f);
}

TEST(Neurons, BadInputsAreRefusedClearly) {
  IFNode node;
  node(torch::zeros({2, 3}));
  MPIPE_EXPECT_ERROR(node(torch::zeros({4, 3})), "IFNode", "[4, 3]", "[2, 3]",
                     "mpipe::reset_states");
  MPIPE_EXPECT_ERROR(node(torch::zeros({2, 3}, torch::kLong)), "floating point");
  MPIPE_EXPECT_ERROR(LIFNode(LIFNodeOptions().tau(1.0)), "tau must be a finite number > 1",
                     "got 1");
  MPIPE_EXPECT_ERROR(IFNode(IFNodeOptions().v_threshold(NAN)), "v_threshold must be finite");
}

TEST(MicroBatchState, GuardNestsAndSlotsAreChecked) {
  EXPECT_EQ(mpipe::current_micro_batch().index, 0);
  EXPECT_EQ(mpipe::current_micro_batch().count, 1);
  mpipe::PerMicroBatch<int> slots;
  {
    mpipe::MicroBatchGuard outer({2, 4});
    slots.get() = 7;
    {
      mpipe::MicroBatchGuard inner({0, 4});
      EXPECT_EQ(slots.get(), 0);
    }
    EXPECT_EQ(mpipe::current_micro_batch().index, 2);
    EXPECT_EQ(slots.get(), 7);
    EXPECT_EQ(slots.slots().size(), 4u);
  }
  EXPECT_EQ(mpipe::current_micro_batch().count, 1);
  mpipe::MicroBatchGuard bad({5, 2});
  MPIPE_EXPECT_ERROR(slots.get(), "micro-batch 5 of 2 is out of range");
}

namespace {

class SnnPipeline : public ::testing::TestWithParam<bool> {};

/// Two stages of [Linear, neuron] with state, and the same stages as one
/// plain model.
struct SpikingStages {
  explicit SpikingStages(int64_t width) {
    for (int i = 0; i < 3; ++i) {
      torch::nn::Linear fc(width, width);
      {
        torch::NoGradGuard no_grad;  // strong enough to make the neurons fire
        fc->weight.mul_(3);
        fc->bias.fill_(0.6);
      }
      torch::nn::Sequential s(fc, LIFNode(LIFNodeOptions().surrogate(Surrogate::atan())));
      s->to(torch::kDouble);
      stages.push_back(s);
    }
  }
  torch::Tensor plain(torch::Tensor x) {
    for (auto& s : stages) x = s->forward(x);
    return x;
  }
  void reset() {
    for (auto& s : stages) mpipe::reset_states(*s);
  }
  std::vector<torch::nn::Sequential> stages;
};

}  // namespace

TEST_P(SnnPipeline, MicroBatchesKeepTheirOwnStateForEverySplit) {
  torch::manual_seed(4);
  const int64_t width = 5, batch = 7, T = 6;
  SpikingStages net(width);
  auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(GetParam()));
  for (auto& s : net.stages) pipe->append(s, "cpu");
  auto xs = torch::rand({T, batch, width}, torch::kDouble) * 3;
  for (int64_t split : {1, 2, 3, 7}) {
    SCOPED_TRACE("split " + std::to_string(split));
    expect_transparent(
        *pipe, xs,
        [&](const torch::Tensor& in) {
          net.reset();
          std::vector<torch::Tensor> out;
          for (int64_t t = 0; t < T; ++t) out.push_back(pipe->forward(in[t], split));
          return torch::stack(out);
        },
        [&](const torch::Tensor& in) {
          net.reset();
          std::vector<torch::Tensor> out;
          for (int64_t t = 0; t < T; ++t) out.push_back(net.plain(in[t]));
          auto y = torch::stack(out);
          const double rate = y.mean().item<double>();
          EXPECT_TRUE(rate > 0.05 && rate < 0.95) << "spike rate " << rate << ": too few or "
                                                  << "too many spikes make the test weak";
          return y;
        });
  }
}

TEST_P(SnnPipeline, UserWrittenStatefulModulesKeepStatePerMicroBatch) {
  torch::manual_seed(9);
  const int64_t width = 4, batch = 6, T = 4;
  std::vector<Leaky> stages{Leaky(width, 0.5), Leaky(width, 0.8)};
  auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(GetParam()));
  for (auto& s : stages) {
    s->to(torch::kDouble);
    pipe->append(s, "cpu");
  }
  std::vector<torch::Device> devices(2, torch::kCPU);
  auto xs = torch::randn({T, batch, width}, torch::kDouble);
  for (int64_t split : {1, 4, 6}) {
    SCOPED_TRACE("split " + std::to_string(split));
    expect_transparent(
        *pipe, xs,
        [&](const torch::Tensor& in) {
          EXPECT_EQ(mpipe::reset_states(*pipe), 2);
          std::vector<torch::Tensor> out;
          for (int64_t t = 0; t < T; ++t) out.push_back(pipe->forward(in[t], split));
          EXPECT_EQ(stages[0]->state.slots().size(), static_cast<size_t>((batch + split - 1) / split));
          return torch::stack(out);
        },
        [&](const torch::Tensor& in) {
          for (auto& s : stages) s->reset_state();
          std::vector<torch::Tensor> out;
          for (int64_t t = 0; t < T; ++t) out.push_back(plain_forward(stages, devices, in[t]));
          return torch::stack(out);
        });
  }
}

TEST_P(SnnPipeline, SequenceForwardMatchesAPlainLoop) {
  torch::manual_seed(5);
  const int64_t width = 4, batch = 3;
  SpikingStages net(width);
  auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(GetParam()));
  for (auto& s : net.stages) pipe->append(s, "cpu");
  for (int64_t T : {1, 2, 5}) {
    for (bool reduce : {false, true}) {
      SCOPED_TRACE("T " + std::to_string(T) + " reduce " + std::to_string(reduce));
      auto xs = torch::rand({T, batch, width}, torch::kDouble) * 3;
      expect_transparent(
          *pipe, xs,
          [&](const torch::Tensor& in) {
            net.reset();
            auto y = pipe->sequence_forward(in, reduce);
            EXPECT_EQ(y.dim(), reduce ? 2 : 3);
            return y;
          },
          [&](const torch::Tensor& in) {
            net.reset();
            std::vector<torch::Tensor> out;
            for (int64_t t = 0; t < T; ++t) out.push_back(net.plain(in[t]));
            return reduce ? torch::stack(out).sum(0) : torch::stack(out);
          });
    }
  }
}

TEST_P(SnnPipeline, SequenceForwardOrderAndErrors) {
  auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(GetParam()));
  std::vector<Recorder> recorders(3);
  for (auto& r : recorders) pipe->append(r, "cpu");
  auto xs = torch::arange(4, torch::kDouble).view({4, 1, 1});
  auto y = pipe->sequence_forward(xs);
  expect_close(y, xs, 0.0);
  for (auto& r : recorders) EXPECT_EQ(r->seen, (std::vector<double>{0, 1, 2, 3}));
  MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::zeros({4})), "[T, N, ...]", "[4]");
  MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::zeros({0, 2})), "no time steps");
  MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::zeros({3, 0})), "batch is empty");
  pipe->append(Failing(2), "cpu");
  MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::zeros({4, 2})), "sequence_forward",
                     "stage 3", "time step 2 of 4", "planted failure");
}

INSTANTIATE_TEST_SUITE_P(Cpu, SnnPipeline, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "Threads" : "Inline");
                         });

TEST(Encoding, PoissonEncoderFiresAtTheGivenRate) {
  torch::manual_seed(6);
  auto p = torch::full({200000}, 0.3);
  auto s = mpipe::snn::poisson_encode(p);
  EXPECT_TRUE(torch::logical_or(s.eq(0), s.eq(1)).all().item<bool>());
  EXPECT_NEAR(s.mean().item<double>(), 0.3, 0.005);
  EXPECT_EQ(mpipe::snn::poisson_encode(torch::zeros({100})).sum().item<double>(), 0.0);
  EXPECT_EQ(mpipe::snn::poisson_encode(torch::ones({100})).sum().item<double>(), 100.0);
  mpipe::snn::PoissonEncoder enc;
  EXPECT_EQ(enc(torch::ones({2, 3})).sizes(), (torch::IntArrayRef{2, 3}));
  MPIPE_EXPECT_ERROR(mpipe::snn::poisson_encode(torch::tensor({0.5, 1.5})), "[0, 1]", "1.5");
  MPIPE_EXPECT_ERROR(mpipe::snn::poisson_encode(torch::tensor({-0.5, 0.5})), "-0.5");
}

namespace {
/// What poisson_encode(x) refuses with (empty: it accepts x).
std::string poisson_error(const torch::Tensor& x) {
  try {
    mpipe::snn::poisson_encode(x);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

/// One rule on every device: values outside [0, 1] (or NaN) are refused
/// with the same message, in every floating dtype; [0, 1] itself is fine.
void expect_poisson_range_checked(const torch::Device& device) {
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    SCOPED_TRACE(std::string(device.str()) + ", " + c10::toString(dtype));
    const auto opts = torch::TensorOptions().dtype(dtype).device(device);
    EXPECT_EQ(poisson_error(torch::tensor({0.0, 0.25, 1.0}, opts)), "");
    EXPECT_EQ(poisson_error(torch::empty({0}, opts)), "");
    EXPECT_EQ(poisson_error(torch::tensor({0.5, 1.5, 0.25}, opts)),
              "mpipe::snn::poisson_encode: x must lie in [0, 1], got values in [0.25, 1.5]");
    EXPECT_EQ(poisson_error(torch::tensor({{-0.5, 0.5}, {0.75, 1.0}}, opts)),
              "mpipe::snn::poisson_encode: x must lie in [0, 1], got values in [-0.5, 1]");
    const std::string nan = poisson_error(torch::tensor({0.5, std::nan("")}, opts));
    EXPECT_EQ(nan.rfind("mpipe::snn::poisson_encode: x must lie in [0, 1], got values in [", 0), 0u)
        << nan;
    EXPECT_NE(nan.find("nan"), std::string::npos) << nan;
  }
}
}  // namespace

TEST(Encoding, PoissonEncoderRefusesValuesOutsideZeroOne) {
  expect_poisson_range_checked(torch::kCPU);
}

TEST(Encoding, PoissonEncoderRefusesValuesOutsideZeroOne_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  expect_poisson_range_checked(torch::Device("cuda:0"));
  // A graphed call reads nothing back while it is captured: a PoissonEncoder
  // stage is captured and replayed like any other (its eager warm-up checks).
  auto pipe = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  pipe->append(mpipe::snn::PoissonEncoder(), "cuda:0");
  pipe->append(mlp_stage(8, 4), "cuda:0");
  torch::NoGradGuard no_grad;
  auto x = torch::rand({6, 8}, torch::Device("cuda:0"));
  for (int rep = 0; rep < 3; ++rep) EXPECT_EQ(pipe->forward(x, 3).sizes(), (torch::IntArrayRef{6, 4}));
  EXPECT_EQ(pipe->cuda_graphs_captured(), 1u);
}

TEST(Encoding, RateDecoding) {
  auto summed = torch::tensor({{2.0, 4.0, 0.0}, {1.0, 0.0, 3.0}});
  auto rate = mpipe::snn::rate_from_sum(summed, 4);
  expect_close(rate, summed / 4, 0.0);
  expect_close(mpipe::snn::predict(rate), torch::tensor({1, 2}), 0.0);
  auto seq = torch::stack({summed, summed * 0});
  expect_close(mpipe::snn::rate_from_sequence(seq), summed / 2, 0.0);
  auto labels = torch::tensor({1, 0});
  auto expected = ((rate - torch::tensor({{0.0, 1.0, 0.0}, {1.0, 0.0, 0.0}})).pow(2)).mean();
  expect_close(mpipe::snn::rate_mse_loss(rate, labels), expected, 1e-7);
  MPIPE_EXPECT_ERROR(mpipe::snn::rate_from_sum(summed, 0), "T must be positive");
  MPIPE_EXPECT_ERROR(mpipe::snn::rate_mse_loss(rate, torch::tensor({1})), "labels [2]");
}

TEST(Neurons, FusedKernelMatchesTheATenPath_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  using mpipe::snn::IFNodeOptions;
  using mpipe::snn::LIFNodeOptions;
  using mpipe::snn::Surrogate;
  const torch::Device g("cuda:0");
  if (!mpipe::snn::fused_cuda_kernels_built()) {
    GTEST_SKIP() << "built without nvcc: no fused CUDA kernels to test (fused neurons run "
                    "their ATen path on the GPU)";
  }
  torch::manual_seed(21);
  for (auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    const bool low = dtype == torch::kHalf || dtype == torch::kBFloat16;
    for (int variant = 0; variant < 8; ++variant) {
      SCOPED_TRACE("dtype " + std::string(c10::toString(dtype)) + ", variant " +
                   std::to_string(variant));
      auto make = [&](bool fused) -> torch::nn::AnyModule {
        switch (variant) {
          case 0: return torch::nn::AnyModule(mpipe::snn::LIFNode(LIFNodeOptions().fused(fused)));
          case 1:
            return torch::nn::AnyModule(mpipe::snn::LIFNode(
                LIFNodeOptions().v_reset(std::nullopt).surrogate(Surrogate::atan()).fused(fused)));
          case 2:
            return torch::nn::AnyModule(mpipe::snn::LIFNode(
                LIFNodeOptions().decay_input(false).detach_reset(true).v_reset(-0.25).fused(
                    fused)));
          case 3:
            return torch::nn::AnyModule(
                mpipe::snn::IFNode(IFNodeOptions().v_threshold(0.75).fused(fused)));
          case 5:
            return torch::nn::AnyModule(mpipe::snn::LIFNode(
                LIFNodeOptions().surrogate(Surrogate::piecewise_quadratic()).fused(fused)));
          case 6:
            return torch::nn::AnyModule(mpipe::snn::LIFNode(
                LIFNodeOptions().surrogate(Surrogate::soft_sign()).fused(fused)));
          case 7:
            return torch::nn::AnyModule(
                mpipe::snn::IFNode(IFNodeOptions().surrogate(Surrogate::erf()).fused(fused)));
          default:
            return torch::nn::AnyModule(mpipe::snn::IFNode(
                IFNodeOptions().v_reset(std::nullopt).detach_reset(true).surrogate(
                    Surrogate::atan(3.0)).fused(fused)));
        }
      };
      const int64_t T = 8;
      auto w = torch::randn({T, 64, 33}, torch::TensorOptions(g).dtype(dtype));
      auto run = [&](bool fused, torch::Tensor& grad) {
        auto node = make(fused);
        auto wg = w.clone().requires_grad_();
        std::vector<torch::Tensor> out;
        for (int64_t t = 0; t < T; ++t) out.push_back(node.forward(wg[t] * 1.3));
        auto spikes = torch::stack(out);
        auto weights = torch::arange(1, T + 1, torch::TensorOptions(g).dtype(dtype)).view({T, 1, 1});
        (spikes * weights).sum().backward();
        grad = wg.grad();
        return spikes;
      };
      torch::Tensor g_fused, g_aten;
      const int64_t launches = mpipe::detail::fused_cuda_kernel_launches();
      auto s_fused = run(true, g_fused);
      // T forward kernels and T backward kernels: the CUDA kernel ran, not ATen.
      EXPECT_EQ(mpipe::detail::fused_cuda_kernel_launches() - launches, 2 * T);
      const int64_t before_aten = mpipe::detail::fused_cuda_kernel_launches();
      auto s_aten = run(false, g_aten);
      EXPECT_EQ(mpipe::detail::fused_cuda_kernel_launches(), before_aten) << "fused(false) is ATen";
      EXPECT_GT(s_aten.sum().item<double>(), 0.0) << "the test should make some spikes";
      if (!low) {
        expect_close(s_fused, s_aten, 0.0, "spikes");
        expect_close(g_fused, g_aten, dtype == torch::kDouble ? 1e-10 : 1e-4, "gradients");
        continue;
      }
      // Half and bfloat16: the kernel computes each step in float and rounds
      // once, the ATen path rounds after every op, so a membrane within a
      // rounding step of the threshold may fire on one side only. Compare
      // with the CPU loop of the same arithmetic, and with the ATen path
      // loosely.
      const double mismatch = s_fused.ne(s_aten).to(torch::kDouble).mean().item<double>();
      EXPECT_LT(mismatch, 0.02) << "spikes differing from the ATen path";
      auto node = make(true);
      std::vector<torch::Tensor> cpu_out;
      {
        torch::NoGradGuard no_grad;
        auto wc = w.cpu();
        for (int64_t t = 0; t < T; ++t) cpu_out.push_back(node.forward(wc[t] * 1.3));
      }
      const double cpu_mismatch =
          s_fused.cpu().ne(torch::stack(cpu_out)).to(torch::kDouble).mean().item<double>();
      EXPECT_LT(cpu_mismatch, 0.005) << "spikes differing from the CPU loop of the same kernel";
      EXPECT_TRUE(g_fused.isfinite().all().item<bool>());
    }
  }
}

TEST(Neurons, StateFollowsTheInputAcrossDevices_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  mpipe::snn::LIFNode node;
  // x = 1.5 (tau = 2, threshold 1): the first step charges v to 0.75 and stays
  // silent; the second reaches 1.125 and fires, but only if v carried over.
  auto x = torch::full({2, 3}, 1.5);
  auto a = node(x);                                 // v on the CPU
  auto b = node(x.to(torch::Device("cuda:0")));     // v moves to cuda:0
  EXPECT_TRUE(b.is_cuda());
  EXPECT_TRUE(node->membrane_potentials()[0].is_cuda());
  expect_close(a, torch::zeros({2, 3}), 0.0, "first step: silent");
  expect_close(b, torch::ones({2, 3}), 0.0, "second step: fires from the carried state");
  // Same as two steps on the CPU.
  mpipe::snn::LIFNode ref;
  ref(x);
  expect_close(b, ref(x), 0.0);
}

// ---------------------------------------------------------------------------
// Neurons in half and bfloat16.

namespace {

/// T steps of `node` on `xs` (one input per step); spikes and the input's gradient.
template <typename Node>
std::pair<torch::Tensor, torch::Tensor> run_neuron(Node node, const torch::Tensor& xs) {
  node->reset_state();
  auto x = xs.detach().clone().requires_grad_();
  std::vector<torch::Tensor> spikes;
  for (int64_t t = 0; t < x.size(0); ++t) spikes.push_back(node(x[t]));
  auto s = torch::stack(spikes);
  const auto weights = torch::linspace(0.5, 1.5, s.numel(), s.options().dtype(torch::kFloat));
  (s.to(torch::kFloat) * weights.view(s.sizes())).sum().backward();
  node->reset_state();
  return {s.detach(), x.grad()};
}

void neurons_in_low_precision(torch::Device device) {
  torch::manual_seed(43);
  const auto xs32 = (torch::rand({12, 256}) * 2).to(device);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const auto xs = xs32.to(dtype);
    for (bool float_membrane : {true, false}) {
      if (!float_membrane && dtype == torch::kHalf && device.is_cpu()) continue;  // ATen: no half CPU
      SCOPED_TRACE(c10::str(dtype, float_membrane ? ", float membrane" : ", membrane in dtype"));
      for (bool lif : {true, false}) {
        std::pair<torch::Tensor, torch::Tensor> fused, aten;
        if (lif) {
          fused = run_neuron(mpipe::snn::LIFNode(
                                 mpipe::snn::LIFNodeOptions().float_membrane(float_membrane)),
                             xs);
          aten = run_neuron(mpipe::snn::LIFNode(mpipe::snn::LIFNodeOptions()
                                                    .fused(false)
                                                    .float_membrane(float_membrane)),
                            xs);
        } else {
          fused = run_neuron(
              mpipe::snn::IFNode(mpipe::snn::IFNodeOptions().float_membrane(float_membrane)), xs);
          aten = run_neuron(mpipe::snn::IFNode(
                                mpipe::snn::IFNodeOptions().fused(false).float_membrane(float_membrane)),
                            xs);
        }
        EXPECT_EQ(fused.first.scalar_type(), dtype) << "spikes in the input's dtype";
        EXPECT_EQ(fused.second.scalar_type(), dtype);
        // Spikes sit on a threshold: rounding may flip a few of 3072.
        const double flips = (fused.first.to(torch::kDouble) - aten.first.to(torch::kDouble))
                                 .abs().sum().item<double>();
        EXPECT_LE(flips, float_membrane ? 2 : 30) << (lif ? "LIF" : "IF");
        EXPECT_GT(fused.first.to(torch::kDouble).sum().item<double>(), 100) << "it fires";
        if (flips == 0) expect_rel(fused.second, aten.second, 2e-2, "input gradient");
      }
      mpipe::snn::LIFNode node(mpipe::snn::LIFNodeOptions().float_membrane(float_membrane));
      node(xs[0]);
      EXPECT_EQ(node->membrane_potentials()[0].scalar_type(),
                float_membrane ? torch::kFloat : dtype);
    }
  }
  // A float membrane makes the bf16 neuron the float32 neuron on the same input.
  const auto xb = xs32.to(torch::kBFloat16);
  const auto low = run_neuron(mpipe::snn::LIFNode(), xb).first;
  const auto full = run_neuron(mpipe::snn::LIFNode(), xb.to(torch::kFloat)).first;
  expect_close(low, full, 0, "bf16 input, float membrane == float32 neuron");
}

}  // namespace

TEST(NeuronPrecision, FusedMatchesTheAtenPathInHalfAndBFloat16) {
  neurons_in_low_precision(torch::kCPU);
}

TEST(NeuronPrecision, FusedMatchesTheAtenPathInHalfAndBFloat16_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  neurons_in_low_precision(torch::Device("cuda:0"));
}

// ParametricLIFNode against SpikingJelly's equations written out here, with
// w = -log(init_tau - 1) learnt: spikes, input gradients and w's gradient, in
// single and multi steps, for both charges and both resets.
TEST(Neurons, ParametricLIFMatchesItsEquationsAndLearnsTau) {
  using mpipe::snn::ParametricLIFNode;
  using mpipe::snn::ParametricLIFNodeOptions;
  torch::manual_seed(8);
  const int64_t T = 10;
  for (bool decay_input : {true, false}) {
    for (std::optional<double> v_reset : {std::optional<double>(0.0), std::optional<double>()}) {
      for (bool multi : {false, true}) {
        for (double init_tau : {2.0, 3.5}) {
          SCOPED_TRACE("decay_input=" + std::to_string(decay_input) + " reset=" +
                       (v_reset ? "hard" : "soft") + " multi=" + std::to_string(multi) +
                       " init_tau=" + std::to_string(init_tau));
          ParametricLIFNode node(ParametricLIFNodeOptions()
                                     .init_tau(init_tau)
                                     .decay_input(decay_input)
                                     .v_reset(v_reset)
                                     .surrogate(Surrogate::atan())
                                     .step_mode(multi ? mpipe::snn::StepMode::Multi
                                                      : mpipe::snn::StepMode::Single));
          node->to(torch::kDouble);
          EXPECT_NEAR(node->tau(), init_tau, 1e-6);  // w starts in float32
          const auto w = torch::randn({T, 3, 5}, torch::kDouble);
          auto weights = torch::arange(1, T + 1, torch::kDouble).view({T, 1, 1});
          // mpipe
          auto x1 = (w * 1.2).requires_grad_();
          torch::Tensor s1;
          if (multi) {
            s1 = node(x1);
          } else {
            std::vector<torch::Tensor> out;
            for (int64_t t = 0; t < T; ++t) out.push_back(node(x1[t]));
            s1 = torch::stack(out);
          }
          (s1 * weights).sum().backward();
          // reference
          auto x2 = (w * 1.2).requires_grad_();
          // w's value as the module holds it (it starts in float32, then to double).
          auto pw = node->w.detach().clone().requires_grad_();
          EXPECT_NEAR(pw.item<double>(), -std::log(init_tau - 1), 1e-7);
          const RefSurrogate sg{RefSurrogate::ATan, 2.0};
          const double vr = v_reset.value_or(0.0);
          torch::Tensor v = torch::full({3, 5}, vr, torch::kDouble);
          std::vector<torch::Tensor> out;
          for (int64_t t = 0; t < T; ++t) {
            v = decay_input ? v + (x2[t] - (v - vr)) * pw.sigmoid() : v - (v - vr) * pw.sigmoid() + x2[t];
            auto spike = sg.spike(v - 1.0);
            v = v_reset ? v * (1 - spike) + vr * spike : v - spike;
            out.push_back(spike);
          }
          auto s2 = torch::stack(out);
          (s2 * weights).sum().backward();
          expect_close(s1, s2, 0.0, "spikes");
          EXPECT_GT(s1.sum().item<double>(), 0.0);
          expect_close(x1.grad(), x2.grad(), 1e-12, "input gradients");
          ASSERT_TRUE(node->w.grad().defined());
          expect_close(node->w.grad(), pw.grad(), 1e-10, "w's gradient");
          EXPECT_NE(pw.grad().item<double>(), 0.0);
        }
      }
    }
  }
  MPIPE_EXPECT_ERROR(ParametricLIFNode(ParametricLIFNodeOptions().init_tau(1.0)),
                     "init_tau must be a finite number > 1", "got 1");
  // A step of gradient descent on w changes tau.
  ParametricLIFNode node;
  torch::optim::SGD opt(node->parameters(), 1.0);
  node(torch::ones({4}) * 1.5).sum().backward();
  opt.step();
  EXPECT_NE(node->tau(), 2.0);
}

// FiringRateMonitor: each neuron's spikes over its elements, through a
// pipeline, not counting recomputations; reset() clears, and the monitor's
// end stops the counting.
TEST(Monitor, FiringRatesPerLayerThroughAPipeline) {
  using mpipe::snn::FiringRateMonitor;
  torch::manual_seed(9);
  const int64_t T = 6, N = 8;
  auto make = [] {
    torch::nn::Linear fc1(12, 16), fc2(16, 4);
    {
      torch::NoGradGuard no_grad;
      fc1->bias.fill_(0.4);
      fc2->bias.fill_(0.3);
    }
    return std::make_pair(torch::nn::Sequential(fc1, LIFNode()), torch::nn::Sequential(fc2, IFNode()));
  };
  auto stages = make();
  for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::Always}) {
    SCOPED_TRACE(checkpoint == mpipe::Checkpoint::Never ? "no checkpoint" : "checkpoint");
    auto pipe = ModelPipeline(ModelPipelineOptions().checkpoint(checkpoint));
    pipe->append(stages.first, "cpu").append(stages.second, "cpu");
    const auto x = torch::rand({N, 12}) * 2;
    FiringRateMonitor monitor(*pipe);
    const auto out = pipe->constant_forward(x, T, /*reduce=*/false);  // [T*N, 4] spikes
    mpipe::reset_states(*pipe);
    auto rates = monitor.rates();
    ASSERT_EQ(rates.size(), 2u);
    EXPECT_EQ(rates[0].name, "stages.0.1");
    EXPECT_EQ(rates[1].name, "stages.1.1");
    // The last layer's rate is its output's mean; the first layer's, that of a plain loop.
    EXPECT_EQ(rates[1].elements, T * N * 4);
    EXPECT_NEAR(rates[1].rate, out.mean().item<double>(), 1e-12);
    torch::Tensor first_spikes = torch::zeros({});
    {
      torch::NoGradGuard no_grad;
      auto fc = stages.first[0];
      LIFNode plain;
      for (int64_t t = 0; t < T; ++t) first_spikes = first_spikes + plain(fc->as<torch::nn::Linear>()->forward(x)).sum();
    }
    EXPECT_EQ(rates[0].elements, T * N * 16);
    EXPECT_NEAR(rates[0].spikes, first_spikes.item<double>(), 1e-9);
    EXPECT_GT(rates[0].rate, 0.05);
    EXPECT_LT(rates[0].rate, 0.95);
    // A training step counts each forward step once, checkpointed or not.
    monitor.reset();
    EXPECT_EQ(monitor.rates()[0].elements, 0);
    pipe->constant_train_step(x, T, torch::rand({N, 4}), mse);
    EXPECT_EQ(monitor.rates()[0].elements, T * N * 16) << "recomputations are not counted";
    EXPECT_NE(monitor.to_string().find("stages.1.1"), std::string::npos);
  }
  // No monitor: nothing counted.
  auto pipe = ModelPipeline();
  pipe->append(stages.first, "cpu").append(stages.second, "cpu");
  { FiringRateMonitor m(*pipe); }
  pipe->constant_forward(torch::rand({N, 12}), T);
  auto* neuron = stages.first[1]->as<mpipe::snn::LIFNodeImpl>();
  ASSERT_NE(neuron, nullptr);
  EXPECT_EQ(neuron->spike_count().second, 0) << "counting stopped with the monitor";
}

// Two monitors on one model: the neuron keeps one count, the newer monitor's.
TEST(Monitor, AnOvertakenMonitorReadsTheNewerOnesCounts) {
  using mpipe::snn::FiringRateMonitor;
  torch::manual_seed(11);
  const int64_t T = 4, N = 6;
  torch::nn::Sequential stage(torch::nn::Linear(8, 10), LIFNode());
  auto pipe = ModelPipeline();
  pipe->append(stage, "cpu");
  const auto x = torch::rand({N, 8}) * 2;
  auto older = std::make_unique<FiringRateMonitor>(*pipe);
  pipe->constant_forward(x, T);
  EXPECT_EQ(older->rates()[0].elements, T * N * 10);
  {
    FiringRateMonitor newer(*pipe);  // takes the neuron over: its count starts afresh
    EXPECT_EQ(older->rates()[0].elements, 0) << "the older monitor reads the newer one's count";
    pipe->constant_forward(x, T);
    EXPECT_EQ(newer.rates()[0].elements, T * N * 10);
    EXPECT_EQ(older->rates()[0].elements, newer.rates()[0].elements);
    EXPECT_EQ(older->rates()[0].spikes, newer.rates()[0].spikes);
    older->reset();  // clears the one count
    EXPECT_EQ(newer.rates()[0].elements, 0);
    older.reset();  // the older monitor's end leaves the neuron counting for the newer one
    pipe->constant_forward(x, T);
    EXPECT_EQ(newer.rates()[0].elements, T * N * 10);
  }
  auto* neuron = stage[1]->as<mpipe::snn::LIFNodeImpl>();
  ASSERT_NE(neuron, nullptr);
  pipe->constant_forward(x, T);
  EXPECT_EQ(neuron->spike_count().second, T * N * 10) << "the newer monitor's end stopped counting";
}

// poisson_encode(x, false): SpikingJelly's rule, any value.
TEST(Encoding, UncheckedPoissonTakesAnyValue) {
  torch::manual_seed(10);
  const auto x = torch::tensor({-0.5, 0.0, 0.3, 1.0, 1.5}).repeat({20000, 1});
  const auto rate = mpipe::snn::poisson_encode(x, /*checked=*/false).mean(0);
  EXPECT_EQ(rate[0].item<double>(), 0.0);
  EXPECT_LT(rate[1].item<double>(), 1e-3);
  EXPECT_NEAR(rate[2].item<double>(), 0.3, 0.02);
  EXPECT_EQ(rate[3].item<double>(), 1.0);
  EXPECT_EQ(rate[4].item<double>(), 1.0);
  MPIPE_EXPECT_ERROR(mpipe::snn::poisson_encode(x), "x must lie in [0, 1]");
  mpipe::snn::PoissonEncoder sj(/*checked=*/false);
  EXPECT_EQ(sj(x).sizes(), x.sizes());
}

// snn::Dropout (SpikingJelly's layer.Dropout): out = x * m / (1 - p), m ~
// Bernoulli(1 - p) drawn once per micro-batch and held until a reset.
TEST(SnnDropout, OneMaskForEveryStepUntilReset) {
  using mpipe::snn::Dropout;
  using mpipe::snn::DropoutOptions;
  using mpipe::snn::StepMode;
  const int64_t N = 8, F = 500;
  const auto ones = torch::ones({N, F}, torch::kDouble);
  torch::manual_seed(21);
  Dropout single(0.5);
  const auto first = single(ones);
  EXPECT_EQ(((first == 0) | (first == 2)).all().item<bool>(), true) << "0 or 1 / (1 - p)";
  EXPECT_NEAR((first == 0).to(torch::kDouble).mean().item<double>(), 0.5, 0.05);
  for (int t = 1; t < 5; ++t) EXPECT_TRUE(torch::equal(single(ones * (t + 1)), first * (t + 1))) << "step " << t;
  ASSERT_EQ(single->masks().size(), 1u);
  EXPECT_TRUE(single->holds_state());
  // A reset draws a new mask.
  EXPECT_EQ(mpipe::reset_states(*single), 1);
  EXPECT_FALSE(single->holds_state());
  EXPECT_FALSE(torch::equal(single(ones), first));
  // Multi-step: the same draw (the mask has the step's shape), on every step of the sequence.
  torch::manual_seed(21);
  Dropout multi(DropoutOptions(0.5).step_mode(StepMode::Multi));
  const auto seq = multi(torch::ones({3, N, F}, torch::kDouble));
  for (int64_t t = 0; t < 3; ++t) EXPECT_TRUE(torch::equal(seq[t], first)) << "step " << t;
  EXPECT_TRUE(torch::equal(multi(torch::ones({2, N, F}, torch::kDouble))[1], first)) << "next chunk";
  // Gradients go through the mask.
  mpipe::reset_states(*multi);
  const auto x = torch::rand({4, N, F}, torch::kDouble).requires_grad_();
  const auto w = torch::rand({4, N, F}, torch::kDouble);
  (multi(x) * w).sum().backward();
  expect_close(x.grad(), w * multi->masks()[0].unsqueeze(0), 0.0, "grad of x");
  // Per micro-batch: each slot its own mask.
  mpipe::reset_states(*multi);
  torch::Tensor mb0, mb1;
  {
    mpipe::MicroBatchGuard g({0, 2});
    mb0 = multi(torch::ones({1, N, F}, torch::kDouble));
  }
  {
    mpipe::MicroBatchGuard g({1, 2});
    mb1 = multi(torch::ones({1, N, F}, torch::kDouble));
  }
  EXPECT_EQ(multi->masks().size(), 2u);
  EXPECT_FALSE(torch::equal(mb0, mb1));
  // set_step_mode reaches it.
  torch::nn::Sequential both(Dropout(0.2), IFNode());
  EXPECT_EQ(mpipe::snn::set_step_mode(*both, StepMode::Multi), 2);
  EXPECT_EQ(both[0]->as<mpipe::snn::DropoutImpl>()->step_mode(), StepMode::Multi);
  // Evaluation mode, p = 0 and p = 1.
  Dropout eval(0.5);
  eval->eval();
  EXPECT_TRUE(torch::equal(eval(ones), ones));
  EXPECT_FALSE(eval->holds_state()) << "evaluation draws no mask";
  EXPECT_TRUE(torch::equal(Dropout(0.0)(ones), ones));
  EXPECT_TRUE(torch::equal(Dropout(1.0)(ones), torch::zeros_like(ones)));
  // Bad input.
  MPIPE_EXPECT_ERROR(Dropout(1.5), "mpipe::snn::Dropout", "p must be in [0, 1]", "1.5");
  MPIPE_EXPECT_ERROR(Dropout(-0.1), "p must be in [0, 1]");
  MPIPE_EXPECT_ERROR(multi(torch::ones({4}, torch::kDouble)), "[T, N, ...] sequence", "[4]");
  MPIPE_EXPECT_ERROR(single(torch::ones({N, 3}, torch::kDouble)), "a step of shape [8, 3]",
                     "steps of shape [8, 500]", "micro-batch 0", "reset_states");
  mpipe::reset_states(*single);
  EXPECT_EQ(single(torch::ones({N, 3}, torch::kDouble)).sizes(), (std::vector<int64_t>{N, 3}))
      << "usable after the error and a reset";
}

// Through a pipeline's training step, for single-step stages and every time
// chunk, micro-batches, threads and checkpointing: the loss and gradients
// equal a plain time loop of each micro-batch that multiplies by the mask the
// pipeline drew (read inside loss_fn, before the step's final reset). A
// checkpointed recompute that drew another mask would fail this.
namespace {
void check_dropout_train_step(const std::string& device) {
  using mpipe::snn::Dropout;
  using mpipe::snn::DropoutImpl;
  using mpipe::snn::DropoutOptions;
  using mpipe::snn::SeqToANN;
  using mpipe::snn::StepMode;
  const int64_t T = 6, N = 6;
  torch::manual_seed(22);
  const auto opts = torch::TensorOptions(torch::Device(device)).dtype(torch::kDouble);
  torch::nn::Linear fc1(8, 16), fc2(16, 4);
  fc1->to(opts.device(), torch::kDouble);
  fc2->to(opts.device(), torch::kDouble);
  const auto x = torch::rand({N, 8}, opts) * 2;
  const auto w = torch::rand({N, 4}, opts);
  const auto neuron = IFNodeOptions().surrogate(Surrogate::atan());
  struct Config {
    int64_t chunk;  // 0: single-step stages
    int64_t micro_batches;
    bool threads;
    mpipe::Checkpoint checkpoint;
  };
  std::vector<Config> configs;
  for (int64_t chunk : {0, 1, 2, 4, 6}) {
    for (int64_t m : {1, 2}) {
      for (bool threads : {true, false}) {
        for (auto c : {mpipe::Checkpoint::Never, mpipe::Checkpoint::Always}) configs.push_back({chunk, m, threads, c});
      }
    }
  }
  int64_t dropped = 0;
  for (const auto& cfg : configs) {
    SCOPED_TRACE("chunk " + std::to_string(cfg.chunk) + " micro-batches " + std::to_string(cfg.micro_batches) +
                 (cfg.threads ? " threaded" : " inline") +
                 (cfg.checkpoint == mpipe::Checkpoint::Always ? " checkpointed" : ""));
    const auto mode = cfg.chunk > 0 ? StepMode::Multi : StepMode::Single;
    Dropout drop(DropoutOptions(0.5).step_mode(mode));
    torch::nn::Sequential s0, s1;
    if (mode == StepMode::Multi) {
      s0 = torch::nn::Sequential(SeqToANN(fc1), drop, IFNode(IFNodeOptions(neuron).step_mode(mode)));
      s1 = torch::nn::Sequential(SeqToANN(fc2), IFNode(IFNodeOptions(neuron).step_mode(mode)));
    } else {
      s0 = torch::nn::Sequential(fc1, drop, IFNode(neuron));
      s1 = torch::nn::Sequential(fc2, IFNode(neuron));
    }
    auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(cfg.threads).checkpoint(cfg.checkpoint));
    pipe->append(s0, device).append(s1, device);
    zero_grads(*pipe);
    torch::Tensor mask;
    auto loss_fn = [&](const torch::Tensor& out, const torch::Tensor&) {
      mask = torch::cat(drop->masks());  // the micro-batches' masks, in row order
      return (out * w).sum();
    };
    std::optional<int64_t> chunk;
    if (cfg.chunk > 0) chunk = cfg.chunk;
    torch::manual_seed(23);
    const auto loss = pipe->constant_train_step(x, T, torch::Tensor(), loss_fn, chunk,
                                                mpipe::Split(mpipe::chunks(cfg.micro_batches)));
    EXPECT_FALSE(drop->holds_state()) << "the step resets the mask";
    ASSERT_EQ(mask.sizes(), (std::vector<int64_t>{N, 16}));
    dropped += (mask == 0).sum().item<int64_t>();
    const auto got = grads_of(*pipe);
    // The plain loop: each micro-batch for T steps, its rows of the mask.
    zero_grads(*pipe);
    torch::Tensor out;
    const int64_t rows = N / cfg.micro_batches;
    for (int64_t m = 0; m < cfg.micro_batches; ++m) {
      IFNode a(neuron), b(neuron);
      const auto xm = x.narrow(0, m * rows, rows);
      const auto mm = mask.narrow(0, m * rows, rows);
      torch::Tensor sum = torch::zeros({rows, 4}, opts);
      for (int64_t t = 0; t < T; ++t) sum = sum + b(fc2(a(fc1(xm) * mm)));
      out = m == 0 ? sum : torch::cat({out, sum});
    }
    const auto want = (out * w).sum();
    want.backward();
    ASSERT_GT(out.sum().item<double>(), 0.0) << "the test should make spikes";
    expect_close(loss, want, 1e-12, "loss");
    expect_same_grads(got, grads_of(*pipe), 1e-12);
  }
  EXPECT_GT(dropped, 0) << "the masks dropped something";
}
}  // namespace

TEST(SnnDropout, TrainStepEqualsAPlainLoopWithTheMaskEverywhere) { check_dropout_train_step("cpu"); }

TEST(SnnDropout, TrainStepEqualsAPlainLoopWithTheMaskEverywhere_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  check_dropout_train_step("cuda:0");
}
