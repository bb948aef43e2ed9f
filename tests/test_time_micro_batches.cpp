// Time-step calls over micro-batches and time chunks at once (Note
// [Micro-batches over time]): constant_forward, sequence_forward and
// constant_train_step with a micro-batch split, against a plain loop that
// runs each micro-batch for T steps (values and gradients, tolerance 0),
// threaded and inline, single-step stages and every chunk size; the items'
// order and micro-batches as the stages see them; errors.

#include "common.h"

#include <mpipe/snn.h>

#include <optional>

using namespace mpipe_test;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;
using mpipe::Split;
using mpipe::snn::IFNode;
using mpipe::snn::IFNodeOptions;
using mpipe::snn::LIFNode;
using mpipe::snn::LIFNodeOptions;
using mpipe::snn::SeqToANN;
using mpipe::snn::StepMode;

namespace {

/// x minus half its mean over the batch rows (dim -2): a layer whose result
/// depends on the rows it sees, so a micro-batch's result differs from the
/// whole batch's, as with batch statistics.
struct BatchCentreImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x - x.mean(-2, true) * 0.5; }
};
TORCH_MODULE(BatchCentre);

/// Three stages of Linear + LIF (the last Linear + IF; the second centres
/// its rows first), single-step and multi-step, sharing the Linear layers.
struct Stages {
  std::vector<torch::nn::Linear> fc;
  std::vector<torch::nn::Sequential> single, multi;
  explicit Stages(int64_t width = 8) {
    torch::manual_seed(41);
    for (int s = 0; s < 3; ++s) {
      fc.emplace_back(torch::nn::Linear(width, width));
      fc.back()->to(torch::kDouble);
      auto neuron = [&](StepMode mode) -> torch::nn::AnyModule {
        if (s == 2) return torch::nn::AnyModule(IFNode(IFNodeOptions().v_threshold(0.5).step_mode(mode)));
        return torch::nn::AnyModule(
            LIFNode(LIFNodeOptions().v_threshold(0.2).v_reset(std::nullopt).step_mode(mode)));
      };
      single.emplace_back(torch::nn::Sequential(fc.back()));
      multi.emplace_back(torch::nn::Sequential(SeqToANN(fc.back())));
      if (s == 1) {
        single.back()->push_back(BatchCentre());
        multi.back()->push_back(BatchCentre());
      }
      single.back()->push_back(neuron(StepMode::Single));
      multi.back()->push_back(neuron(StepMode::Multi));
    }
  }
  /// k = 0: single-step stages; else multi-step.
  const std::vector<torch::nn::Sequential>& of(int64_t k) const { return k == 0 ? single : multi; }
  ModelPipeline pipeline(int64_t k, ModelPipelineOptions options = {}) const {
    ModelPipeline pipe(options);
    for (const auto& stage : of(k)) pipe->append(stage, "cpu");
    return pipe;
  }
  std::map<std::string, torch::Tensor> grads() const {
    std::map<std::string, torch::Tensor> g;
    for (size_t s = 0; s < fc.size(); ++s) {
      for (const auto& kv : grads_of(*fc[s])) g[std::to_string(s) + "." + kv.first] = kv.second;
    }
    return g;
  }
  void zero() {
    for (auto& l : fc) zero_grads(*l);
  }
};

