// Pipelines across processes (Gloo over 127.0.0.1): every rank runs this
// program under mpipe-launch (tests/CMakeLists.txt), builds the same model,
// computes the plain single-process reference itself, and checks what its own
// stages produced: outputs and losses on the last rank, gradients on every
// rank, errors on all of them.
//
//   mpipe-launch -n 3 --timeout 300 -- ./mpipe_dist_tests [--replicas=R] [gtest flags]

#include "../common.h"

#include <mpipe/autocast.h>
#include <mpipe/distributed.h>
#include <mpipe/grad_norm.h>
#include <mpipe/grad_scaler.h>
#include <mpipe/job_checkpoints.h>
#include <mpipe/script.h>
#include <mpipe/snn.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <filesystem>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <thread>

namespace {

mpipe::distributed::ProcessGroup g_group;

const mpipe::distributed::ProcessGroup& group() { return g_group; }

using Stages = std::vector<torch::nn::Sequential>;

/// n stages of width w (Linear + Tanh), the last one narrowing to 3 outputs.
Stages make_model(int64_t n, int64_t w = 6, uint64_t seed = 7) {
  torch::manual_seed(seed);
  Stages stages;
  for (int64_t s = 0; s < n; ++s) {
    torch::nn::Sequential seq;
    seq->push_back(torch::nn::Linear(w, s + 1 == n ? 3 : w));
    seq->push_back(torch::nn::Tanh());
    seq->to(torch::kDouble);
    stages.push_back(seq);
  }
  return stages;
}

torch::nn::Sequential copy(const torch::nn::Sequential& s) {
  return torch::nn::Sequential(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s->clone()));
}

/// This rank's pipeline over its range of `stages` (copies).
mpipe::ModelPipeline make_pipe(const Stages& stages, mpipe::ModelPipelineOptions options = {}) {
  options.process_group(group());
  mpipe::ModelPipeline pipe(options);
  const auto range = group().stage_range(static_cast<int64_t>(stages.size()));
  for (int64_t s = range.first; s < range.second; ++s) {
    pipe->append(copy(stages[static_cast<size_t>(s)]), "cpu");
  }
  return pipe;
}

at::Tensor plain(const Stages& stages, at::Tensor x) {
  for (auto s : stages) x = s->forward(x);
  return x;
}

/// The input: the same on every rank (only the first rank's is read).
at::Tensor input(int64_t rows, int64_t w = 6, uint64_t seed = 11) {
  torch::manual_seed(seed);
  return torch::randn({rows, w}, torch::kDouble);
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(torch::allclose(got, want, 1e-10, 1e-12))
      << what << ": max difference " << (got - want).abs().max().item<double>();
}

/// Every local stage's gradients against the reference stage's.
void expect_same_grads(const mpipe::ModelPipeline& pipe, const Stages& reference,
                       const std::string& what) {
  const int64_t first = group().stage_range(static_cast<int64_t>(reference.size())).first;
  // Stages past the reference's (a probe appended by a test) have none.
  for (size_t k = 0; k < pipe->size() && static_cast<size_t>(first) + k < reference.size(); ++k) {
    const auto got = pipe->stage(k)->parameters();
    const auto want = reference[static_cast<size_t>(first) + k]->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t p = 0; p < got.size(); ++p) {
      ASSERT_TRUE(want[p].grad().defined());
      expect_close(got[p].grad(), want[p].grad(),
                   what + ", stage " + std::to_string(first + static_cast<int64_t>(k)) +
                       ", parameter " + std::to_string(p));
    }
  }
}

using mpipe_test::bystander_named;
using mpipe_test::mse;

bool skip_unless_one_replica() { return group().replicas() != 1; }

}  // namespace

TEST(Distributed, ForwardEqualsThePlainModelAndShapesMayChange) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const auto stages = make_model(group().pipeline_size() + 1);
  auto pipe = make_pipe(stages);
  torch::NoGradGuard no_grad;
  for (int64_t rows : {7, 12, 1}) {  // a new batch size every call
    const at::Tensor x = input(rows);
    const at::Tensor out = pipe->forward(group().is_first() ? x : at::Tensor(), 3);
    // A micro-batch count: the first rank turns it into rows for every rank.
    const at::Tensor counted = pipe->forward(group().is_first() ? x : at::Tensor(), mpipe::chunks(4));
    if (group().is_last()) {
      expect_close(out, plain(stages, x), "forward, rows " + std::to_string(rows));
      expect_close(counted, plain(stages, x), "forward in 4 chunks, rows " + std::to_string(rows));
    } else {
      EXPECT_FALSE(out.defined()) << "ranks before the last get an undefined tensor";
    }
  }
}

TEST(Distributed, TimeStepCallsEqualAPlainLoop) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const auto stages = make_model(group().pipeline_size());
  auto pipe = make_pipe(stages, mpipe::ModelPipelineOptions().worker_threads(false));
  torch::NoGradGuard no_grad;
  const at::Tensor x = input(4);
  at::Tensor sum = plain(stages, x) * 5;
  const at::Tensor c = pipe->constant_forward(x, 5, true);
  const at::Tensor seq = torch::randn({6, 4, 6}, torch::kDouble);
  std::vector<at::Tensor> steps;
  for (int64_t t = 0; t < 6; ++t) steps.push_back(plain(stages, seq[t]));
  const at::Tensor s = pipe->sequence_forward(seq, false);
  if (group().is_last()) {
    expect_close(c, sum, "constant_forward");
    expect_close(s, torch::stack(steps), "sequence_forward");
  } else {
    EXPECT_FALSE(c.defined());
    EXPECT_FALSE(s.defined());
  }
}

TEST(Distributed, TrainStepEqualsThePlainModelUnderEverySchedule) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t ranks = group().pipeline_size();
  const at::Tensor x = input(10);
  torch::manual_seed(3);
  const at::Tensor y = torch::randn({10, 3}, torch::kDouble);
  for (auto schedule : {mpipe::Schedule::GPipe, mpipe::Schedule::OneFOneB,
                        mpipe::Schedule::Interleaved1F1B, mpipe::Schedule::ZeroBubbleH1,
                        mpipe::Schedule::ZeroBubbleV, mpipe::Schedule::DualPipeV,
                        mpipe::Schedule::Tailored, mpipe::Schedule::Auto}) {
    for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::ExceptLast,
                            mpipe::Checkpoint::Always}) {
      for (bool threads : {true, false}) {
        const bool interleaved = schedule == mpipe::Schedule::Interleaved1F1B;
        const bool even = interleaved || schedule == mpipe::Schedule::ZeroBubbleV ||
                          schedule == mpipe::Schedule::DualPipeV;
        const auto stages = make_model(even ? 2 * ranks : ranks + 1);
        auto reference = make_model(static_cast<int64_t>(stages.size()));
        auto pipe = make_pipe(stages, mpipe::ModelPipelineOptions()
                                          .worker_threads(threads)
                                          .checkpoint(checkpoint));
        const std::string what = std::string(mpipe::to_string(schedule)) + ", checkpoint " +
                                 std::to_string(static_cast<int>(checkpoint)) +
                                 (threads ? ", threads" : ", inline");
        auto step = mpipe::TrainStepOptions(3).schedule(schedule);
        if (interleaved) step.virtual_stages(2);
        // Tailored's programs, built on the first rank for uneven costs, travel with the call.
        if (schedule == mpipe::Schedule::Tailored) step.stage_costs({{1, 2, 1, 2}});
        const at::Tensor loss = pipe->train_step(group().is_first() ? x : at::Tensor(),
                                                 group().is_last() ? y : at::Tensor(), mse, step);
        const at::Tensor want = mse(plain(reference, x), y);
        want.backward();
        if (group().is_last()) {
          expect_close(loss, want.detach(), what + ": loss");
        } else {
          EXPECT_FALSE(loss.defined()) << what;
        }
        expect_same_grads(pipe, reference, what);
      }
    }
  }
}

