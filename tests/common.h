#pragma once

// Shared helpers for mpipe's tests: small models, plain (unpipelined)
// references, and gradient snapshots.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mpipe/mpipe.h>

#include <ftw.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace mpipe_test {

/// Skips the test unless `n` CUDA devices are visible.
#define MPIPE_REQUIRE_CUDA(n)                                                        \
  do {                                                                                \
    if (static_cast<int64_t>(torch::cuda::device_count()) < (n))                                             \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), "                          \
                   << static_cast<int64_t>(torch::cuda::device_count()) << " visible";                       \
  } while (0)

/// A stage of Linear + Tanh layers (smooth, so gradients are informative).
inline torch::nn::Sequential mlp_stage(int64_t in, int64_t out, int64_t layers = 2) {
  torch::nn::Sequential seq;
  for (int64_t l = 0; l < layers; ++l) {
    seq->push_back(torch::nn::Linear(l == 0 ? in : out, out));
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

/// A stateful stage written as a user would: a leaky accumulator
/// v = decay * v + W x, output tanh(v). Its state is kept per micro-batch
/// (mpipe::PerMicroBatch) and cleared by mpipe::reset_states.
struct LeakyImpl : torch::nn::Module, mpipe::Stateful {
  explicit LeakyImpl(int64_t width, double decay = 0.5) : decay(decay) {
    fc = register_module("fc", torch::nn::Linear(width, width));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    torch::Tensor h = fc(x);
    torch::Tensor& v = state.get();
    v = v.defined() ? v * decay + h : h;
    return torch::tanh(v);
  }
  void reset_state() override { state.clear(); }
  // forward assigns a new tensor to the slot, so the slots' handles are a
  // snapshot (Note [State snapshots]).
  bool supports_state_snapshots() const override { return snapshots; }
  std::any save_state() const override { return state.save(); }
  void load_state(const std::any& s) override { state.load(s); }
  torch::nn::Linear fc{nullptr};
  double decay;
  mpipe::PerMicroBatch<torch::Tensor> state;
  int64_t calls = 0;
  bool snapshots = true;  // false: a user module that cannot save its state
};
TORCH_MODULE(Leaky);

/// Records the first value of every input it sees, then passes it on.
struct RecorderImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    seen.push_back(x.reshape(-1)[0].item<double>());
    return x;
  }
  std::vector<double> seen;
};
TORCH_MODULE(Recorder);

/// Throws when it sees its `fail_at`-th call (counting from 0) since reset.
struct FailingImpl : torch::nn::Module {
  explicit FailingImpl(int64_t fail_at) : fail_at(fail_at) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (calls++ == fail_at) TORCH_CHECK(false, "planted failure");
    return x * 2;
  }
  int64_t fail_at;
  int64_t calls = 0;
};
TORCH_MODULE(Failing);

/// Runs `modules` one after another on the whole batch, moving the activation
/// to each stage's device, as a user would without mpipe.
template <typename Modules>
torch::Tensor plain_forward(Modules modules, const std::vector<torch::Device>& devices,
                            torch::Tensor x) {
  for (size_t i = 0; i < modules.size(); ++i) x = modules[i]->forward(x.to(devices[i]));
  return x;
}

/// Gradients of every parameter, by name, copied to the CPU.
inline std::map<std::string, torch::Tensor> grads_of(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out[p.key()] = p.value().grad().defined() ? p.value().grad().detach().cpu().clone()
                                             : torch::Tensor();
  }
  return out;
}

inline void zero_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
  }
}

inline void expect_close(const torch::Tensor& a, const torch::Tensor& b, double tol = 1e-10,
                         const std::string& what = "") {
  ASSERT_TRUE(a.defined()) << what;
  ASSERT_TRUE(b.defined()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double diff = (a.cpu().to(torch::kDouble) - b.cpu().to(torch::kDouble)).abs().max()
                          .item<double>();
  EXPECT_LE(diff, tol) << what << ": max |a - b| = " << diff;
}

/// Removes `path` and everything under it. Not std::filesystem::remove_all:
/// LibTorch 2.x's libtorch.so exports a copy of it that crashes (Note
/// [Removing a checkpoint] in mpipe/detail/pipeline/job_checkpoints-inl.h).
inline void remove_tree(const std::string& path) {
  ::nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
         16, FTW_DEPTH | FTW_PHYS);
}

/// The most activations any worker of `programs` holds at once.
inline double max_peak(const std::vector<mpipe::schedules::Program>& programs) {
  double peak = 0;
  for (const auto& p : programs) peak = std::max(peak, mpipe::schedules::peak_activations(p));
  return peak;
}