/// The plain loop a user writes: micro-batch m (`rows` rows of x along the
/// batch dimension, dim 1 of a sequence) runs for T steps through `stages`
/// under MicroBatchGuard{m, M}, in chunks of k steps (k = 0: one step per
/// call); its steps summed one by one (reduce) or stacked, and the
/// micro-batches joined along the batch dimension.
torch::Tensor plain_loop(const std::vector<torch::nn::Sequential>& stages, int64_t k,
                         const torch::Tensor& x, bool sequence, int64_t T, bool reduce,
                         int64_t rows) {
  const int64_t batch_dim = sequence ? 1 : 0;
  const int64_t N = x.size(batch_dim);
  const int64_t M = (N + rows - 1) / rows;
  std::vector<torch::Tensor> per;
  for (int64_t m = 0; m < M; ++m) {
    mpipe::MicroBatchGuard guard({m, M});
    const torch::Tensor xm = x.narrow(batch_dim, m * rows, std::min(rows, N - m * rows));
    std::vector<torch::Tensor> steps;
    for (int64_t t0 = 0; t0 < T; t0 += std::max<int64_t>(k, 1)) {
      const int64_t kc = k == 0 ? 1 : std::min(k, T - t0);
      torch::Tensor h;
      if (k == 0) {
        h = sequence ? xm[t0] : xm;
      } else if (sequence) {
        h = xm.narrow(0, t0, kc);
      } else {
        std::vector<int64_t> shape{kc};
        for (auto d : xm.sizes()) shape.push_back(d);
        h = xm.unsqueeze(0).expand(shape);
      }
      for (auto stage : stages) h = stage->forward(h);
      if (k == 0) {
        steps.push_back(h);
      } else {
        for (int64_t q = 0; q < kc; ++q) steps.push_back(h[q]);
      }
    }
    if (reduce) {
      torch::Tensor acc = steps[0];
      for (size_t t = 1; t < steps.size(); ++t) acc = acc + steps[t];
      per.push_back(acc);
    } else {
      per.push_back(torch::stack(steps));
    }
  }
  if (reduce) return torch::cat(per, 0);
  const torch::Tensor joined = torch::cat(per, 1);
  return sequence ? joined : joined.flatten(0, 1);
}

/// Rows to feed the stages, a target for the summed spikes, drawn with `seed`.
struct Problem {
  torch::Tensor x, target;
  Problem(int64_t rows, uint64_t seed) {
    torch::manual_seed(seed);
    x = torch::rand({rows, 8}, torch::kDouble) * 1.5;
    target = torch::rand({rows, 8}, torch::kDouble);
  }
};

/// The tests' loss: mean squared error.
torch::Tensor squared_error(const torch::Tensor& out, const torch::Tensor& y) {
  return (out - y).pow(2).mean();
}

/// Rows per micro-batch of `split` for a batch of N (as the pipeline reads it).
int64_t rows_of(const Split& split, int64_t N) {
  return split.by_count() ? (N - 1) / split.value() + 1 : split.value();
}

std::string describe(int64_t k, const Split& split, bool threads) {
  return "chunk " + std::to_string(k) + " " + (split.by_count() ? "chunks" : "split_size") + " " +
         std::to_string(split.value()) + " threads=" + std::to_string(threads);
}

}  // namespace

TEST(TimeMicroBatches, ForwardCallsEqualAPlainLoopPerMicroBatch) {
  Stages st;
  const int64_t T = 6, N = 5;
  torch::manual_seed(42);
  const auto x = torch::rand({N, 8}, torch::kDouble) * 1.5;
  const auto seq = torch::rand({T, N, 8}, torch::kDouble) * 1.5;
  for (int64_t k : {0, 1, 4, 6}) {
    for (const Split& split : {Split(2), mpipe::chunks(2), mpipe::chunks(5), Split(9)}) {
      for (bool threads : {true, false}) {
        SCOPED_TRACE(describe(k, split, threads));
        const int64_t rows = rows_of(split, N);
        auto pipe = st.pipeline(k, ModelPipelineOptions().worker_threads(threads));
        const std::optional<int64_t> chunk = k == 0 ? std::nullopt : std::optional<int64_t>(k);
        for (bool reduce : {true, false}) {
          SCOPED_TRACE("reduce=" + std::to_string(reduce));
          // Twice without a reset: each micro-batch carries its own state on.
          std::vector<torch::Tensor> want, want_seq;
          for (int call = 0; call < 2; ++call) {
            want.push_back(plain_loop(st.of(k), k, x, false, T, reduce, rows));
          }
          mpipe::reset_states(*pipe);
          for (int call = 0; call < 2; ++call) {
            want_seq.push_back(plain_loop(st.of(k), k, seq, true, T, reduce, rows));
          }
          mpipe::reset_states(*pipe);
          ASSERT_GT(want[1].sum().item<double>(), 0.0) << "the test should make spikes";
          if (rows < N) {
            const auto whole = plain_loop(st.of(k), k, x, false, T, reduce, N);
            mpipe::reset_states(*pipe);
            EXPECT_FALSE(torch::equal(whole, want[0])) << "micro-batches must show in the result";
          }
          for (int call = 0; call < 2; ++call) {
            expect_close(pipe->constant_forward(x, T, reduce, chunk, split), want[call], 0.0,
                         "constant_forward, call " + std::to_string(call));
          }
          mpipe::reset_states(*pipe);
          for (int call = 0; call < 2; ++call) {
            expect_close(pipe->sequence_forward(seq, reduce, chunk, split), want_seq[call], 0.0,
                         "sequence_forward, call " + std::to_string(call));
          }
          mpipe::reset_states(*pipe);
        }
      }
    }
  }
  // The options give the default split.
  auto by_options = st.pipeline(0, ModelPipelineOptions().time_micro_batches(2));
  const auto want = plain_loop(st.single, 0, x, false, T, true, 3);
  mpipe::reset_states(*by_options);
  expect_close(by_options->constant_forward(x, T), want, 0.0, "time_micro_batches(2)");
}

