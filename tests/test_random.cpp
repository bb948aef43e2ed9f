// Reproducible random draws (Note [Random draws]): the same seed gives the
// same outputs, losses and gradients for every call kind, threaded or inline,
// with checkpointing, for stochastic stages that share a device.

#include "common.h"

#include <mpipe/snn/poisson_encoder.h>

#include <functional>
#include <string>
#include <vector>

using namespace mpipe;
using namespace mpipe_test;

namespace {

/// Adds noise of its own (randn_like) and a Bernoulli draw: two more kinds of
/// random operators beside Dropout.
struct NoisyImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    if (!is_training()) return x;
    return x + 0.1 * torch::randn_like(x) + 0.1 * torch::bernoulli(torch::full_like(x, 0.5));
  }
};
TORCH_MODULE(Noisy);

/// Everything one call produced: its output (or loss) and the gradients.
struct Result {
  torch::Tensor value;
  std::map<std::string, torch::Tensor> grads;
  torch::Tensor after;  // a draw from the CPU generator after the call
};

void expect_identical(const Result& a, const Result& b, const std::string& what) {
  ASSERT_TRUE(a.value.defined() && b.value.defined()) << what;
  EXPECT_TRUE(torch::equal(a.value.cpu(), b.value.cpu())) << what << ": values differ";
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  for (const auto& kv : a.grads) {
    const torch::Tensor& other = b.grads.at(kv.first);
    ASSERT_EQ(kv.second.defined(), other.defined()) << what << ": grad of " << kv.first;
    if (kv.second.defined()) {
      EXPECT_TRUE(torch::equal(kv.second, other)) << what << ": grad of " << kv.first;
    }
  }
  EXPECT_TRUE(torch::equal(a.after, b.after)) << what << ": the generator ends elsewhere";
}

const int64_t kWidth = 8;

/// `n` stages of Linear + Dropout (+ noise in every other stage), on `devices`.
ModelPipeline stochastic_pipeline(const std::vector<std::string>& devices, bool threaded,
                                  Checkpoint checkpoint) {
  torch::manual_seed(5);  // same weights every time
  auto pipe = ModelPipeline(
      ModelPipelineOptions().worker_threads(threaded).checkpoint(checkpoint));
  for (size_t j = 0; j < devices.size(); ++j) {
    torch::nn::Sequential s(torch::nn::Linear(kWidth, kWidth), torch::nn::Dropout(0.5));
    if (j % 2 == 1) s->push_back(Noisy());
    s->push_back(torch::nn::Tanh());
    pipe->append(s, devices[j]);
  }
  return pipe;
}

using Call = std::function<torch::Tensor(ModelPipelineImpl&, const torch::Tensor&)>;

struct CallKind {
  std::string name;
  bool trains;  // produces gradients
  Call run;
};

std::vector<CallKind> call_kinds() {
  auto mse = [](const torch::Tensor& o, const torch::Tensor& y) { return torch::mse_loss(o, y); };
  std::vector<CallKind> kinds;
  kinds.push_back({"forward", true, [](ModelPipelineImpl& p, const torch::Tensor& x) {
                     torch::Tensor out = p.forward(x, 3);
                     out.pow(2).sum().backward();
                     return out;
                   }});
  kinds.push_back({"constant_forward", true, [](ModelPipelineImpl& p, const torch::Tensor& x) {
                     torch::Tensor out = p.constant_forward(x, 4, /*reduce=*/false);
                     out.pow(2).sum().backward();
                     return out;
                   }});
  kinds.push_back({"sequence_forward", true, [](ModelPipelineImpl& p, const torch::Tensor& x) {
                     torch::Tensor out = p.sequence_forward(x.view({2, -1, kWidth}), false);
                     out.pow(2).sum().backward();
                     return out;
                   }});
  for (Schedule s : all_schedules()) {
    kinds.push_back({"train_step/" + schedule_name(s), true,
                     [s, mse](ModelPipelineImpl& p, const torch::Tensor& x) {
                       const auto n = static_cast<int64_t>(p.size());
                       return p.train_step(x, torch::ones_like(x), mse, schedule_options(s, 3, n));
                     }});
  }
  kinds.push_back({"constant_train_step", true,
                   [mse](ModelPipelineImpl& p, const torch::Tensor& x) {
                     return p.constant_train_step(x, 3, torch::ones_like(x), mse);
                   }});
  kinds.push_back({"forward/no_grad", false, [](ModelPipelineImpl& p, const torch::Tensor& x) {
                     torch::NoGradGuard no_grad;
                     return p.forward(x, 2);
                   }});
  return kinds;
}