// The V (ProcessGroup::v_stages): rank r holds stages r and 2S - 1 - r, so
// rank 0 reads the inputs and gets the outputs and the loss. Every schedule
// runs on it (ZB-V's programs are one per rank there), and the results equal
// the plain model's for micro-batch counts from 1 to 3S.
TEST(Distributed, VPlacedStagesEqualThePlainModel) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t ranks = group().pipeline_size();
  const auto mine = group().v_stages(2 * ranks);
  ASSERT_EQ(mine, (std::vector<int64_t>{group().pipeline_rank(),
                                        2 * ranks - 1 - group().pipeline_rank()}));
  const bool holds_last = group().pipeline_rank() == 0;
  const auto stages = make_model(2 * ranks);
  auto v_pipe = [&](const Stages& from, mpipe::ModelPipelineOptions options) {
    mpipe::ModelPipeline pipe(options.process_group(group()).stage_numbers(mine));
    for (int64_t s : mine) pipe->append(copy(from[static_cast<size_t>(s)]), "cpu");
    return pipe;
  };
  {
    torch::NoGradGuard no_grad;
    auto pipe = v_pipe(stages, {});
    const at::Tensor x = input(7);
    const at::Tensor out = pipe->forward(group().is_first() ? x : at::Tensor(), 3);
    const at::Tensor c = pipe->constant_forward(group().is_first() ? x : at::Tensor(), 4, true);
    if (holds_last) {
      expect_close(out, plain(stages, x), "forward on the V");
      expect_close(c, plain(stages, x) * 4, "constant_forward on the V");
    } else {
      EXPECT_FALSE(out.defined());
      EXPECT_FALSE(c.defined());
    }
  }
  const at::Tensor x = input(12);
  torch::manual_seed(3);
  const at::Tensor y = torch::randn({12, 3}, torch::kDouble);
  std::vector<int64_t> v_labels;  // the workers of the V: rank r holds stages r and 2S - 1 - r
  for (int64_t s = 0; s < 2 * ranks; ++s) v_labels.push_back(s < ranks ? s : 2 * ranks - 1 - s);
  int64_t tailored_pairs = 0;
  for (auto schedule : {mpipe::Schedule::OneFOneB, mpipe::Schedule::ZeroBubbleH1,
                        mpipe::Schedule::ZeroBubbleV, mpipe::Schedule::DualPipeV,
                        mpipe::Schedule::Tailored, mpipe::Schedule::Auto}) {
    for (int64_t m : {int64_t{1}, ranks, 2 * ranks + 1, 3 * ranks}) {
      // Threaded without checkpoints, inline with every stage checkpointed.
      for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::Always}) {
        for (bool threads : {checkpoint == mpipe::Checkpoint::Never}) {
          auto reference = make_model(2 * ranks);
          auto pipe = v_pipe(stages, mpipe::ModelPipelineOptions()
                                         .worker_threads(threads)
                                         .checkpoint(checkpoint));
          const std::string what = std::string(mpipe::to_string(schedule)) + " on the V, " +
                                   std::to_string(m) + " micro-batches, checkpoint " +
                                   std::to_string(static_cast<int>(checkpoint)) +
                                   (threads ? ", threads" : ", inline");
          auto step = mpipe::TrainStepOptions(mpipe::chunks(m)).schedule(schedule);
          if (schedule == mpipe::Schedule::Tailored) {
            // Costs under which Tailored picks DualPipeV's pairs (Op::with_next)
            // from 2S + 1 micro-batches on: they travel with the call too.
            step.stage_costs({{1, 2, 0, 0}});
            const auto chosen = mpipe::choose_schedule(m, 2 * ranks, step, v_labels);
            for (const auto& program : chosen.programs) {
              for (const auto& op : program) tailored_pairs += op.with_next;
            }
          }
          const at::Tensor loss = pipe->train_step(group().is_first() ? x : at::Tensor(),
                                                   holds_last ? y : at::Tensor(), mse, step);
          const at::Tensor want = mse(plain(reference, x), y);
          want.backward();
          if (holds_last) {
            expect_close(loss, want.detach(), what + ": loss");
          } else {
            EXPECT_FALSE(loss.defined()) << what;
          }
          for (size_t k = 0; k < mine.size(); ++k) {
            const auto got = pipe->stage(k)->parameters();
            const auto ref = reference[static_cast<size_t>(mine[k])]->parameters();
            for (size_t p = 0; p < got.size(); ++p) {
              expect_close(got[p].grad(), ref[p].grad(),
                           what + ", stage " + std::to_string(mine[k]) + ", parameter " +
                               std::to_string(p));
            }
          }
        }
      }
    }
  }
  EXPECT_GT(tailored_pairs, 0) << "Tailored never picked DualPipeV's pairs on the V";
}

// Wrong stage numbers fail the first call on every rank, naming the rank, and
// the group serves the next pipeline.
TEST(Distributed, WrongStageNumbersAreReportedOnEveryRank) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t ranks = group().pipeline_size(), p = group().pipeline_rank();
  const auto stages = make_model(2 * ranks);
  const at::Tensor x = input(4);
  struct Case {
    std::vector<int64_t> numbers;  // this rank's
    std::vector<int64_t> append;   // which stages it appends
    std::string message;
  };
  const std::vector<Case> cases = {
      // Every rank claims stages p and p + 1: stage 1 twice.
      {{p, p + 1}, {p, p + 1}, "is numbered by both"},
      // Descending numbers on the last rank.
      {p + 1 == ranks ? std::vector<int64_t>{2 * ranks - 1 - p, p} : group().v_stages(2 * ranks),
       group().v_stages(2 * ranks), "they must ascend"},
      // Rank 0 without stage 0: the V mirrored.
      {{ranks - 1 - p, ranks + p}, {ranks - 1 - p, ranks + p}, "pipeline rank 0 holds it"},
      // Only rank 0 numbers its stages.
      {p == 0 ? group().v_stages(2 * ranks) : std::vector<int64_t>{},
       group().v_stages(2 * ranks), "every rank sets them or none does"},
      // More numbers than stages on the last rank.
      {p + 1 == ranks ? std::vector<int64_t>{p, 2 * ranks - 1 - p, 2 * ranks}
                      : group().v_stages(2 * ranks),
       group().v_stages(2 * ranks), "are not as many as the stages it appended"},
  };
  for (const auto& c : cases) {
    mpipe::ModelPipeline pipe(
        mpipe::ModelPipelineOptions().process_group(group()).stage_numbers(c.numbers));
    for (int64_t s : c.append) pipe->append(copy(stages[static_cast<size_t>(s)]), "cpu");
    torch::NoGradGuard no_grad;
    try {
      pipe->forward(group().is_first() ? x : at::Tensor(), 2);
      ADD_FAILURE() << "no error for " << c.message;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(c.message), std::string::npos)
          << e.what_without_backtrace();
    }
  }
  EXPECT_THROW(group().v_stages(2 * ranks + 1), c10::Error);
  // The group still carries a good pipeline.
  auto pipe = make_pipe(stages);
  torch::NoGradGuard no_grad;
  const at::Tensor out = pipe->forward(group().is_first() ? x : at::Tensor(), 2);
  if (group().is_last()) expect_close(out, plain(stages, x), "after the wrong numbers");
}

/// A TorchScript nn.Sequential of `n` blocks b0, b1, ... (Linear(6, 6) + Tanh,
/// in double), the same on every rank.
torch::jit::Module script_blocks(int64_t n) {
  torch::manual_seed(21);
  torch::jit::Module seq("Blocks");
  seq.register_attribute("training", c10::BoolType::get(), true);
  std::string body = "def forward(self, x):\n";
  for (int64_t b = 0; b < n; ++b) {
    torch::jit::Module block("Block");
    block.register_attribute("training", c10::BoolType::get(), true);
    block.register_parameter("weight", torch::randn({6, 6}, torch::kDouble).requires_grad_(), false);
    block.register_parameter("bias", torch::randn({6}, torch::kDouble).requires_grad_(), false);
    block.define("def forward(self, x):\n    return torch.tanh(torch.linear(x, self.weight, self.bias))\n");
    seq.register_module("b" + std::to_string(b), block);
    body += "    x = self.b" + std::to_string(b) + ".forward(x)\n";
  }
  seq.define(body + "    return x\n");
  return seq;
}

// TorchScript stages across processes (Note [TorchScript stages]): each rank
// appends its blocks of the module; loss and gradients equal the whole
// module's on the same micro-batches, bit for bit.
TEST(Distributed, TorchScriptStagesTrainAcrossRanks) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t n = group().pipeline_size() + 1;
  const at::Tensor x = input(10);
  torch::manual_seed(3);
  const at::Tensor y = torch::randn({10, 6}, torch::kDouble);
  auto model = script_blocks(n), reference = script_blocks(n);
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group()));
  const auto range = group().stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) {
    pipe->append(model.attr("b" + std::to_string(s)).toModule(), "cpu");
  }
  const at::Tensor loss = pipe->train_step(group().is_first() ? x : at::Tensor(),
                                           group().is_last() ? y : at::Tensor(), mse,
                                           mpipe::TrainStepOptions(3));
  // The whole module as the stages run it, on train_step's micro-batches.
  torch::jit::GraphOptimizerEnabledGuard as_written(false);
  at::Tensor want;
  for (int64_t start = 0; start < 10; start += 3) {
    const int64_t rows = std::min<int64_t>(3, 10 - start);
    const auto part = mse(reference.forward({x.narrow(0, start, rows)}).toTensor(),
                          y.narrow(0, start, rows)) * (static_cast<double>(rows) / 10);
    part.backward();
    want = want.defined() ? want + part.detach() : part.detach();
  }
  if (group().is_last()) {
    EXPECT_TRUE(torch::equal(loss, want)) << "loss";
  }
  for (int64_t s = range.first; s < range.second; ++s) {
    const std::string b = "b" + std::to_string(s);
    for (const char* p : {"weight", "bias"}) {
      const auto got = model.attr(b).toModule().attr(p).toTensor().grad();
      const auto expected = reference.attr(b).toModule().attr(p).toTensor().grad();
      ASSERT_TRUE(got.defined()) << b << "." << p;
      EXPECT_TRUE(torch::equal(got, expected)) << b << "." << p;
    }
  }
}