TEST(TimeMicroBatches, ConstantTrainStepEqualsAPlainLoopPerMicroBatch) {
  Stages st;
  const int64_t T = 5, N = 7;
  const Problem problem(N, 43);
  const torch::Tensor &x = problem.x, &target = problem.target;
  const mpipe::LossFunction loss_fn = squared_error;
  for (int64_t k : {0, 1, 2, 5}) {
    for (const Split& split : {Split(3), mpipe::chunks(2), mpipe::chunks(7), Split(7)}) {
      const int64_t rows = rows_of(split, N);
      // The plain loop, its loss on every micro-batch's sum joined.
      auto pipe = st.pipeline(k);
      mpipe::reset_states(*pipe);
      st.zero();
      auto xr = x.clone().requires_grad_();
      const auto loss_ref = loss_fn(plain_loop(st.of(k), k, xr, false, T, true, rows), target);
      loss_ref.backward();
      mpipe::reset_states(*pipe);
      const auto grads_ref = st.grads();
      const auto x_grad_ref = xr.grad().clone();
      for (const auto& kv : grads_ref) {
        ASSERT_TRUE(kv.second.defined() && kv.second.abs().sum().item<double>() > 0.0)
            << "no gradient reached " << kv.first;
      }
      if (rows < N) {
        st.zero();
        const auto whole = loss_fn(plain_loop(st.of(k), k, x, false, T, true, N), target);
        mpipe::reset_states(*pipe);
        EXPECT_NE(whole.item<double>(), loss_ref.item<double>())
            << "micro-batches must show in the loss";
      }
      for (bool threads : {true, false}) {
       for (auto checkpoint : {mpipe::Checkpoint::Never, mpipe::Checkpoint::ExceptLast,
                               mpipe::Checkpoint::Always}) {
        SCOPED_TRACE(describe(k, split, threads) +
                     " checkpoint=" + std::to_string(static_cast<int>(checkpoint)));
        auto p = st.pipeline(k, ModelPipelineOptions().worker_threads(threads).checkpoint(checkpoint));
        st.zero();
        auto xp = x.clone().requires_grad_();
        const std::optional<int64_t> chunk = k == 0 ? std::nullopt : std::optional<int64_t>(k);
        const auto loss = p->constant_train_step(xp, T, target, loss_fn, chunk, split);
        expect_close(loss, loss_ref, 0.0, "loss");
        expect_same_grads(st.grads(), grads_ref, 0.0);
        expect_close(xp.grad(), x_grad_ref, 0.0, "gradient of x");
       }
      }
    }
  }
}

namespace {
/// Records the micro-batch and the rows of each call, then passes x on.
struct SeenImpl : torch::nn::Module {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> calls;  // index, count, rows
  int64_t fail_at = -1;                                      // a call number; -1: never
  torch::Tensor forward(const torch::Tensor& x) {
    const auto mb = mpipe::current_micro_batch();
    calls.emplace_back(mb.index, mb.count, x.size(-2));
    TORCH_CHECK(static_cast<int64_t>(calls.size()) - 1 != fail_at, "probe failure at call ",
                fail_at);
    return x * 2;
  }
};
TORCH_MODULE(Seen);
}  // namespace

