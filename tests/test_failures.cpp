// Failures: what a failed call leaves (DeferredBatchNorm statistics, state,
// gradients) and how the pipeline recovers, and systematic fault injection at
// every stage, position and phase of every call kind, eager and graphed.
// What building many pipelines leaves behind is in test_lifetime.cpp.

#include "common.h"

#include <mpipe/snn.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

using namespace mpipe_test;
using mpipe::Checkpoint;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Schedule;
using mpipe::TrainStepOptions;
namespace snn = mpipe::snn;

namespace {

/// Aborts the test binary (so that CI fails instead of hanging) when a case
/// has not finished within its deadline.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds limit) : limit_(limit), thread_([this] { loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  /// A new case starts: its deadline is `limit` from now.
  void kick(std::string what) {
    std::lock_guard<std::mutex> lock(mutex_);
    what_ = std::move(what);
    deadline_ = std::chrono::steady_clock::now() + limit_;
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    deadline_ = std::chrono::steady_clock::now() + limit_;
    while (!stop_) {
      if (cv_.wait_until(lock, deadline_, [this] { return stop_; })) return;
      if (std::chrono::steady_clock::now() >= deadline_) {
        std::fprintf(stderr, "watchdog: '%s' did not finish in %lld s; aborting\n", what_.c_str(),
                     static_cast<long long>(limit_.count()));
        std::abort();
      }
    }
  }
  std::chrono::seconds limit_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::string what_ = "start";
  std::chrono::steady_clock::time_point deadline_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

enum class Phase { None, Forward, Backward, Recompute };

const char* phase_name(Phase p) {
  return p == Phase::Forward ? "forward" : p == Phase::Backward ? "backward" : "recompute";
}

/// Whether item `at` of `n` is recomputed in backward under `mode`, as
/// Checkpoint documents it (ExceptLast: every micro-batch but the last).
bool recomputed(Checkpoint mode, int64_t at, int64_t n) {
  return mode == Checkpoint::Always || (mode == Checkpoint::ExceptLast && at + 1 < n);
}

/// Linear + tanh that throws when armed: in the forward, the backward or the
/// recompute of one position (a micro-batch, or a time step counted by calls).
struct FaultImpl : torch::nn::Module {
  explicit FaultImpl(int64_t width) { fc = register_module("fc", torch::nn::Linear(width, width)); }
  torch::Tensor forward(const torch::Tensor& x) {
    const bool recomputing = mpipe::is_recomputing();
    const int64_t pos = by_time_step ? calls++ : mpipe::current_micro_batch().index;
    const bool here = pos == at;
    TORCH_CHECK(!(here && phase == Phase::Forward && !recomputing), "planted fault");
    TORCH_CHECK(!(here && phase == Phase::Recompute && recomputing), "planted fault");
    torch::Tensor y = torch::tanh(fc(x));
    if (here && phase == Phase::Backward && y.requires_grad()) {
      y.register_hook([](torch::Tensor g) -> torch::Tensor {
        TORCH_CHECK(false, "planted fault");
        return g;
      });
    }
    return y;
  }
  torch::nn::Linear fc{nullptr};
  Phase phase = Phase::None;
  int64_t at = -1;
  bool by_time_step = false;
  int64_t calls = 0;
};
TORCH_MODULE(Fault);

/// Three stages, each a Fault followed by a stateful module: a user's Leaky,
/// a DeferredBatchNorm, an LIF neuron (all in double).
struct Model {
  std::vector<torch::nn::Sequential> stages;
  std::vector<Fault> faults;
  Leaky leaky{nullptr};
  mpipe::DeferredBatchNorm bn{nullptr};
  snn::LIFNode lif{nullptr};