TEST(Distributed, AutocastAndLossScalingWorkAcrossRanks) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t ranks = group().pipeline_size();
  auto stages = make_model(ranks + 1);
  for (auto& st : stages) st->to(torch::kFloat);
  auto reference = make_model(ranks + 1);
  for (auto& st : reference) st->to(torch::kFloat);
  const at::Tensor x = input(8).to(torch::kFloat);
  {  // every rank enters the same autocast state; the stages run under it
    torch::NoGradGuard no_grad;
    mpipe::AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
    auto pipe = make_pipe(stages);
    const at::Tensor out = pipe->forward(group().is_first() ? x : at::Tensor(), 8);
    const at::Tensor want = plain(reference, x);
    if (group().is_last()) {
      ASSERT_EQ(out.scalar_type(), torch::kBFloat16);
      EXPECT_TRUE(torch::allclose(out.to(torch::kFloat), want.to(torch::kFloat), 1e-2, 1e-2));
    }
  }
  // loss_scale: the gradients of the scaled loss; the scaler brings them back
  // and every rank skips the step when one rank's gradients overflow.
  auto pipe = make_pipe(stages);
  torch::manual_seed(5);
  const at::Tensor y = torch::randn({8, 3});
  const at::Tensor loss = pipe->train_step(group().is_first() ? x : at::Tensor(),
                                           group().is_last() ? y : at::Tensor(), mse,
                                           mpipe::TrainStepOptions(2).loss_scale(256));
  const at::Tensor want = mse(plain(reference, x), y);
  want.backward();
  if (group().is_last()) {
    EXPECT_TRUE(torch::allclose(loss, want.detach(), 1e-6, 1e-7)) << "the loss is not scaled";
  }
  const int64_t first = group().stage_range(ranks + 1).first;
  // Stages past the reference's (a probe appended by a test) have none.
  for (size_t k = 0; k < pipe->size() && static_cast<size_t>(first) + k < reference.size(); ++k) {
    const auto got = pipe->stage(k)->parameters();
    const auto ref = reference[static_cast<size_t>(first) + k]->parameters();
    for (size_t p = 0; p < got.size(); ++p) {
      EXPECT_TRUE(torch::allclose(got[p].grad(), ref[p].grad() * 256, 1e-5, 1e-6));
    }
  }
  torch::optim::SGD opt(pipe->parameters(), 0.1);
  mpipe::GradScaler scaler(mpipe::GradScalerOptions().init_scale(256).process_group(group()));
  if (group().rank() == 0) pipe->parameters()[0].mutable_grad()[0][0] = NAN;
  const auto before = pipe->parameters()[0].detach().clone();
  EXPECT_FALSE(scaler.step(opt)) << "rank 0's NaN skips the step on rank " << group().rank();
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 128);
  EXPECT_TRUE(torch::equal(pipe->parameters()[0].detach(), before));
}

TEST(Distributed, ConstantTrainStepWithStateEqualsAPlainLoop) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  // Stage s: a leaky accumulator (state carried across time steps) for even
  // s, Linear + Tanh for odd s; n = ranks + 1 stages.
  const int64_t n = group().pipeline_size() + 1;
  auto build = [&] {
    torch::manual_seed(9);
    std::vector<std::shared_ptr<torch::nn::Module>> v;
    for (int64_t s = 0; s < n; ++s) {
      if (s % 2 == 0) {
        auto m = std::make_shared<mpipe_test::LeakyImpl>(6);
        m->to(torch::kDouble);
        v.push_back(m);
      } else {
        auto m = mpipe_test::mlp_stage(6, 6, 1);
        m->to(torch::kDouble);
        v.push_back(m.ptr());
      }
    }
    return v;
  };
  auto call = [](const std::shared_ptr<torch::nn::Module>& m, const at::Tensor& x) {
    if (auto leaky = std::dynamic_pointer_cast<mpipe_test::LeakyImpl>(m)) return leaky->forward(x);
    return std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m)->forward(x);
  };
  const auto reference = build();
  const auto mine = build();
  const int64_t T = 4;
  const at::Tensor x = input(5).requires_grad_(true);
  const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
  const at::Tensor y = torch::full({5, 6}, 0.25, torch::kDouble);
  at::Tensor sum;
  for (int64_t t = 0; t < T; ++t) {
    at::Tensor h = x_ref;
    for (const auto& m : reference) h = call(m, h);
    sum = sum.defined() ? sum + h : h;
  }
  const at::Tensor want = mse(sum, y);
  want.backward();
  for (bool threads : {true, false}) {
    mpipe::ModelPipeline pipe(
        mpipe::ModelPipelineOptions().process_group(group()).worker_threads(threads));
    const auto range = group().stage_range(n);
    for (int64_t s = range.first; s < range.second; ++s) {
      auto m = mine[static_cast<size_t>(s)];
      if (auto leaky = std::dynamic_pointer_cast<mpipe_test::LeakyImpl>(m)) {
        pipe->append(leaky, "cpu");
      } else {
        pipe->append(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m), "cpu");
      }
    }
    for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
    x.mutable_grad() = at::Tensor();
    const at::Tensor loss = pipe->constant_train_step(x, T, y, mse);
    const std::string what = threads ? "threads" : "inline";
    if (group().is_last()) {
      expect_close(loss, want.detach(), "constant_train_step loss, " + what);
    } else {
      EXPECT_FALSE(loss.defined());
    }
    if (group().is_first()) expect_close(x.grad(), x_ref.grad(), "the input's gradient, " + what);
    for (int64_t s = range.first; s < range.second; ++s) {
      const auto got = mine[static_cast<size_t>(s)]->parameters();
      const auto ref = reference[static_cast<size_t>(s)]->parameters();
      for (size_t p = 0; p < got.size(); ++p) {
        expect_close(got[p].grad(), ref[p].grad(),
                     "constant_train_step, stage " + std::to_string(s) + ", " + what);
      }
    }
  }
}

/// n multi-step stages: SeqToANN(Linear, Tanh) and a multi-step LIF neuron,
/// the same draws for the same seed.
Stages make_multi_step_model(int64_t n, uint64_t seed = 5) {
  torch::manual_seed(seed);
  Stages stages;
  const auto lif = mpipe::snn::LIFNodeOptions().v_threshold(0.3).step_mode(mpipe::snn::StepMode::Multi);
  for (int64_t s = 0; s < n; ++s) {
    torch::nn::Sequential seq{mpipe::snn::SeqToANN(torch::nn::Linear(6, 6), torch::nn::Tanh()),
                              mpipe::snn::LIFNode(lif)};
    seq->to(torch::kDouble);
    stages.push_back(seq);
  }
  return stages;
}

TEST(Distributed, TimeChunksEqualThePlainMultiStepModel) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t n = group().pipeline_size(), T = 7;
  const Stages reference = make_multi_step_model(n);
  const Stages mine = make_multi_step_model(n);
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group()).step_mode(
      mpipe::snn::StepMode::Multi));
  const auto range = group().stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) pipe->append(mine[static_cast<size_t>(s)], "cpu");
  const at::Tensor x = input(4) * 3;
  auto plain_steps = [&](const at::Tensor& seq) {  // [T, N, 6] -> [T, N, 6], fresh state
    for (auto stage : reference) mpipe::reset_states(*stage);
    return plain(reference, seq);
  };
  auto step_sum = [](const at::Tensor& steps) {  // summed step by step, as the pipeline does
    at::Tensor sum = steps[0];
    for (int64_t t = 1; t < steps.size(0); ++t) sum = sum + steps[t];
    return sum;
  };
  {
    torch::NoGradGuard no_grad;
    const at::Tensor want = step_sum(plain_steps(x.unsqueeze(0).expand({T, 4, 6})));
    if (group().is_last()) ASSERT_GT(want.sum().item<double>(), 0.0) << "the test should spike";
    for (int64_t k : {1, 3, 7}) {
      const at::Tensor got = pipe->constant_forward(group().is_first() ? x : at::Tensor(), T, true, k);
      mpipe::reset_states(*pipe);
      if (group().is_last()) expect_close(got, want, "constant_forward, time chunk " + std::to_string(k));
    }
    const at::Tensor seq = torch::rand({T, 4, 6}, torch::kDouble) * 3;
    const at::Tensor got = pipe->sequence_forward(group().is_first() ? seq : at::Tensor(), false, 2);
    mpipe::reset_states(*pipe);
    if (group().is_last()) expect_close(got, plain_steps(seq), "sequence_forward, time chunk 2");
  }
  // A training step in chunks of 3 (the last of 1), the default chunk too.
  const at::Tensor y = torch::full({4, 6}, 0.5, torch::kDouble);
  const at::Tensor want = mse(step_sum(plain_steps(x.unsqueeze(0).expand({T, 4, 6}))), y);
  want.backward();
  for (std::optional<int64_t> k : {std::optional<int64_t>(3), std::optional<int64_t>()}) {
    const std::string what = k ? "time chunk 3" : "the default chunk";
    for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
    const at::Tensor loss = pipe->constant_train_step(x, T, y, mse, k);
    if (group().is_last()) expect_close(loss, want.detach(), "constant_train_step loss, " + what);
    expect_same_grads(pipe, reference, "constant_train_step, " + what);
  }
}