TEST(TimeMicroBatches, ItemsRunEachMicroBatchsChunksInOrderUnderItsOwnIndex) {
  Stages st;
  Seen seen;
  auto pipe = st.pipeline(2);
  pipe->append(torch::nn::Sequential(seen), "cpu");
  const auto x = torch::rand({5, 8}, torch::kDouble);
  pipe->constant_forward(x, 5, true, 2, Split(2));
  // 3 micro-batches (2, 2, 1 rows) of 3 chunks (2, 2, 1 steps): micro-batch
  // after micro-batch, each chunk after chunk.
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> want{
      {0, 3, 2}, {0, 3, 2}, {0, 3, 2}, {1, 3, 2}, {1, 3, 2}, {1, 3, 2}, {2, 3, 1}, {2, 3, 1}, {2, 3, 1}};
  EXPECT_EQ(seen->calls, want);
  // One micro-batch (the default on one device): index 0 of 1, all rows.
  seen->calls.clear();
  mpipe::reset_states(*pipe);
  pipe->constant_forward(x, 5, true, 5);
  ASSERT_EQ(seen->calls.size(), 1u);
  EXPECT_EQ(seen->calls[0], std::make_tuple(int64_t{0}, int64_t{1}, int64_t{5}));
}

TEST(TimeMicroBatches, ErrorsNameTheMicroBatchAndStepsAndThePipelineStaysUsable) {
  Stages st;
  Seen seen;
  auto pipe = st.pipeline(0);
  pipe->append(torch::nn::Sequential(seen), "cpu");
  const auto x = torch::rand({5, 8}, torch::kDouble);
  const auto good = pipe->constant_forward(x, 4, true, std::nullopt, mpipe::chunks(2));
  mpipe::reset_states(*pipe);
  seen->calls.clear();
  seen->fail_at = 6;  // micro-batch 1, step 2
  for (bool threads : {true, false}) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    auto p = st.pipeline(0, ModelPipelineOptions().worker_threads(threads));
    p->append(torch::nn::Sequential(seen), "cpu");
    seen->calls.clear();
    MPIPE_EXPECT_ERROR(p->constant_forward(x, 4, true, std::nullopt, mpipe::chunks(2)),
                       "constant_forward", "stage 3", "item 6 of 8",
                       "micro-batch 1 of 2, time step 2 of 4", "probe failure at call 6");
    seen->calls.clear();
    auto loss_fn = [](const torch::Tensor& out, const torch::Tensor&) { return out.mean(); };
    MPIPE_EXPECT_ERROR(p->constant_train_step(x, 4, torch::Tensor(), loss_fn, std::nullopt, Split(3)),
                       "constant_train_step", "stage 3", "item 6 of 8",
                       "micro-batch 1 of 2, time step 2 of 4");
  }
  seen->fail_at = -1;
  seen->calls.clear();
  EXPECT_FALSE(st.single[0]->children()[1]->as<LIFNode>()->holds_state())
      << "a failed call leaves the state it found";
  expect_close(pipe->constant_forward(x, 4, true, std::nullopt, mpipe::chunks(2)), good, 0.0,
               "after the errors");
  mpipe::reset_states(*pipe);

  MPIPE_EXPECT_ERROR(pipe->constant_forward(x, 4, true, std::nullopt, Split(0)),
                     "constant_forward", "split_size must be positive, got 0");
  MPIPE_EXPECT_ERROR(pipe->sequence_forward(torch::rand({3, 5, 8}, torch::kDouble), false,
                                            std::nullopt, mpipe::chunks(-2)),
                     "sequence_forward", "chunks must be positive, got -2");
  auto bad = st.pipeline(0, ModelPipelineOptions().time_micro_batches(-1));
  MPIPE_EXPECT_ERROR(bad->constant_forward(x, 4), "ModelPipelineOptions::time_micro_batches",
                     "got -1");
  // A split with no batched input to cut; the options' default leaves such a
  // call whole.
  MPIPE_EXPECT_ERROR(pipe->constant_forward({mpipe::unbatched(x)}, 4, true, std::nullopt, Split(2)),
                     "constant_forward", "needs a batched input");
  mpipe::reset_states(*pipe);
  auto by_options = st.pipeline(0, ModelPipelineOptions().time_micro_batches(2));
  EXPECT_EQ(by_options->constant_forward({mpipe::unbatched(x)}, 4)[0].size(0), 5);
}