/// The tests' usual loss: mean squared error.
inline torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::mse_loss(out, target);
}

/// |a - b| <= rtol * max(1, max |b|), both converted to double.
inline void expect_rel(const torch::Tensor& a, const torch::Tensor& b, double rtol,
                       const std::string& what) {
  ASSERT_TRUE(a.defined() && b.defined()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const auto da = a.detach().cpu().to(torch::kDouble), db = b.detach().cpu().to(torch::kDouble);
  const double scale = std::max(1.0, db.abs().max().item<double>());
  const double diff = (da - db).abs().max().item<double>();
  EXPECT_LE(diff, rtol * scale) << what << ": max |a - b| = " << diff << ", scale " << scale;
}

inline void expect_same_grads(const std::map<std::string, torch::Tensor>& a,
                              const std::map<std::string, torch::Tensor>& b,
                              double tol = 1e-10) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& kv : a) {
    auto it = b.find(kv.first);
    ASSERT_NE(it, b.end()) << kv.first;
    // No gradient on both sides (an unused or frozen parameter) is the same.
    EXPECT_EQ(kv.second.defined(), it->second.defined()) << "grad of " << kv.first;
    if (!kv.second.defined() || !it->second.defined()) continue;
    expect_close(kv.second, it->second, tol, "grad of " + kv.first);
  }
}

/// The transparency check: runs `through_pipeline` and `plain` on separate
/// copies of `x`, backpropagates sum(y^2) through each, and expects equal
/// outputs, gradients of x, and gradients of every parameter of `model`.
template <typename PipeFn, typename PlainFn>
void expect_transparent(torch::nn::Module& model, const torch::Tensor& x,
                        PipeFn through_pipeline, PlainFn plain, double tol = 1e-12) {
  auto x1 = x.detach().clone().requires_grad_();
  torch::Tensor y1 = through_pipeline(x1);
  y1.pow(2).sum().backward();
  auto pipe_grads = grads_of(model);
  zero_grads(model);

  auto x2 = x.detach().clone().requires_grad_();
  torch::Tensor y2 = plain(x2);
  y2.pow(2).sum().backward();
  expect_close(y1, y2, tol, "output");
  expect_close(x1.grad(), x2.grad(), tol, "grad of x");
  expect_same_grads(pipe_grads, grads_of(model), tol);
  zero_grads(model);
}

/// train_step's transparency: one training step through `pipe` and the loss
/// of the plain model on a copy of `x`, backpropagated, give equal losses,
/// gradients of x and gradients of every parameter.
template <typename Modules>
void expect_train_step_transparent(mpipe::ModelPipeline& pipe, Modules stages,
                                   const std::vector<torch::Device>& devices,
                                   const torch::Tensor& x, const torch::Tensor& target,
                                   const mpipe::LossFunction& loss_fn,
                                   const mpipe::TrainStepOptions& step, double tol = 1e-12) {
  auto x1 = x.detach().clone().requires_grad_();
  auto loss = pipe->train_step(x1, target, loss_fn, step);
  EXPECT_FALSE(loss.requires_grad());
  auto pipe_grads = grads_of(*pipe);
  zero_grads(*pipe);

  auto x2 = x.detach().clone().requires_grad_();
  auto loss2 = loss_fn(plain_forward(stages, devices, x2), target);
  loss2.backward();
  expect_close(loss, loss2, tol, "loss");
  expect_close(x1.grad(), x2.grad(), tol, "grad of x");
  expect_same_grads(pipe_grads, grads_of(*pipe), tol);
  zero_grads(*pipe);
}

/// `options`' step is bit for bit GPipe's (same split): each stage adds its
/// micro-batches' gradients in the same order. Loss, the input's gradient
/// and every parameter's gradient compared exactly; gradients zeroed after.
inline void expect_gpipes_step(mpipe::ModelPipeline& pipe, const torch::Tensor& x,
                               const torch::Tensor& y, const mpipe::TrainStepOptions& options) {
  auto x1 = x.clone().requires_grad_(), x2 = x.clone().requires_grad_();
  const auto l1 = pipe->train_step(x1, y, mse, mpipe::TrainStepOptions(options.split()));
  const auto g1 = grads_of(*pipe);
  zero_grads(*pipe);
  const auto l2 = pipe->train_step(x2, y, mse, options);
  const auto g2 = grads_of(*pipe);
  zero_grads(*pipe);
  EXPECT_TRUE(torch::equal(l1, l2));
  EXPECT_TRUE(torch::equal(x1.grad(), x2.grad()));
  ASSERT_EQ(g1.size(), g2.size());
  for (const auto& g : g1) EXPECT_TRUE(torch::equal(g.second, g2.at(g.first))) << g.first;
}