  explicit Model(int64_t width) {
    torch::manual_seed(5);
    faults = {Fault(width), Fault(width), Fault(width)};
    leaky = Leaky(width, 0.6);
    bn = mpipe::DeferredBatchNorm(width);
    lif = snn::LIFNode(snn::LIFNodeOptions().v_threshold(0.3));
    stages = {torch::nn::Sequential(faults[0], leaky), torch::nn::Sequential(faults[1], bn),
              torch::nn::Sequential(faults[2], lif)};
    for (auto& s : stages) s->to(torch::kDouble);
  }
  ModelPipeline pipeline(bool threads, Checkpoint checkpoint) const {
    ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads).checkpoint(checkpoint));
    for (const auto& s : stages) pipe->append(s, "cpu");
    return pipe;
  }
  void arm(int64_t stage, Phase phase, int64_t at, bool by_time_step) {
    for (auto& f : faults) {
      f->phase = Phase::None;
      f->calls = 0;
      f->by_time_step = by_time_step;
    }
    faults[static_cast<size_t>(stage)]->phase = phase;
    faults[static_cast<size_t>(stage)]->at = at;
  }
  void disarm(bool by_time_step) { arm(0, Phase::None, -1, by_time_step); }
  /// Every piece of state, cloned.
  std::vector<torch::Tensor> state() const {
    std::vector<torch::Tensor> out;
    for (const auto& v : leaky->state.slots()) out.push_back(v.defined() ? v.clone() : v);
    for (const auto& v : lif->membrane_potentials()) out.push_back(v.defined() ? v.clone() : v);
    out.push_back(bn->running_mean.clone());
    out.push_back(bn->running_var.clone());
    out.push_back(bn->num_batches_tracked.clone());
    out.push_back(torch::tensor(bn->holds_state() ? 1 : 0));
    return out;
  }
};

void expect_same_state(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what << ": number of state tensors";
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << what << ": state " << i;
    if (a[i].defined()) expect_close(a[i], b[i], 0.0, what + ": state " + std::to_string(i));
  }
}

/// One call of a kind: returns its result (output or loss); for forward-type
/// calls also backpropagates sum(out^2), so every call leaves gradients.
struct CallKind {
  std::string name;
  bool by_time_step;   // positions are time steps (counted by calls)
  int64_t n_items;     // positions
  bool has_backward;   // mpipe runs the backward (a training step)
  Schedule schedule = Schedule::GPipe;
  std::function<torch::Tensor(ModelPipeline&)> run;
  std::function<void(ModelPipeline&)> warm;  // puts state in place for this kind
};

std::vector<CallKind> call_kinds() {
  const int64_t batch = 6, width = 4, split = 2, T = 3;
  torch::manual_seed(6);
  const auto x = torch::randn({batch, width}, torch::kDouble);
  const auto x_seq = torch::randn({T, batch, width}, torch::kDouble);
  const auto target = torch::rand({batch, width}, torch::kDouble);
  auto warm_micro = [x](ModelPipeline& p) {
    torch::NoGradGuard no_grad;
    p->forward(x * 0.5, split);
  };
  auto warm_time = [x](ModelPipeline& p) {
    torch::NoGradGuard no_grad;
    p->constant_forward(x * 0.5, 1);
  };
  std::vector<CallKind> kinds;
  kinds.push_back({"forward", false, batch / split, false, Schedule::GPipe,
                   [=](ModelPipeline& p) {
                     auto y = p->forward(x, split);
                     y.pow(2).sum().backward();
                     return y;
                   },
                   warm_micro});
  kinds.push_back({"constant_forward", true, T, false, Schedule::GPipe,
                   [=](ModelPipeline& p) {
                     auto y = p->constant_forward(x, T);
                     y.pow(2).sum().backward();
                     return y;
                   },
                   warm_time});
  kinds.push_back({"sequence_forward", true, T, false, Schedule::GPipe,
                   [=](ModelPipeline& p) {
                     auto y = p->sequence_forward(x_seq);
                     y.pow(2).sum().backward();
                     return y;
                   },
                   warm_time});
  for (auto schedule : all_schedules()) {
    // 3 stages: no V (their failures: ZB-H1's path)
    if (schedule == Schedule::ZeroBubbleV || schedule == Schedule::DualPipeV) continue;
    kinds.push_back({"train_step(" + schedule_name(schedule) + ")", false,
                     batch / split, true, schedule,
                     [=](ModelPipeline& p) {
                       return p->train_step(x, target, mse, schedule_options(schedule, split, 3));
                     },
                     warm_micro});
  }
  kinds.push_back({"constant_train_step", true, T, true, Schedule::GPipe,
                   [=](ModelPipeline& p) { return p->constant_train_step(x, T, target, mse); },
                   warm_time});
  // One item: one forward and one backward per stage.
  kinds.push_back({"constant_train_step of one step", true, 1, true, Schedule::GPipe,
                   [=](ModelPipeline& p) { return p->constant_train_step(x, 1, target, mse); },
                   warm_time});
  return kinds;
}

}  // namespace