/// Passes x on, noting how many micro-batches its call has.
struct MicroBatchCountImpl : torch::nn::Module {
  int64_t count = 0;
  at::Tensor forward(const at::Tensor& x) {
    count = mpipe::current_micro_batch().count;
    return x;
  }
};
TORCH_MODULE(MicroBatchCount);

// Note [Micro-batches over time]: (micro-batch, time chunk) items across
// ranks, against a plain multi-step loop per micro-batch, joined.
TEST(Distributed, TimeMicroBatchesEqualAPlainLoopPerMicroBatch) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t n = group().pipeline_size(), T = 6, N = 5;
  const Stages reference = make_multi_step_model(n);
  const Stages mine = make_multi_step_model(n);
  const auto range = group().stage_range(n);
  auto per_micro_batch = [&](const at::Tensor& seq, int64_t rows, bool reduce) {
    for (auto stage : reference) mpipe::reset_states(*stage);
    const int64_t M = (N + rows - 1) / rows;
    std::vector<at::Tensor> parts;
    for (int64_t m = 0; m < M; ++m) {
      mpipe::MicroBatchGuard guard({m, M});
      at::Tensor steps = plain(reference, seq.narrow(1, m * rows, std::min(rows, N - m * rows)));
      if (reduce) {
        at::Tensor sum = steps[0];
        for (int64_t t = 1; t < T; ++t) sum = sum + steps[t];
        steps = sum;
      }
      parts.push_back(steps);
    }
    for (auto stage : reference) mpipe::reset_states(*stage);
    return at::cat(parts, reduce ? 0 : 1);
  };
  const at::Tensor x = input(N) * 3;
  const at::Tensor seq = torch::rand({T, N, 6}, torch::kDouble) * 3;
  for (bool threads : {true, false}) {
    const std::string what = threads ? ", threads" : ", inline";
    mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions()
                                  .process_group(group())
                                  .worker_threads(threads)
                                  .step_mode(mpipe::snn::StepMode::Multi));
    for (int64_t s = range.first; s < range.second; ++s) {
      pipe->append(mine[static_cast<size_t>(s)], "cpu");
    }
    MicroBatchCount probe;  // on the last rank, after its stages: passes x on
    if (group().is_last()) pipe->append(probe, "cpu");
    {
      torch::NoGradGuard no_grad;
      const at::Tensor want = per_micro_batch(x.unsqueeze(0).expand({T, N, 6}), 3, true);
      if (group().is_last()) ASSERT_GT(want.sum().item<double>(), 0.0) << "the test should spike";
      const at::Tensor got = pipe->constant_forward(group().is_first() ? x : at::Tensor(), T, true,
                                                    4, mpipe::chunks(2));
      mpipe::reset_states(*pipe);
      if (group().is_last()) expect_close(got, want, "constant_forward, chunks(2) x 4 steps" + what);
      const at::Tensor got_seq = pipe->sequence_forward(group().is_first() ? seq : at::Tensor(),
                                                        false, 2, mpipe::Split(2));
      mpipe::reset_states(*pipe);
      if (group().is_last()) {
        expect_close(got_seq, per_micro_batch(seq, 2, false), "sequence_forward, 2 rows x 2 steps" + what);
      }
    }
    const at::Tensor y = torch::full({N, 6}, 0.5, torch::kDouble);
    for (auto stage : reference) {
      for (auto& p : stage->parameters()) p.mutable_grad() = at::Tensor();
    }
    const at::Tensor want = mse(per_micro_batch(x.unsqueeze(0).expand({T, N, 6}), 2, true), y);
    want.backward();
    for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::Always}) {
      const std::string how = what + (checkpoint == mpipe::Checkpoint::Always ? ", checkpointed" : "");
      pipe->options.checkpoint(checkpoint);
      for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
      const at::Tensor loss = pipe->constant_train_step(x, T, y, mse, 4, mpipe::Split(2));
      if (group().is_last()) expect_close(loss, want.detach(), "constant_train_step loss" + how);
      expect_same_grads(pipe, reference, "constant_train_step, 2 rows x 4 steps" + how);
    }
    pipe->options.checkpoint(mpipe::Checkpoint::Never);
    // The pipeline's choice: T = 2 steps give 2 chunks, fewer than 2 per
    // rank, so a call that starts from reset state cuts the batch into about
    // 4 items per rank; one whose state carries on keeps the whole batch.
    {
      torch::NoGradGuard no_grad;
      pipe->sequence_forward(group().is_first() ? seq.narrow(0, 0, 2) : at::Tensor(), false);
      mpipe::reset_states(*pipe);
      if (group().is_last()) EXPECT_EQ(probe->count, 1) << "state carries: no automatic split";
      pipe->options.reset_state_each_call(true);
      const int64_t m = std::min(N, (4 * n + 1) / 2), rows = (N + m - 1) / m;
      const at::Tensor short_seq = seq.narrow(0, 0, 2);
      const at::Tensor got = pipe->sequence_forward(group().is_first() ? short_seq : at::Tensor(),
                                                    false);
      mpipe::reset_states(*pipe);
      // per_micro_batch sums over T steps: compare the two steps stacked.
      for (auto stage : reference) mpipe::reset_states(*stage);
      std::vector<at::Tensor> parts;
      const int64_t M = (N + rows - 1) / rows;
      for (int64_t mb = 0; mb < M; ++mb) {
        mpipe::MicroBatchGuard guard({mb, M});
        parts.push_back(plain(reference, short_seq.narrow(1, mb * rows, std::min(rows, N - mb * rows))));
      }
      for (auto stage : reference) mpipe::reset_states(*stage);
      if (group().is_last()) {
        expect_close(got, at::cat(parts, 1), "sequence_forward, the automatic split" + what);
        EXPECT_EQ(probe->count, M) << "the automatic split";
      }
      pipe->sequence_forward(group().is_first() ? seq : at::Tensor(), false);
      mpipe::reset_states(*pipe);
      // T = 6: 6 chunks, enough for 2 and 3 ranks; 4 ranks want 16 items.
      if (group().is_last()) {
        EXPECT_EQ(probe->count, T >= 2 * n ? 1 : std::min(N, (4 * n + T - 1) / T)) << "T = 6";
      }
      pipe->options.reset_state_each_call(false);
    }
  }
}

TEST(Distributed, InputGradientsReachTheFirstRank) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const auto stages = make_model(group().pipeline_size());
  auto reference = make_model(group().pipeline_size());
  auto pipe = make_pipe(stages);
  const at::Tensor x = input(6).requires_grad_(true);
  const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
  const at::Tensor y = torch::ones({6, 3}, torch::kDouble);
  pipe->train_step(x, y, mse, mpipe::TrainStepOptions(2));
  mse(plain(reference, x_ref), y).backward();
  if (group().is_first()) {
    expect_close(x.grad(), x_ref.grad(), "the input's gradient");
  } else {
    EXPECT_FALSE(x.grad().defined()) << "only the first rank's input is the call's";
  }
}