// On the GPU (stages on cuda:0, streams): eager and from CUDA graphs, whose
// third call of a kind is a replay (the host stage is not called).
TEST(TimeMicroBatches, EqualAPlainLoopOnTheGpuEagerAndGraphed_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  Stages st(64);
  for (auto& fc : st.fc) fc->to(torch::kCUDA);
  const int64_t T = 8, N = 32;
  torch::manual_seed(44);
  const auto opts = torch::TensorOptions(torch::kCUDA).dtype(torch::kDouble);
  const auto x = torch::rand({N, 64}, opts) * 1.5;
  const auto target = torch::rand({N, 64}, opts);
  const mpipe::LossFunction loss_fn = squared_error;
  for (bool graphs : {false, true}) {
    HostCalls counting;
    ModelPipeline pipe(ModelPipelineOptions().cuda_graphs(graphs));
    for (const auto& stage : st.multi) pipe->append(stage, "cuda:0");
    pipe->append(torch::nn::Sequential(counting), "cuda:0");
    for (const auto& ks : std::vector<std::pair<int64_t, Split>>{
             {8, mpipe::chunks(4)}, {2, Split(8)}, {3, mpipe::chunks(2)}}) {
      const int64_t k = ks.first, rows = rows_of(ks.second, N);
      SCOPED_TRACE("cuda_graphs=" + std::to_string(graphs) + " " + describe(k, ks.second, true));
      torch::Tensor want;
      {
        torch::NoGradGuard no_grad;
        want = plain_loop(st.multi, k, x, false, T, true, rows);
        mpipe::reset_states(*pipe);
        ASSERT_GT(want.sum().item<double>(), 0.0) << "the test should make spikes";
        int64_t calls = 0;
        for (int rep = 0; rep < 3; ++rep) {
          if (rep == 2) calls = counting->calls;
          expect_close(pipe->constant_forward(x, T, true, k, ks.second), want, 1e-12, "spikes");
          mpipe::reset_states(*pipe);
        }
        if (graphs) EXPECT_EQ(counting->calls, calls) << "the third call must be a replay";
      }
      st.zero();
      const auto loss_ref = loss_fn(plain_loop(st.multi, k, x, false, T, true, rows), target);
      loss_ref.backward();
      mpipe::reset_states(*pipe);
      const auto grads_ref = st.grads();
      for (int rep = 0; rep < 3; ++rep) {
        st.zero();
        expect_close(pipe->constant_train_step(x, T, target, loss_fn, k, ks.second), loss_ref,
                     1e-12, "loss");
        expect_same_grads(st.grads(), grads_ref, 1e-12);
      }
    }
  }
}

namespace {
/// Counts its calls, and those made while recomputing; passes x on.
struct RecountImpl : torch::nn::Module {
  int64_t calls = 0, recomputes = 0;
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    recomputes += mpipe::is_recomputing();
    return x;
  }
};
TORCH_MODULE(Recount);
}  // namespace