TEST(Failures, DeferredBatchNormCommitsNothingAndStateIsRolledBack) {
  // Stage 2 fails after stage 1's DeferredBatchNorm has seen (and, at the last
  // micro-batch, committed) every micro-batch.
  struct Net {
    mpipe::DeferredBatchNorm bn{3};
    Leaky leaky{3, 0.5};
    Failing failing{-1};
    ModelPipeline pipe;
    Net(bool threads, Checkpoint checkpoint)
        : pipe(ModelPipelineOptions().worker_threads(threads).checkpoint(checkpoint)) {
      pipe->append(torch::nn::Sequential(torch::nn::Linear(3, 3), leaky), "cpu")
          .append(bn, "cpu")
          .append(failing, "cpu");
    }
  };
  torch::manual_seed(45);
  const auto x = torch::randn({8, 3}) * 3 + 1, y = torch::randn({8, 3});
  for (auto checkpoint : {Checkpoint::Never, Checkpoint::Always}) {
    for (bool threads : {true, false}) {
      torch::manual_seed(44);
      Net net(threads, checkpoint);
      torch::manual_seed(44);
      Net twin(threads, checkpoint);  // never fails
      for (Net* n : {&net, &twin}) {
        torch::NoGradGuard no_grad;  // state in the Leaky; bn commits once
        n->pipe->forward(x, 2);
      }
      const auto mean = net.bn->running_mean.clone(), var = net.bn->running_var.clone();
      const auto tracked = net.bn->num_batches_tracked.item<int64_t>();
      const auto leaky_state = net.leaky->state.slots();
      net.failing->calls = 0;
      net.failing->fail_at = 3;  // micro-batch 3 of the step
      MPIPE_EXPECT_ERROR(net.pipe->train_step(x, y, mse, 2), "stage 2", "micro-batch 3 of 4",
                         "planted failure");
      net.failing->fail_at = -1;
      expect_close(net.bn->running_mean, mean, 0.0, "running_mean after a failed step");
      expect_close(net.bn->running_var, var, 0.0, "running_var after a failed step");
      EXPECT_EQ(net.bn->num_batches_tracked.item<int64_t>(), tracked);
      EXPECT_FALSE(net.bn->holds_state()) << "no partial statistics survive";
      ASSERT_EQ(net.leaky->state.slots().size(), leaky_state.size());
      for (size_t i = 0; i < leaky_state.size(); ++i) {
        EXPECT_TRUE(net.leaky->state.slots()[i].is_same(leaky_state[i])) << "Leaky slot " << i;
      }
      // The next step commits what the twin's first step commits.
      net.pipe->train_step(x, y, mse, 2);
      twin.pipe->train_step(x, y, mse, 2);
      expect_close(net.bn->running_mean, twin.bn->running_mean, 0.0, "running_mean after");
      expect_close(net.bn->running_var, twin.bn->running_var, 0.0, "running_var after");
      EXPECT_EQ(net.bn->num_batches_tracked.item<int64_t>(), tracked + 1);
    }
  }
}

TEST(Failures, GradientsArePartialAndZeroingRecovers) {
  // What a failed train_step leaves in .grad is unspecified (the backwards
  // that ran have accumulated); zero_grad() and a new step give exact
  // gradients, with no trace of the failure.
  torch::manual_seed(45);
  auto stages = std::vector<torch::nn::Sequential>{mlp_stage(3, 3), mlp_stage(3, 3)};
  auto pipe = ModelPipeline();
  for (auto& s : stages) pipe->append(s, "cpu");
  const auto x = torch::randn({4, 3}), y = torch::randn({4, 3});
  auto failing_loss = [](const torch::Tensor& o, const torch::Tensor& t) {
    auto out = o * 1;
    out.register_hook([](torch::Tensor g) -> torch::Tensor {
      TORCH_CHECK(false, "planted backward failure");
      return g;
    });
    return mse(out, t);
  };
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, failing_loss, 1), "backward of micro-batch");
  pipe->zero_grad();
  const auto loss = pipe->train_step(x, y, mse, 1);
  const auto grads = grads_of(*pipe);
  zero_grads(*pipe);
  auto plain = mse(plain_forward(stages, {torch::kCPU, torch::kCPU}, x), y);
  plain.backward();
  expect_close(loss, plain, 1e-6, "loss");
  expect_same_grads(grads, grads_of(*pipe), 1e-6);
}