/// Zeroes gradients in place: a graphed step keeps its .grad tensors.
void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

Result run_once(ModelPipelineImpl& pipe, const CallKind& kind, const torch::Tensor& x,
                uint64_t seed) {
  clear_grads(pipe);
  torch::manual_seed(seed);
  Result r;
  r.value = kind.run(pipe, x).detach().clone();
  r.grads = grads_of(pipe);
  r.after = torch::rand({4});
  return r;
}

torch::Tensor input_on(const std::string& device) {
  torch::manual_seed(1);
  return torch::randn({10, kWidth}).to(torch::Device(device));
}

/// Runs every call kind `repeats` times with seed 99 in every mode and demands
/// one result per call kind, also across threaded, inline and checkpointing.
void check_reproducible(const std::vector<std::string>& devices, int repeats) {
  const torch::Tensor x = input_on(devices.front());
  for (const auto& kind : call_kinds()) {
    c10::optional<Result> first;
    for (bool threaded : {true, false}) {
      for (Checkpoint c : {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
        if (c != Checkpoint::Never && kind.name.rfind("train_step", 0) != 0) continue;
        auto pipe = stochastic_pipeline(devices, threaded, c);
        const std::string what = kind.name + (threaded ? " threaded" : " inline") +
                                 " checkpoint " + std::to_string(static_cast<int>(c));
        for (int k = 0; k < repeats; ++k) {
          Result r = run_once(*pipe, kind, x, 99);
          if (!first) {
            first = r;
            if (kind.trains) {
              ASSERT_TRUE(first->grads.begin()->second.defined()) << what << ": no gradients";
            }
          } else {
            expect_identical(*first, r, what + " run " + std::to_string(k));
          }
        }
        // Another seed draws other masks: the checks above can fail.
        Result other = run_once(*pipe, kind, x, 100);
        EXPECT_FALSE(torch::equal(first->value.cpu(), other.value.cpu())) << what;
        // No reseed: the next call draws other masks too.
        torch::manual_seed(99);
        Result again = run_once(*pipe, kind, x, 99);
        clear_grads(*pipe);
        torch::Tensor next = kind.run(*pipe, x).detach();
        EXPECT_FALSE(torch::equal(again.value.cpu(), next.cpu())) << what;
      }
    }
  }
}

}  // namespace

TEST(RandomDraws, SameSeedSameResultForEveryCallKindThreadedAndInline) {
  check_reproducible({"cpu", "cpu", "cpu", "cpu"}, 20);
}

TEST(RandomDraws, DropoutIsActiveAndMasksDifferBetweenStagesAndItems) {
  // One stage of Dropout alone on a constant input: each micro-batch's mask
  // is its own, and each stage's.
  auto pipe = ModelPipeline(ModelPipelineOptions());
  pipe->append(torch::nn::Dropout(0.5), "cpu");
  pipe->append(torch::nn::Dropout(0.5), "cpu");
  torch::manual_seed(3);
  const torch::Tensor out = pipe->forward(torch::ones({8, 64}), 4);
  const auto first = out.narrow(0, 0, 4), second = out.narrow(0, 4, 4);
  EXPECT_FALSE(torch::equal(first, second));
  EXPECT_GT((out == 0).sum().item<int64_t>(), 0);   // something dropped
  EXPECT_GT((out == 4).sum().item<int64_t>(), 0);   // something kept (scaled by 2 twice)
  // Evaluation mode draws nothing.
  pipe->eval();
  EXPECT_TRUE(torch::equal(pipe->forward(torch::ones({8, 64}), 4), torch::ones({8, 64})));
}