namespace {
/// Stage s of a pipeline whose stage 0 stashes its input and whose last
/// stage adds it back (a skip across every rank boundary).
struct SkipStageImpl : torch::nn::Module {
  SkipStageImpl(int64_t s, int64_t n) : s(s), n(n) {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    fc->to(torch::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    if (s == 0) mpipe::stash("skip", x * 2);
    at::Tensor h = torch::tanh(fc(x));
    if (s + 1 == n) h = h + mpipe::pop("skip");
    return h;
  }
  int64_t s, n;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SkipStage);
}  // namespace

TEST(Distributed, SkipsCrossRanksBothWays) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t n = group().pipeline_size() + 1;
  auto build = [&] {
    torch::manual_seed(5);
    std::vector<SkipStage> v;
    for (int64_t s = 0; s < n; ++s) v.emplace_back(s, n);
    return v;
  };
  const auto reference = build();
  const auto mine = build();
  const at::Tensor x = input(8);
  const at::Tensor y = torch::zeros({8, 6}, torch::kDouble);
  at::Tensor h = x;
  for (auto s : reference) h = s->forward(h);  // outside a pipeline: the thread's store
  const at::Tensor want = mse(h, y);
  want.backward();
  for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::Always}) {
    mpipe::ModelPipeline pipe(
        mpipe::ModelPipelineOptions().process_group(group()).checkpoint(checkpoint));
    const auto range = group().stage_range(n);
    for (int64_t s = range.first; s < range.second; ++s) {
      pipe->append(mine[static_cast<size_t>(s)], "cpu");
    }
    for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
    {
      torch::NoGradGuard no_grad;
      const at::Tensor out = pipe->forward(x, 3);
      if (group().is_last()) expect_close(out, h.detach(), "forward with a skip");
    }
    const at::Tensor loss = pipe->train_step(x, y, mse, mpipe::TrainStepOptions(4));
    if (group().is_last()) expect_close(loss, want.detach(), "train_step with a skip: loss");
    for (int64_t s = range.first; s < range.second; ++s) {
      const auto got = mine[static_cast<size_t>(s)]->parameters();
      const auto ref = reference[static_cast<size_t>(s)]->parameters();
      for (size_t p = 0; p < got.size(); ++p) {
        expect_close(got[p].grad(), ref[p].grad(), "train_step with a skip: stage " +
                                                       std::to_string(s) + " gradient");
      }
    }
  }
  // constant_train_step: the skip's graph crosses the ranks too (T = 2 of a
  // stateless model: the loss of twice the output).
  for (auto s : reference) s->zero_grad();
  at::Tensor h2 = x;
  for (auto s : reference) h2 = s->forward(h2);
  const at::Tensor want2 = mse(h2 * 2, y);
  want2.backward();
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group()));
  const auto range = group().stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) {
    pipe->append(mine[static_cast<size_t>(s)], "cpu");
  }
  for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
  const at::Tensor loss2 = pipe->constant_train_step(x, 2, y, mse);
  if (group().is_last()) expect_close(loss2, want2.detach(), "constant_train_step with a skip");
  for (int64_t s = range.first; s < range.second; ++s) {
    const auto got = mine[static_cast<size_t>(s)]->parameters();
    const auto ref = reference[static_cast<size_t>(s)]->parameters();
    for (size_t p = 0; p < got.size(); ++p) {
      expect_close(got[p].grad(), ref[p].grad(), "constant_train_step with a skip: stage " +
                                                     std::to_string(s) + " gradient");
    }
  }
}

namespace {
/// Two tensors out of stage 0, two into stage 1, DeferredBatchNorm there.
struct SplitImpl : torch::nn::Module {
  SplitImpl() { fc = register_module("fc", torch::nn::Linear(6, 6)); }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    const at::Tensor h = fc(x);
    return {torch::tanh(h), h * 0.5};
  }
  torch::nn::Linear fc{nullptr};
};
struct JoinNormImpl : torch::nn::Module {
  JoinNormImpl() {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    bn = register_module("bn", mpipe::DeferredBatchNorm(6));
  }
  at::Tensor forward(const at::Tensor& a, const at::Tensor& b) {
    return torch::tanh(bn(fc(a) + b));
  }
  torch::nn::Linear fc{nullptr};
  mpipe::DeferredBatchNorm bn{nullptr};
};
}  // namespace

TEST(Distributed, SeveralTensorsAndDeferredBatchNormEqualOneProcess) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t n = group().pipeline_size() + 1;
  // The same stages, built twice: for this rank's part, and for a pipeline
  // in this process alone (the reference).
  auto build = [&](mpipe::ModelPipeline& pipe, bool all) {
    torch::manual_seed(21);
    const auto range = group().stage_range(n);
    for (int64_t s = 0; s < n; ++s) {
      std::shared_ptr<torch::nn::Module> m;
      if (s == 0) {
        auto split = std::make_shared<SplitImpl>();
        split->to(torch::kDouble);
        if (all || (s >= range.first && s < range.second)) pipe->append(split, "cpu");
      } else if (s == 1) {
        auto join = std::make_shared<JoinNormImpl>();
        join->to(torch::kDouble);
        if (all || (s >= range.first && s < range.second)) pipe->append(join, "cpu");
      } else {
        auto mlp = mpipe_test::mlp_stage(6, 6, 1);
        mlp->to(torch::kDouble);
        if (all || (s >= range.first && s < range.second)) pipe->append(mlp, "cpu");
      }
    }
  };
  const at::Tensor x = input(9);
  const at::Tensor y = torch::zeros({9, 6}, torch::kDouble);
  for (auto schedule : {mpipe::Schedule::OneFOneB, mpipe::Schedule::ZeroBubbleH1}) {
    for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::Always}) {
      const auto options = mpipe::ModelPipelineOptions().checkpoint(checkpoint);
      mpipe::ModelPipeline reference(options);
      build(reference, true);
      mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions(options).process_group(group()));
      build(pipe, false);
      const auto step = mpipe::TrainStepOptions(2).schedule(schedule);
      const std::string what = std::string(mpipe::to_string(schedule)) +
                               (checkpoint == mpipe::Checkpoint::Never ? "" : ", checkpointed");
      for (int k = 0; k < 2; ++k) {  // twice: the running statistics move on
        const at::Tensor want = reference->train_step(x, y, mse, step);
        const at::Tensor got = pipe->train_step(x, y, mse, step);
        if (group().is_last()) expect_close(got, want, what + ": loss");
      }
      const auto first = static_cast<size_t>(group().stage_range(n).first);
      for (size_t k = 0; k < pipe->size(); ++k) {
        const auto a = pipe->stage(k)->named_parameters();
        const auto b = reference->stage(first + k)->named_parameters();
        for (const auto& p : a) {
          expect_close(p.value().grad(), b[p.key()].grad(), what + ": " + p.key());
        }
        const auto bufs = pipe->stage(k)->named_buffers();
        const auto ref_bufs = reference->stage(first + k)->named_buffers();
        for (const auto& buf : bufs) {
          if (buf.value().is_floating_point()) {
            expect_close(buf.value(), ref_bufs[buf.key()], what + ": buffer " + buf.key());
          }
        }
      }
      pipe->eval();
      reference->eval();
      torch::NoGradGuard no_grad;
      const at::Tensor out = pipe->forward(x, 4);
      if (group().is_last()) expect_close(out, reference->forward(x, 4), what + ": eval forward");
    }
  }
}

namespace {
/// Throws on micro-batch `bad` when armed (on the rank that holds it).
struct FlakyImpl : torch::nn::Module {
  explicit FlakyImpl(int64_t stage) : stage(stage) {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    fc->to(torch::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    if (armed && ++seen == 2) throw std::runtime_error("flaky stage broke");
    return torch::tanh(fc(x));
  }
  int64_t stage;
  bool armed = false;
  int64_t seen = 0;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Flaky);
}  // namespace

TEST(Distributed, AnErrorOnOneRankFailsEveryRankAndThePipelineStaysUsable) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const int64_t n = group().pipeline_size();
  const int64_t bad = n - 1;  // the last rank's stage fails
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group()));
  torch::manual_seed(1);
  std::vector<Flaky> stages;
  for (int64_t s = 0; s < n; ++s) stages.emplace_back(s);
  const auto range = group().stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) {
    pipe->append(stages[static_cast<size_t>(s)], "cpu");
  }
  stages[static_cast<size_t>(bad)]->armed = true;
  const at::Tensor x = input(8);
  const at::Tensor y = torch::zeros({8, 6}, torch::kDouble);
  try {
    pipe->train_step(x, y, mse, mpipe::TrainStepOptions(2));
    ADD_FAILURE() << "the step should fail on every rank";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("flaky stage broke"), std::string::npos) << what;
    EXPECT_NE(what.find("stage " + std::to_string(bad)), std::string::npos) << what;
    EXPECT_NE(what.find("micro-batch 1"), std::string::npos) << what;
    if (!group().is_last()) {
      EXPECT_NE(what.find("rank " + std::to_string(group().pipeline_size() - 1) + " failed"),
                std::string::npos)
          << what;
    }
  }
  // Bad arguments on the first rank fail every rank too.
  try {
    torch::NoGradGuard no_grad;
    pipe->forward(x, 0);
    ADD_FAILURE() << "split_size 0 should fail on every rank";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("split_size must be positive"), std::string::npos)
        << e.what();
  }
  // And the next call works.
  stages[static_cast<size_t>(bad)]->armed = false;
  torch::NoGradGuard no_grad;
  const at::Tensor out = pipe->forward(x, 4);
  if (group().is_last()) {
    at::Tensor h = x;
    for (auto s : stages) h = s->forward(h);
    expect_close(out, h, "forward after the errors");
  }
}