/// Every schedule train_step offers (ZeroBubbleV and DualPipeV need an even
/// stage count: schedule_options gives an odd one ZB-H1 instead).
inline std::vector<mpipe::Schedule> all_schedules() {
  return {mpipe::Schedule::GPipe,        mpipe::Schedule::OneFOneB,
          mpipe::Schedule::Interleaved1F1B, mpipe::Schedule::ZeroBubbleH1,
          mpipe::Schedule::ZeroBubbleV,  mpipe::Schedule::DualPipeV,
          mpipe::Schedule::Tailored,     mpipe::Schedule::Auto};
}

/// TrainStepOptions for `schedule` on n_stages stages: Interleaved1F1B and
/// Auto get 2 chunks per worker when n_stages is even, else every stage on
/// one worker; ZeroBubbleV and DualPipeV on an odd count are ZeroBubbleH1; Tailored gets
/// uneven stage costs.
inline mpipe::TrainStepOptions schedule_options(mpipe::Schedule schedule, int64_t split,
                                                int64_t n_stages) {
  if ((schedule == mpipe::Schedule::ZeroBubbleV || schedule == mpipe::Schedule::DualPipeV) &&
      n_stages % 2 != 0) {
    schedule = mpipe::Schedule::ZeroBubbleH1;
  }
  auto o = mpipe::TrainStepOptions(split).schedule(schedule);
  if (schedule == mpipe::Schedule::Interleaved1F1B || schedule == mpipe::Schedule::Auto) {
    o.virtual_stages(n_stages % 2 == 0 ? 2 : n_stages);
  }
  // Tailored: uneven stages and a hand-off cost, so that it builds its own programs.
  if (schedule == mpipe::Schedule::Tailored) {
    mpipe::schedules::Costs costs;
    for (int64_t s = 0; s < n_stages; ++s) costs.push_back({1.0 + s % 3, 2.0, 1.0, 1.0});
    o.stage_costs(costs);
  }
  return o;
}

/// A name usable in test names: GPipe, OneFOneB, ..., DualPipeV, Tailored, Auto.
inline std::string schedule_name(mpipe::Schedule s) {
  switch (s) {
    case mpipe::Schedule::GPipe: return "GPipe";
    case mpipe::Schedule::OneFOneB: return "OneFOneB";
    case mpipe::Schedule::Interleaved1F1B: return "Interleaved1F1B";
    case mpipe::Schedule::ZeroBubbleH1: return "ZeroBubbleH1";
    case mpipe::Schedule::ZeroBubbleV: return "ZeroBubbleV";
    case mpipe::Schedule::DualPipeV: return "DualPipeV";
    case mpipe::Schedule::Tailored: return "Tailored";
    case mpipe::Schedule::Auto: return "Auto";
  }
  return "Unknown";
}

/// Expects `stmt` to throw c10::Error whose message contains every piece.
#define MPIPE_EXPECT_ERROR(stmt, ...)                                             \
  do {                                                                              \
    try {                                                                           \
      stmt;                                                                         \
      ADD_FAILURE() << "expected c10::Error from: " #stmt;                          \
    } catch (const c10::Error& e_) {                                                \
      const std::string msg_ = e_.what_without_backtrace();                         \
      for (const std::string& piece_ : std::vector<std::string>{__VA_ARGS__})        \
        EXPECT_NE(msg_.find(piece_), std::string::npos)                             \
            << "message lacks \"" << piece_ << "\": " << msg_;                      \
    }                                                                               \
  } while (0)

/// Identity that counts how often its host code runs: a CUDA-graph replay
/// runs none, so an unchanged count proves a replay, a grown one an eager run.
/// It passes any shape on (single- and multi-step stages alike).
struct HostCallsImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    return x;
  }
  int64_t calls = 0;
};
TORCH_MODULE(HostCalls);

/// Across processes: a rank other than `faulty` (of `n`) that a failed
/// call's `message` names as the one that did not send or answer, or that
/// could not be reached; -1 if none.
inline int64_t bystander_named(const std::string& message, int64_t faulty, int64_t n) {
  for (int64_t r = 0; r < n; ++r) {
    const std::string rank = "rank " + std::to_string(r);
    if (r == faulty) continue;
    for (const std::string& s : {"from " + rank + " ", rank + " did not", rank + " cannot"}) {
      if (message.find(s) != std::string::npos) return r;
    }
  }
  return -1;
}

}  // namespace mpipe_test