// Fault injection: a stage throws at every stage, position and phase of every
// call kind, schedule, checkpoint mode, threaded and inline. Each time the
// error names the stage and the position, nothing hangs (watchdog), the state
// is as before the call, and the next call equals that of a pipeline that
// never failed.
TEST(Failures, EveryStagePositionAndPhase) {
  Watchdog watchdog(std::chrono::seconds(60));
  int cases = 0;
  for (bool threads : {true, false}) {
    for (auto checkpoint : {Checkpoint::Never, Checkpoint::ExceptLast, Checkpoint::Always}) {
      for (const auto& kind : call_kinds()) {
        if (!kind.has_backward && checkpoint != Checkpoint::Never) continue;  // no effect there
        const bool constant_step = kind.name.rfind("constant_train_step", 0) == 0;
        if (constant_step && checkpoint != Checkpoint::Never) continue;
        Model model(4), reference(4);
        auto pipe = model.pipeline(threads, checkpoint);
        auto ref = reference.pipeline(threads, checkpoint);
        std::vector<Phase> phases{Phase::Forward};
        if (kind.has_backward) phases.push_back(Phase::Backward);
        if (kind.has_backward && checkpoint != Checkpoint::Never) phases.push_back(Phase::Recompute);
        for (int64_t stage = 0; stage < 3; ++stage) {
          for (int64_t at = 0; at < kind.n_items; ++at) {
            for (Phase phase : phases) {
              if (phase == Phase::Recompute && !recomputed(checkpoint, at, kind.n_items)) {
                continue;
              }
              const std::string what = kind.name + (threads ? " threaded" : " inline") +
                                       " checkpoint " +
                                       std::to_string(static_cast<int>(checkpoint)) + ": stage " +
                                       std::to_string(stage) + ", " + phase_name(phase) + " at " +
                                       std::to_string(at);
              SCOPED_TRACE(what);
              watchdog.kick(what);
              ++cases;
              mpipe::reset_states(*pipe);
              mpipe::reset_states(*ref);
              model.disarm(kind.by_time_step);
              reference.disarm(kind.by_time_step);
              kind.warm(pipe);
              kind.warm(ref);
              zero_grads(*pipe);
              zero_grads(*ref);
              const auto before = model.state();
              model.arm(stage, phase, at, kind.by_time_step);
              const std::string item = kind.by_time_step ? "time step " : "micro-batch ";
              const std::string position = item + std::to_string(at) + " of " +
                                           std::to_string(kind.n_items);
              if (constant_step && phase == Phase::Backward) {
                MPIPE_EXPECT_ERROR(kind.run(pipe), "constant_train_step",
                                   "stage " + std::to_string(stage),
                                   "backward of " + position, "planted fault");
              } else if (kind.has_backward && !constant_step) {
                // A split backward fails in I, or in W where I had no input
                // gradient to compute (stage 0: the input needs none); Auto
                // and Tailored name whichever they chose.
                std::string described = std::string(phase_name(phase)) + " of " + position;
                if (phase == Phase::Backward && kind.schedule == Schedule::ZeroBubbleH1) {
                  described = (stage == 0 ? "weight gradient of " : "input gradient of ") + position;
                } else if (phase == Phase::Backward && (kind.schedule == Schedule::Auto ||
                                                        kind.schedule == Schedule::Tailored)) {
                  described = position;
                }
                MPIPE_EXPECT_ERROR(kind.run(pipe), "stage " + std::to_string(stage), described,
                                   "planted fault");
              } else {
                MPIPE_EXPECT_ERROR(kind.run(pipe), "stage " + std::to_string(stage), position,
                                   "planted fault");
              }
              model.disarm(kind.by_time_step);
              reference.disarm(kind.by_time_step);
              expect_same_state(model.state(), before, "state after the failed call");
              zero_grads(*pipe);
              const auto out = kind.run(pipe);
              const auto out_ref = kind.run(ref);
              expect_close(out, out_ref, 0.0, "result of the next call");
              expect_same_grads(grads_of(*pipe), grads_of(*ref), 0.0);
              expect_same_state(model.state(), reference.state(), "state after the next call");
              if (::testing::Test::HasFailure()) return;  // one case's report is enough
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 300);
  std::printf("fault injection: %d cases\n", cases);
}

// Graphed calls run user code only while a shape is new: a no-grad forward
// warms up and captures at its first sight, a training step warms up at the
// first and captures at the second; a replay cannot fail in a stage. A fault in the
// warm-up or the capture is named like an eager one, and later calls (eager
// or replayed) equal those of a pipeline that never used graphs.
TEST(Failures, GraphedCallsFailingInWarmUpOrCapture_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device g("cuda:0");
  Watchdog watchdog(std::chrono::seconds(120));
  auto make = [&](bool graphs, std::vector<Fault>& faults) {
    torch::manual_seed(7);
    faults = {Fault(8), Fault(8), Fault(8)};
    ModelPipeline p(ModelPipelineOptions().cuda_graphs(graphs));
    for (auto& f : faults) p->append(f, g);
    return p;
  };
  torch::manual_seed(8);
  const auto x = torch::randn({8, 8}, g), y = torch::randn({8, 8}, g);
  int cases = 0;
  for (bool train : {false, true}) {
    const std::vector<Phase> phases =
        train ? std::vector<Phase>{Phase::Forward, Phase::Backward} : std::vector<Phase>{Phase::Forward};
    for (int sight = 0; sight < (train ? 2 : 1); ++sight) {
      for (int64_t stage = 0; stage < 3; ++stage) {
        for (int64_t at : {0, 3}) {
          for (Phase phase : phases) {
            const std::string what = std::string(train ? "train_step" : "forward") + ", sight " +
                                     std::to_string(sight) + ", stage " + std::to_string(stage) +
                                     ", " + phase_name(phase) + " at " + std::to_string(at);
            SCOPED_TRACE(what);
            watchdog.kick(what);
            ++cases;
            std::vector<Fault> fg, fe;
            auto graphed = make(true, fg);
            auto eager = make(false, fe);
            auto call = [&](ModelPipeline& p) {
              if (train) return p->train_step(x, y, mse, TrainStepOptions(2));
              torch::NoGradGuard no_grad;
              return p->forward(x, 2);
            };
            for (int i = 0; i < sight; ++i) {
              call(graphed);
              call(eager);
            }
            fg[static_cast<size_t>(stage)]->phase = phase;
            fg[static_cast<size_t>(stage)]->at = at;
            const std::string position = "micro-batch " + std::to_string(at) + " of 4";
            MPIPE_EXPECT_ERROR(call(graphed), "stage " + std::to_string(stage),
                               train ? std::string(phase_name(phase)) + " of " + position : position,
                               "planted fault");
            fg[static_cast<size_t>(stage)]->phase = Phase::None;
            for (int i = 0; i < 3; ++i) {
              zero_grads(*graphed);
              zero_grads(*eager);
              expect_close(call(graphed), call(eager), 1e-5, "call " + std::to_string(i) + " after");
              expect_same_grads(grads_of(*graphed), grads_of(*eager), 1e-5);
            }
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
  std::printf("graphed fault injection: %d cases\n", cases);
}

namespace {
/// Changes its input in place while `in_place` (README, Restrictions).
struct InPlaceReluImpl : torch::nn::Module {
  InPlaceReluImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(torch::Tensor x) { return fc(in_place ? x.relu_() : x.relu()); }
  torch::nn::Linear fc{nullptr};
  bool in_place = true;
};
TORCH_MODULE(InPlaceRelu);
}  // namespace

// A stage after the first gets its input in a training step as a leaf that
// requires grad: an in-place change to it is autograd's error, named by the
// stage, in train_step and in constant_train_step (one item or several); the
// pipeline works again once the stage stops doing it.
TEST(Failures, InPlaceChangesToAStagesInputAreNamedByTheStage) {
  torch::manual_seed(3);
  torch::nn::Linear first(4, 4);
  InPlaceRelu second;
  ModelPipeline pipe;
  pipe->append(torch::nn::Sequential(first), "cpu");
  pipe->append(torch::nn::Sequential(second), "cpu");
  const auto x = torch::randn({6, 4});
  const auto y = torch::randn({6, 4});
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, 2), "stage 1", "forward of micro-batch 0",
                     "in-place operation");
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 1, y, mse), "stage 1", "time step 0 of 1",
                     "in-place operation");
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 3, y, mse), "stage 1", "time step 0 of 3",
                     "in-place operation");
  second->in_place = false;
  pipe->zero_grad();
  const auto loss = pipe->train_step(x, y, mse, 6);  // one micro-batch: the plain model's loss
  const auto plain = mse(second(first(x)), y);
  expect_close(loss, plain, 0.0, "loss after the stage stopped changing its input");
}