TEST(Distributed, EachRankSavesAndLoadsItsStages) {
  if (skip_unless_one_replica()) GTEST_SKIP() << "replicated world";
  const auto stages = make_model(group().pipeline_size());
  auto pipe = make_pipe(stages);
  const std::string path =
      group().rank_path(testing::TempDir() + "mpipe_dist_" + std::to_string(::getppid()) + ".pt");
  EXPECT_NE(path.find(".rank" + std::to_string(group().rank())), std::string::npos) << path;
  torch::save(pipe, path);
  auto other = make_pipe(make_model(group().pipeline_size(), 6, 99));
  torch::load(other, path);
  std::remove(path.c_str());
  torch::NoGradGuard no_grad;
  const at::Tensor x = input(5);
  const at::Tensor out = other->forward(x, 2);
  if (group().is_last()) expect_close(out, plain(stages, x), "after load");
}

// mpipe::JobCheckpoints across ranks: each rank saves its part; a job
// resumed on every rank ends bit for bit where the uninterrupted one does; a
// torn file on one rank makes every rank fall back to the checkpoint before.
TEST(Distributed, JobCheckpointsResumeEveryRankBitForBit) {
  const int64_t n = group().pipeline_size() * 2;  // two stages per rank
  const std::string dir = testing::TempDir() + "mpipe_job_" + std::to_string(::getppid());
  if (group().rank() == 0) mpipe_test::remove_tree(dir);
  group().barrier();
  struct Run {
    mpipe::ModelPipeline pipe;
    std::unique_ptr<torch::optim::Adam> opt;
    std::unique_ptr<mpipe::JobCheckpoints> checkpoints;
    Run(const Stages& stages, const std::string& dir)
        : pipe(make_pipe(stages)),
          opt(std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-2))),
          checkpoints(std::make_unique<mpipe::JobCheckpoints>(dir, *pipe, *opt)) {}
    /// Step k (its batch from k alone); the loss on the last rank.
    double step(int64_t k) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + k);
      const auto x = torch::randn({8, 6}, gen, torch::kDouble);
      const auto y = torch::randn({8, 3}, gen, torch::kDouble);
      opt->zero_grad();
      const auto loss = pipe->train_step(x, y, mse, mpipe::TrainStepOptions(2));
      opt->step();
      return loss.defined() ? loss.item<double>() : 0.0;
    }
  };
  Run a(make_model(n), dir);
  std::vector<double> losses;
  for (int64_t k = 0; k < 6; ++k) {
    losses.push_back(a.step(k));
    if (k == 1 || k == 2) a.checkpoints->save(k + 1, "batch " + std::to_string(k + 1));
  }
  {
    Run b(make_model(n, 6, 99), dir);  // other weights: all of them come from the checkpoint
    const auto resumed = b.checkpoints->resume();
    ASSERT_TRUE(resumed.has_value());
    EXPECT_EQ(resumed->step, 3);
    EXPECT_EQ(resumed->data_position, "batch 3");
    for (int64_t k = resumed->step; k < 6; ++k) {
      EXPECT_EQ(b.step(k), losses[static_cast<size_t>(k)]) << "step " << k;
    }
    const auto want = a.pipe->parameters(), got = b.pipe->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t p = 0; p < got.size(); ++p) EXPECT_TRUE(torch::equal(got[p], want[p])) << p;
  }
  // The last rank's file of step 3 torn: every rank resumes from step 2.
  const std::string torn = dir + "/step-3/rank-" + std::to_string(group().world_size() - 1) + ".ckpt";
  if (group().rank() == group().world_size() - 1) {
    std::filesystem::resize_file(torn, std::filesystem::file_size(torn) / 3);
  }
  group().barrier();
  Run c(make_model(n, 6, 99), dir);
  const auto resumed = c.checkpoints->resume();
  ASSERT_TRUE(resumed.has_value());
  EXPECT_EQ(resumed->step, 2);
  ASSERT_EQ(resumed->skipped.size(), 1u);
  const std::string why = group().rank() == group().world_size() - 1
                              ? "rank " + std::to_string(group().rank()) + "'s file " + torn +
                                    ": it is truncated"
                              : "refused by another rank";
  EXPECT_NE(resumed->skipped[0].find(why), std::string::npos) << resumed->skipped[0];
  // The same stages placed in the V (stage_numbers) are another job: refused.
  {
    const auto mine = group().v_stages(n);
    mpipe::ModelPipeline vee(
        mpipe::ModelPipelineOptions().process_group(group()).stage_numbers(mine));
    const auto model = make_model(n);
    for (int64_t s : mine) vee->append(copy(model[static_cast<size_t>(s)]), "cpu");
    torch::optim::Adam opt(vee->parameters(), torch::optim::AdamOptions(1e-2));
    mpipe::JobCheckpoints v_checkpoints(dir, *vee, opt);
    try {
      v_checkpoints.resume();
      ADD_FAILURE() << "a checkpoint of the contiguous job resumed the V";
    } catch (const c10::Error& e) {
      // The placement is part of the job: "... where this job has ' stages [1, 4]; ..."
      const std::string want = c10::str("stages ", c10::ArrayRef<int64_t>(mine), ";");
      EXPECT_NE(std::string(e.what_without_backtrace()).find(want), std::string::npos)
          << e.what_without_backtrace();
    }
  }
  group().barrier();
  if (group().rank() == 0) mpipe_test::remove_tree(dir);
}

TEST(Distributed, ReplicasTrainLikeOneProcessOnTheWholeBatch) {
  if (group().replicas() == 1) GTEST_SKIP() << "needs --replicas=R > 1";
  const int64_t r = group().replicas();
  const auto stages = make_model(group().pipeline_size() + 1);
  auto reference = make_model(static_cast<int64_t>(stages.size()));
  auto pipe = make_pipe(stages);
  const at::Tensor x = input(6 * r);
  torch::manual_seed(4);
  const at::Tensor y = torch::randn({6 * r, 3}, torch::kDouble);
  const int64_t mine = group().replica();
  for (auto reduction : {mpipe::LossReduction::Mean, mpipe::LossReduction::Sum}) {
    for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& s : reference) s->zero_grad();
    const bool mean = reduction == mpipe::LossReduction::Mean;
    auto loss_fn = [mean](const at::Tensor& out, const at::Tensor& t) {
      return torch::mse_loss(out, t, mean ? at::Reduction::Mean : at::Reduction::Sum);
    };
    const at::Tensor loss = pipe->train_step(
        x.narrow(0, 6 * mine, 6), y.narrow(0, 6 * mine, 6), loss_fn,
        mpipe::TrainStepOptions(2).reduction(reduction).schedule(
            mpipe::Schedule::OneFOneB));
    const at::Tensor want = loss_fn(plain(reference, x), y);
    want.backward();
    if (group().is_last()) expect_close(loss, want.detach(), "replicated loss");
    expect_same_grads(pipe, reference, mean ? "replicas, mean" : "replicas, sum");
  }
}

// clip_grad_norm across ranks: each rank scales its own stages' gradients by
// the factor of the whole model's norm (replicas counted once), as
// torch::nn::utils::clip_grad_norm_ does with every gradient in one process.
TEST(Distributed, ClipGradNormSeesEveryRanksGradients) {
  const int64_t r = group().replicas();
  const auto stages = make_model(group().pipeline_size() + 2);
  auto reference = make_model(static_cast<int64_t>(stages.size()));
  auto pipe = make_pipe(stages);
  const at::Tensor x = input(4 * r);
  torch::manual_seed(5);
  const at::Tensor y = torch::randn({4 * r, 3}, torch::kDouble) * 10;
  const int64_t mine = group().replica();
  for (double norm_type : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    for (double max_norm : {1e-3, 1e6}) {  // clipped, and left alone
      SCOPED_TRACE("norm " + std::to_string(norm_type) + ", max " + std::to_string(max_norm));
      for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
      for (auto& s : reference) s->zero_grad();
      pipe->train_step(x.narrow(0, 4 * mine, 4), y.narrow(0, 4 * mine, 4), mse,
                       mpipe::TrainStepOptions(2));
      mse(plain(reference, x), y).backward();
      std::vector<at::Tensor> all;
      for (auto& s : reference) {
        for (auto& p : s->parameters()) all.push_back(p);
      }
      const double want = torch::nn::utils::clip_grad_norm_(all, max_norm, norm_type);
      const double got = mpipe::clip_grad_norm(*pipe, max_norm, norm_type);
      EXPECT_NEAR(got, want, 1e-9 * want) << "the norm before clipping";
      expect_same_grads(pipe, reference, "clipped gradients");
    }
  }
  // A group that is told a negative bound answers on every rank alike.
  EXPECT_THROW(mpipe::clip_grad_norm(*pipe, -1.0), c10::Error);
}