// Note [Checkpointed time steps]: a checkpointed micro-batch runs its chunks
// again once, on every stage but the last; dropout draws the same masks, so
// the step equals the one without checkpointing.
TEST(TimeMicroBatches, CheckpointingRecomputesEachMicroBatchOnceOnEveryStageButTheLast) {
  Stages st;
  const int64_t T = 6, N = 6;
  const Problem problem(N, 45);
  const torch::Tensor &x = problem.x, &target = problem.target;
  const mpipe::LossFunction loss_fn = squared_error;
  struct Run {
    torch::Tensor loss, x_grad;
    std::map<std::string, torch::Tensor> grads;
    int64_t calls[2], recomputes[2];
  };
  auto run = [&](mpipe::Checkpoint checkpoint, bool threads) {
    Recount middle, last;
    ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads).checkpoint(checkpoint));
    // The stages' modules, and one more.
    auto with = [](const torch::nn::Sequential& base, torch::nn::AnyModule extra) {
      torch::nn::Sequential seq;
      for (const auto& m : *base) seq->push_back(m);
      seq->push_back(std::move(extra));
      return seq;
    };
    pipe->append(with(st.multi[0], torch::nn::AnyModule(SeqToANN(torch::nn::Dropout(0.3)))), "cpu");
    pipe->append(with(st.multi[1], torch::nn::AnyModule(middle)), "cpu");
    pipe->append(with(st.multi[2], torch::nn::AnyModule(last)), "cpu");
    st.zero();
    auto xg = x.clone().requires_grad_();
    Run r;
    r.loss = pipe->constant_train_step(xg, T, target, loss_fn, 2, mpipe::chunks(3));
    r.x_grad = xg.grad();
    r.grads = st.grads();
    r.calls[0] = middle->calls;
    r.calls[1] = last->calls;
    r.recomputes[0] = middle->recomputes;
    r.recomputes[1] = last->recomputes;
    return r;
  };
  for (bool threads : {true, false}) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    torch::manual_seed(46);
    const Run never = run(mpipe::Checkpoint::Never, threads);
    EXPECT_EQ(never.calls[0], 9) << "3 micro-batches x 3 chunks";
    EXPECT_EQ(never.recomputes[0], 0);
    for (auto checkpoint : {mpipe::Checkpoint::ExceptLast, mpipe::Checkpoint::Always}) {
      const bool all = checkpoint == mpipe::Checkpoint::Always;
      SCOPED_TRACE(all ? "Always" : "ExceptLast");
      torch::manual_seed(46);  // the same seed: the same dropout masks
      const Run got = run(checkpoint, threads);
      EXPECT_EQ(got.recomputes[0], all ? 9 : 6) << "each checkpointed micro-batch's 3 chunks, once";
      EXPECT_EQ(got.calls[0], 9 + got.recomputes[0]);
      EXPECT_EQ(got.calls[1], 9) << "the last stage is not checkpointed";
      EXPECT_EQ(got.recomputes[1], 0);
      expect_close(got.loss, never.loss, 0.0, "loss");
      expect_same_grads(got.grads, never.grads, 0.0);
      expect_close(got.x_grad, never.x_grad, 0.0, "gradient of x");
    }
  }
  // A stateful module that cannot save its state cannot be recomputed.
  ModelPipeline pipe(ModelPipelineOptions().checkpoint(mpipe::Checkpoint::Always));
  Leaky leaky(8);
  leaky->snapshots = false;
  leaky->to(torch::kDouble);
  pipe->append(leaky, "cpu");
  pipe->append(st.single[2], "cpu");
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, T, target, loss_fn),
                     "constant_train_step", "stage 0 holds a stateful module without state snapshots");
  // ...only where it would be recomputed: not on the last stage, and not with
  // ExceptLast and one micro-batch.
  ModelPipeline last(ModelPipelineOptions().checkpoint(mpipe::Checkpoint::Always));
  last->append(st.single[0], "cpu");
  last->append(leaky, "cpu");
  EXPECT_TRUE(last->constant_train_step(x, T, target, loss_fn).defined());
  pipe->options.checkpoint(mpipe::Checkpoint::ExceptLast);
  EXPECT_TRUE(pipe->constant_train_step(x, T, target, loss_fn).defined());
  MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, T, target, loss_fn, std::nullopt, Split(3)),
                     "stage 0 holds a stateful module without state snapshots");
}

namespace {
/// Stashes its input for a later stage (Note [Skip connections]).
struct StashImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    mpipe::stash("skip", x);
    return x;
  }
};
TORCH_MODULE(Stash);
/// Adds half of what an earlier stage stashed.
struct PopAddImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x + mpipe::pop("skip") * 0.5; }
};
TORCH_MODULE(PopAdd);
}  // namespace