TEST(RandomDraws, CheckpointedRecomputeDrawsTheForwardsMasks) {
  // Bit-identical gradients with and without checkpointing, threaded: the
  // recompute of each (stage, micro-batch) draws the masks its forward drew.
  const torch::Tensor x = input_on("cpu");
  auto mse = [](const torch::Tensor& o, const torch::Tensor& y) { return torch::mse_loss(o, y); };
  std::map<std::string, torch::Tensor> reference;
  for (Checkpoint c : {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
    for (Schedule s : all_schedules()) {
      auto pipe = stochastic_pipeline({"cpu", "cpu", "cpu"}, true, c);
      torch::manual_seed(7);
      pipe->train_step(x, torch::zeros_like(x), mse, schedule_options(s, 2, 3));
      if (reference.empty()) {
        reference = grads_of(*pipe);
      } else {
        expect_same_grads(reference, grads_of(*pipe), 0.0);
      }
    }
  }
}

TEST(RandomDraws, PoissonEncoderStageIsReproducible) {
  auto make = [](bool threaded) {
    auto pipe = ModelPipeline(ModelPipelineOptions().worker_threads(threaded));
    pipe->append(mpipe::snn::PoissonEncoder(), "cpu");
    pipe->append(torch::nn::Dropout(0.3), "cpu");
    return pipe;
  };
  const torch::Tensor x = torch::rand({6, 16});
  auto threaded = make(true), inline_ = make(false);
  torch::manual_seed(4);
  const torch::Tensor a = threaded->constant_forward(x, 8, false);
  torch::manual_seed(4);
  const torch::Tensor b = inline_->constant_forward(x, 8, false);
  EXPECT_TRUE(torch::equal(a, b));
  // Spikes differ between time steps: each step draws its own.
  EXPECT_FALSE(torch::equal(a.narrow(0, 0, 6), a.narrow(0, 6, 6)));
}

TEST(RandomDraws, SameSeedSameResultOnOneGpu_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  check_reproducible({"cuda:0", "cuda:0", "cuda:0", "cuda:0"}, 20);
  check_reproducible({"cpu", "cuda:0", "cuda:0", "cpu"}, 5);
}

TEST(RandomDraws, GraphedReplaysDrawTheSameForTheSameSeed_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  auto pipe = stochastic_pipeline({"cuda:0", "cuda:0", "cuda:0"}, true, Checkpoint::Never);
  pipe->options.cuda_graphs(true);
  const torch::Tensor x = input_on("cuda:0");
  auto mse = [](const torch::Tensor& o, const torch::Tensor& y) { return torch::mse_loss(o, y); };
  CallKind forward{"graphed forward", false, [](ModelPipelineImpl& p, const torch::Tensor& in) {
                     torch::NoGradGuard no_grad;
                     return p.forward(in, 5);
                   }};
  CallKind step{"graphed train_step", true, [mse](ModelPipelineImpl& p, const torch::Tensor& in) {
                  return p.train_step(in, torch::ones_like(in), mse, TrainStepOptions(5));
                }};
  for (const auto& kind : {forward, step}) {
    const size_t graphs_before = pipe->cuda_graphs_captured();
    Result first = run_once(*pipe, kind, x, 99);
    for (int k = 0; k < 20; ++k) expect_identical(first, run_once(*pipe, kind, x, 99), kind.name);
    EXPECT_EQ(pipe->cuda_graphs_captured(), graphs_before + 1) << kind.name << " was not graphed";
    // Replays draw new masks when not reseeded, and other masks for another seed.
    torch::manual_seed(99);
    Result a = run_once(*pipe, kind, x, 99);
    torch::Tensor next = kind.run(*pipe, x).detach();
    EXPECT_FALSE(torch::equal(a.value, next)) << kind.name;
    EXPECT_FALSE(torch::equal(first.value, run_once(*pipe, kind, x, 100).value)) << kind.name;
  }
}