// One GPU: a world of one rank holding several stages on cuda:0 (the NCCL
// backend where the LibTorch has it) equals the same pipeline without a group.
TEST(Distributed, OneRankHoldsSeveralStagesOnTheGpu_CUDA) {
  if (static_cast<int64_t>(torch::cuda::device_count()) < 1) GTEST_SKIP() << "needs a CUDA device";
  if (group().world_size() != 1) GTEST_SKIP() << "a world of one rank";
  std::printf("backend: %s\n", mpipe::distributed::to_string(group().backend()));
  auto build = [](mpipe::ModelPipeline& pipe) {
    torch::manual_seed(31);
    for (int s = 0; s < 3; ++s) {
      auto m = mpipe_test::mlp_stage(8, 8, 1);
      m->to(torch::kDouble);
      pipe->append(m, "cuda:0");
    }
  };
  mpipe::ModelPipeline plain_pipe;
  build(plain_pipe);
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group()));
  build(pipe);
  torch::manual_seed(2);
  const at::Tensor x = torch::randn({12, 8}, torch::kDouble).cuda();
  const at::Tensor y = torch::randn({12, 8}, torch::kDouble).cuda();
  for (auto schedule : {mpipe::Schedule::OneFOneB, mpipe::Schedule::ZeroBubbleH1}) {
    const auto step = mpipe::TrainStepOptions(4).schedule(schedule);
    expect_close(pipe->train_step(x, y, mse, step), plain_pipe->train_step(x, y, mse, step),
                 "train_step loss");
  }
  expect_close(pipe->constant_train_step(x, 3, y, mse),
               plain_pipe->constant_train_step(x, 3, y, mse), "constant_train_step loss");
  for (size_t k = 0; k < pipe->size(); ++k) {
    const auto a = pipe->stage(k)->parameters(), b = plain_pipe->stage(k)->parameters();
    for (size_t p = 0; p < a.size(); ++p) expect_close(a[p].grad(), b[p].grad(), "gradient");
  }
  torch::NoGradGuard no_grad;
  expect_close(pipe->forward(x, 5), plain_pipe->forward(x, 5), "forward");
  expect_close(pipe->sequence_forward(x.view({3, 4, 8})),
               plain_pipe->sequence_forward(x.view({3, 4, 8})), "sequence_forward");
}

// Several GPUs: one rank per GPU (cuda:LOCAL_RANK), CUDA tensors between ranks
// over NCCL (--backend=nccl), against the same stages in one process on the
// CPU. Skipped with fewer GPUs than ranks (ctest distributed.nccl_MultiCUDA).
TEST(Distributed, StagesOnTheirOwnGpusOverNccl_MultiCUDA) {
  if (static_cast<int64_t>(torch::cuda::device_count()) < group().world_size()) GTEST_SKIP() << "one GPU per rank";
  if (group().backend() != mpipe::distributed::Backend::NCCL) GTEST_SKIP() << "--backend=nccl";
  const std::string device = "cuda:" + std::to_string(group().rank());
  const int64_t n = group().pipeline_size() + 1;
  const auto stages = make_model(n);
  auto reference = make_model(n);
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group()));
  const auto range = group().stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) {
    pipe->append(copy(stages[static_cast<size_t>(s)]), device);
  }
  const at::Tensor x = input(10);
  torch::manual_seed(3);
  const at::Tensor y = torch::randn({10, 3}, torch::kDouble);
  for (auto schedule : {mpipe::Schedule::OneFOneB, mpipe::Schedule::ZeroBubbleH1}) {
    for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& s : reference) s->zero_grad();
    const auto step = mpipe::TrainStepOptions(3).schedule(schedule);
    const at::Tensor loss = pipe->train_step(x.to(device), y.to(device), mse, step);
    const at::Tensor want = mse(plain(reference, x), y);
    want.backward();
    if (group().is_last()) expect_close(loss.cpu(), want.detach(), "loss over NCCL");
    const int64_t first = range.first;
    for (size_t k = 0; k < pipe->size(); ++k) {
      const auto got = pipe->stage(k)->parameters();
      const auto ref = reference[static_cast<size_t>(first) + k]->parameters();
      for (size_t p = 0; p < got.size(); ++p) {
        expect_close(got[p].grad().cpu(), ref[p].grad(), "gradient over NCCL");
      }
    }
  }
  torch::NoGradGuard no_grad;
  const at::Tensor out = pipe->forward(x.to(device), 4);
  if (group().is_last()) expect_close(out.cpu(), plain(reference, x), "forward over NCCL");
}

// The fault drills' stalled rank: it sleeps until the others have reported
// (each drill launch has a folder of its own, named by its port), so that a
// drill lasts no longer than its reports.
namespace {

std::string drill_dir() {
  const char* port = std::getenv("MASTER_PORT");
  return std::string("/tmp/mpipe-drill-") + (port ? port : "0");
}

/// The stalled rank: waits until every other rank has reported (or long
/// past the bound), then leaves without the group's teardown.
[[noreturn]] void stall_until_reported() {
  const auto until = std::chrono::steady_clock::now() + g_group.timeout() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < until) {
    int64_t reported = 0;
    for (int64_t r = 0; r < g_group.world_size(); ++r) {
      const std::string f = drill_dir() + "/done." + std::to_string(r);
      if (FILE* file = std::fopen(f.c_str(), "r")) {
        std::fclose(file);
        ++reported;
      }
    }
    if (reported >= g_group.world_size() - 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::printf("fault drill: the stalled rank leaves\n");
  std::fflush(stdout);
  std::_Exit(0);
}

/// The drills' short timeout bounds the rendezvous too: it starts once every
/// rank's process is up (LibTorch's start takes a second or more on a busy
/// machine, and ctest runs the drills side by side).
void wait_until_every_rank_started() {
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (!rank || !world) return;
  std::system(("mkdir -p " + drill_dir()).c_str());
  if (FILE* f = std::fopen((drill_dir() + "/started." + rank).c_str(), "w")) std::fclose(f);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < until) {
    int64_t started = 0;
    for (int64_t r = 0; r < std::atoll(world); ++r) {
      if (FILE* f = std::fopen((drill_dir() + "/started." + std::to_string(r)).c_str(), "r")) {
        std::fclose(f);
        ++started;
      }
    }
    if (started == std::atoll(world)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

/// Tells the stalled rank that this one has reported.
void report_done() {
  std::system(("mkdir -p " + drill_dir()).c_str());
  if (FILE* f = std::fopen((drill_dir() + "/done." + std::to_string(g_group.rank())).c_str(), "w")) {
    std::fclose(f);
  }
}

}  // namespace

// Fault drills: one launch each (tests/CMakeLists.txt) with a short timeout.
// MPIPE_TEST_FAULT=die|stall picks what the last rank does at its second
// micro-batch; the other ranks must fail within the timeout plus a few seconds.
TEST(Faults, ALostRankFailsTheOthers) {
  const char* fault = std::getenv("MPIPE_TEST_FAULT");
  if (!fault) GTEST_SKIP() << "set MPIPE_TEST_FAULT=die|stall";
  const std::string kind = fault;
  const int64_t n = group().pipeline_size();
  if (group().rank() == n - 1 && kind == "stall") std::system(("rm -rf " + drill_dir()).c_str());
  struct DrillImpl : torch::nn::Module {
    DrillImpl(bool armed, std::string kind) : armed(armed), kind(std::move(kind)) {
      fc = register_module("fc", torch::nn::Linear(6, 6));
      fc->to(torch::kDouble);
    }
    at::Tensor forward(const at::Tensor& x) {
      if (armed && ++seen == 2) {
        if (kind == "die") std::_Exit(0);  // 0: the launcher leaves the others to notice
        stall_until_reported();
      }
      return fc(x);
    }
    bool armed;
    std::string kind;
    int64_t seen = 0;
    torch::nn::Linear fc{nullptr};
  };
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group()));
  const auto range = group().stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) {
    pipe->append(std::make_shared<DrillImpl>(s == n - 1, kind), "cpu");
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    pipe->train_step(input(8), torch::zeros({8, 6}, torch::kDouble), mse,
                     mpipe::TrainStepOptions(2));
    ADD_FAILURE() << "the step should fail";
  } catch (const c10::Error& e) {
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("fault drill: failed after %.1f s: %s\n", took, e.what_without_backtrace());
    const std::string what = e.what_without_backtrace();
    EXPECT_NE(what.find("rank " + std::to_string(n - 1)), std::string::npos) << what;
    EXPECT_NE(what.find("stage"), std::string::npos) << what;
    EXPECT_NE(what.find("micro-batch"), std::string::npos) << what;
    EXPECT_LT(took, group().timeout().count() / 1000.0 + 5 + 0.5 * n) << what;
  }
  std::fflush(stdout);
  report_done();
  // The drill's rank is dead or asleep: leave without the group's teardown.
  std::_Exit(::testing::UnitTest::GetInstance()->current_test_info()->result()->Passed() ? 0 : 1);
}