// A skip connection from stage 0 to stage 2 in constant_train_step: one item
// (threaded, inline and recorded) and micro-batches x chunks with and without
// checkpointing, all against the plain loop.
TEST(TimeMicroBatches, SkipConnectionsInEveryTrainingStepFormEqualThePlainLoop) {
  Stages st;
  const int64_t T = 4, N = 5;
  const Problem problem(N, 47);
  const torch::Tensor &x = problem.x, &target = problem.target;
  const mpipe::LossFunction loss_fn = squared_error;
  auto join = [](std::vector<torch::nn::AnyModule> front, const torch::nn::Sequential& base,
                 std::vector<torch::nn::AnyModule> back) {
    torch::nn::Sequential seq;
    for (auto& m : front) seq->push_back(m);
    for (const auto& m : *base) seq->push_back(m);
    for (auto& m : back) seq->push_back(m);
    return seq;
  };
  Stash stash;
  PopAdd pop_add;
  const std::vector<torch::nn::Sequential> stages{
      join({}, st.multi[0], {torch::nn::AnyModule(stash)}), join({}, st.multi[1], {}),
      join({torch::nn::AnyModule(pop_add)}, st.multi[2], {})};
  struct Form {
    std::string name;
    int64_t k;
    Split split;
    ModelPipelineOptions options;
  };
  const std::vector<Form> forms{
      {"one item", T, Split(N), ModelPipelineOptions()},
      {"one item, inline", T, Split(N), ModelPipelineOptions().worker_threads(false)},
      {"one item, recorded", T, Split(N), ModelPipelineOptions().record_timeline(true)},
      {"2 rows x 2 steps", 2, Split(2), ModelPipelineOptions()},
      {"2 rows x 2 steps, inline", 2, Split(2), ModelPipelineOptions().worker_threads(false)},
      {"2 rows x 2 steps, checkpointed", 2, Split(2),
       ModelPipelineOptions().checkpoint(mpipe::Checkpoint::Always)},
      {"2 micro-batches x 4 steps, checkpointed", T, mpipe::chunks(2),
       ModelPipelineOptions().checkpoint(mpipe::Checkpoint::Always)}};
  for (const auto& form : forms) {
    SCOPED_TRACE(form.name);
    const int64_t rows = rows_of(form.split, N);
    st.zero();
    auto xr = x.clone().requires_grad_();
    const auto loss_ref = loss_fn(plain_loop(stages, form.k, xr, false, T, true, rows), target);
    loss_ref.backward();
    for (auto s : stages) mpipe::reset_states(*s);
    const auto grads_ref = st.grads();
    const auto x_grad_ref = xr.grad().clone();
    ModelPipeline pipe(form.options);
    for (const auto& s : stages) pipe->append(s, "cpu");
    st.zero();
    auto xp = x.clone().requires_grad_();
    const auto loss = pipe->constant_train_step(xp, T, target, loss_fn, form.k, form.split);
    expect_close(loss, loss_ref, 0.0, "loss");
    expect_same_grads(st.grads(), grads_ref, 0.0);
    expect_close(xp.grad(), x_grad_ref, 0.0, "gradient of x");
  }
}

namespace {
/// Fails at its first call while recomputing.
struct FailRecomputeImpl : torch::nn::Module {
  bool armed = true;
  torch::Tensor forward(const torch::Tensor& x) {
    TORCH_CHECK(!(armed && mpipe::is_recomputing()), "probe failure in the recompute");
    return x;
  }
};
TORCH_MODULE(FailRecompute);
}  // namespace

// A failure in a checkpointed micro-batch's recompute names the item that
// failed (the micro-batch's first, recomputed at its last item's backward),
// and the pipeline stays usable.
TEST(TimeMicroBatches, ARecomputeFailureNamesItsOwnItem) {
  Stages st;
  FailRecompute probe;
  for (bool threads : {true, false}) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    probe->armed = true;
    ModelPipeline pipe(
        ModelPipelineOptions().worker_threads(threads).checkpoint(mpipe::Checkpoint::Always));
    pipe->append(st.single[0], "cpu");
    torch::nn::Sequential middle;
    for (const auto& m : *st.single[1]) middle->push_back(m);
    middle->push_back(probe);
    pipe->append(middle, "cpu");
    pipe->append(st.single[2], "cpu");
    const auto x = torch::rand({4, 8}, torch::kDouble);
    auto loss_fn = [](const torch::Tensor& out, const torch::Tensor&) { return out.mean(); };
    MPIPE_EXPECT_ERROR(pipe->constant_train_step(x, 4, torch::Tensor(), loss_fn, std::nullopt,
                                                 mpipe::chunks(2)),
                       "constant_train_step", "stage 1", "recompute of item 4 of 8",
                       "micro-batch 1 of 2, time step 0 of 4", "probe failure in the recompute");
    probe->armed = false;
    EXPECT_TRUE(pipe->constant_train_step(x, 4, torch::Tensor(), loss_fn, std::nullopt,
                                          mpipe::chunks(2))
                    .defined());
  }
}