// Fault bounds: run one drill per launch (tests/CMakeLists.txt) with a 2 s
// group timeout and 3 ranks. MPIPE_TEST_DRILL=<fault>:<where>:<rank>:
//  - fault stall: the rank stops (it sleeps until the others have reported,
//    then exits); where: before (the pipeline's first call), between (two
//    calls), forward, backward (of micro-batch or time step 1), loss;
//  - fault nostages (where: none): the rank appends no stage;
//  - fault late (where: none): the rank appends a stage after the first call;
//  - rank: first, middle or last; call: train (train_step, the default) or
//    constant (constant_train_step), as a fourth field.
// Every other rank must fail within the timeout + 5 s, with a message that
// names the faulty rank and never itself as the one late.
namespace {

struct Drill {
  std::string fault, where, call = "train";
  int64_t rank = -1;  // the faulty world rank
};

Drill drill_from_env() {
  Drill d;
  const char* v = std::getenv("MPIPE_TEST_DRILL");
  if (!v) return d;
  std::vector<std::string> parts;
  std::string cur;
  for (const char* c = v; *c; ++c) {
    if (*c == ':') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += *c;
    }
  }
  parts.push_back(cur);
  if (parts.size() < 3) return d;
  d.fault = parts[0];
  d.where = parts[1];
  const int64_t n = group().pipeline_size();
  d.rank = parts[2] == "first" ? 0 : parts[2] == "middle" ? n / 2 : n - 1;
  if (parts.size() > 3) d.call = parts[3];
  return d;
}

/// Linear, stalling in its forward or (through a hook) its backward of the
/// second item when armed.
struct StallingImpl : torch::nn::Module {
  explicit StallingImpl(std::string where) : where(std::move(where)) {
    fc = register_module("fc", torch::nn::Linear(6, 6));
    fc->to(torch::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    if (where == "forward" && ++seen == 2) stall_until_reported();
    at::Tensor out = fc(x);
    // The second forward that records a graph (a checkpointed one recomputes).
    if (where == "backward" && out.requires_grad() && ++seen == 2) {
      out.register_hook([](const at::Tensor& g) {
        stall_until_reported();
        return g;
      });
    }
    return out;
  }
  std::string where;  // "" when not armed
  int64_t seen = 0;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Stalling);

}  // namespace

TEST(Faults, EveryRankFailsWithinTheBoundNamingTheFaultyRank) {
  const Drill d = drill_from_env();
  if (d.fault.empty()) GTEST_SKIP() << "set MPIPE_TEST_DRILL=<fault>:<where>:<rank>[:<call>]";
  const int64_t me = group().rank();
  const bool faulty = me == d.rank;
  if (faulty && d.fault == "stall") std::system(("rm -rf " + drill_dir()).c_str());
  const int64_t n = group().pipeline_size();
  // ":v": the stages in the V, DualPipeV's train_step (rank 0 computes the loss).
  const bool vee = d.call == "v";
  std::vector<int64_t> numbers;
  if (vee) {
    numbers = group().v_stages(2 * n);
  } else {
    const auto range = group().stage_range(n);
    for (int64_t s = range.first; s < range.second; ++s) numbers.push_back(s);
  }
  auto options = mpipe::ModelPipelineOptions().process_group(group());
  if (vee) options.stage_numbers(numbers);
  mpipe::ModelPipeline pipe(options);
  if (!(d.fault == "nostages" && faulty)) {
    for (size_t k = 0; k < numbers.size(); ++k) {
      pipe->append(Stalling(faulty && d.fault == "stall" ? d.where : std::string()), "cpu");
    }
  }
  const int64_t rows = vee ? 4 * n : 4;  // DualPipeV: 2D micro-batches or more
  const at::Tensor x = input(rows);
  const at::Tensor y = torch::zeros({rows, 6}, torch::kDouble);
  auto loss_fn = [&](const at::Tensor& out, const at::Tensor& target) {
    if (faulty && d.fault == "stall" && d.where == "loss") stall_until_reported();
    return mse(out, target);
  };
  auto call = [&] {
    if (d.call == "constant") {
      pipe->constant_train_step(x, 3, y, loss_fn);
    } else if (vee) {
      pipe->train_step(x, y, loss_fn,
                       mpipe::TrainStepOptions(1).schedule(mpipe::Schedule::DualPipeV));
    } else {
      pipe->train_step(x, y, loss_fn, mpipe::TrainStepOptions(2));
    }
  };
  const bool first_call_fails = d.where == "before" || d.fault == "nostages";
  if (!first_call_fails) {
    // A call that succeeds, after which the fault comes (between calls, late
    // appends); the stalls inside a call arm only from the second call on.
    const bool inside = d.where == "forward" || d.where == "backward" || d.where == "loss";
    if (!inside) call();
  }
  if (faulty && d.fault == "stall" && (d.where == "before" || d.where == "between")) {
    stall_until_reported();
  }
  if (faulty && d.fault == "late") pipe->append(Stalling(std::string()), "cpu");
  const auto start = std::chrono::steady_clock::now();
  try {
    call();
    ADD_FAILURE() << "the call should fail on rank " << me;
  } catch (const c10::Error& e) {
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string what = e.what_without_backtrace();
    std::printf("fault drill: rank %lld failed after %.1f s: %s\n", static_cast<long long>(me),
                took, what.c_str());
    const std::string bad = "rank " + std::to_string(d.rank);
    EXPECT_NE(what.find(bad), std::string::npos) << "the message should name " << bad;
    if (!faulty) {  // nor itself, nor a bystander
      EXPECT_EQ(bystander_named(what, d.rank, group().world_size()), -1) << what;
    }
    const double timeout_s = group().timeout().count() / 1000.0;
    EXPECT_LT(took, timeout_s + 5) << what;
    // Inside or between calls, the receive that gave up names the stalled
    // rank, and nobody waits for its answer after that (Note [Ending a call]):
    // well under the documented bound (timeout + 0.5 s per rank + 2 s).
    if (d.fault == "stall" && d.where != "before" && !faulty) {
      EXPECT_LT(took, timeout_s + 0.5 * static_cast<double>(n) + 1) << what;
    }
  }
  std::fflush(stdout);
  const bool passed = ::testing::UnitTest::GetInstance()->current_test_info()->result()->Passed();
  if (d.fault != "stall") return;  // the group is whole: the closing barrier follows
  // Tell the stalled rank, then leave without the group's teardown.
  report_done();
  std::_Exit(passed ? 0 : 1);
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int64_t replicas = 1;
  double timeout_s = 60;
  auto backend = mpipe::distributed::Backend::Gloo;  // CPU tests: the GPU one asks for Auto
  int64_t require_gpus = 0;
  for (int k = 1; k < argc; ++k) {
    const std::string a = argv[k];
    if (a.rfind("--replicas=", 0) == 0) replicas = std::stoll(a.substr(11));
    if (a.rfind("--timeout=", 0) == 0) timeout_s = std::stod(a.substr(10));
    if (a == "--backend=nccl") backend = mpipe::distributed::Backend::NCCL;
    if (a == "--backend=gloo") backend = mpipe::distributed::Backend::Gloo;
    if (a == "--backend=auto") backend = mpipe::distributed::Backend::Auto;
    if (a.rfind("--require-gpus=", 0) == 0) require_gpus = std::stoll(a.substr(15));
  }
  if (static_cast<int64_t>(torch::cuda::device_count()) < require_gpus) {  // ctest counts exit 77 as skipped
    std::printf("needs %lld GPU(s), %lld visible: skipping\n",
                static_cast<long long>(require_gpus),
                static_cast<long long>(torch::cuda::device_count()));
    return 77;
  }
  if (!mpipe::distributed::available()) {
    std::printf("mpipe was built without c10d: nothing to test\n");
    return 77;  // skipped
  }
  if (std::getenv("MPIPE_TEST_DRILL") || std::getenv("MPIPE_TEST_FAULT")) {
    wait_until_every_rank_started();
  }
  g_group = mpipe::distributed::init_from_env(
      mpipe::distributed::GroupOptions().replicas(replicas).backend(backend).timeout(
          std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))));
  std::printf("rank %lld of %lld: pipeline rank %lld of %lld, replica %lld of %lld\n",
              static_cast<long long>(g_group.rank()), static_cast<long long>(g_group.world_size()),
              static_cast<long long>(g_group.pipeline_rank()),
              static_cast<long long>(g_group.pipeline_size()),
              static_cast<long long>(g_group.replica()), static_cast<long long>(g_group.replicas()));
  const int rc = RUN_ALL_TESTS();
  try {
    g_group.barrier();  // nobody tears the group down while another still uses it
  } catch (const std::exception& e) {
    std::printf("the closing barrier failed: %s\n", e.what());
    return 1;
  }
  g_group = {};  // torn down here, not among the static destructors
  std::printf("rank teardown done\n");
  return rc;
}
