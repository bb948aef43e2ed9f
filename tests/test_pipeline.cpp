// CPU tests of mpipe::ModelPipeline: transparency (outputs and gradients equal
// the plain model), constant_forward semantics, registration, serialization,
// and every bad input (device spellings: test_devices.cpp). Each runs with and without worker threads.

#include "common.h"

#include <sstream>

using namespace mpipe_test;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;

namespace {

class Pipeline : public ::testing::TestWithParam<bool> {
 protected:
  ModelPipeline make() { return ModelPipeline(ModelPipelineOptions().worker_threads(GetParam())); }
};

std::string threads_name(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "Threads" : "Inline";
}

std::vector<torch::nn::Sequential> mlp_stages(int64_t n, int64_t width) {
  std::vector<torch::nn::Sequential> stages;
  for (int64_t i = 0; i < n; ++i) stages.push_back(mlp_stage(width, width));
  for (auto& s : stages) s->to(torch::kDouble);
  return stages;
}

}  // namespace

TEST_P(Pipeline, ForwardMatchesPlainModel) {
  torch::manual_seed(0);
  const int64_t width = 6, batch = 10;
  for (int64_t n_stages : {1, 2, 3, 5}) {
    auto stages = mlp_stages(n_stages, width);
    auto pipe = make();
    for (auto& s : stages) pipe->append(s, "cpu");
    std::vector<torch::Device> devices(stages.size(), torch::kCPU);
    for (int64_t split : {1, 3, 4, 7, 10, 16}) {
      SCOPED_TRACE("stages=" + std::to_string(n_stages) + " split=" + std::to_string(split));
      auto x = torch::randn({batch, width}, torch::kDouble);
      expect_transparent(
          *pipe, x, [&](const torch::Tensor& in) { return pipe->forward(in, split); },
          [&](const torch::Tensor& in) { return plain_forward(stages, devices, in); });
    }
  }
}

TEST_P(Pipeline, ForwardRunsEachMicroBatchOnceInOrderOnEveryStage) {
  auto pipe = make();
  std::vector<Recorder> recorders(3);
  for (auto& r : recorders) pipe->append(r, torch::kCPU);
  auto x = torch::arange(10, torch::kDouble).reshape({10, 1});
  auto y = pipe->forward(x, 3);  // micro-batches start at rows 0, 3, 6, 9
  expect_close(y, x, 0.0);
  for (auto& r : recorders) EXPECT_EQ(r->seen, (std::vector<double>{0, 3, 6, 9}));
}

TEST_P(Pipeline, ChunksCountMicroBatchesAsTorchChunkDoes) {
  auto pipe = make();
  std::vector<Recorder> recorders(3);
  for (auto& r : recorders) pipe->append(r, torch::kCPU);
  // (batch, chunks) -> the first row of each micro-batch: ceil(batch / n) rows each.
  const std::vector<std::tuple<int64_t, int64_t, std::vector<double>>> cases = {
      {10, 1, {0}},           {10, 2, {0, 5}},          {10, 4, {0, 3, 6, 9}},
      {10, 5, {0, 2, 4, 6, 8}}, {9, 4, {0, 3, 6}},       {3, 7, {0, 1, 2}},
      {10, 10, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}}};
  for (const auto& [batch, n, starts] : cases) {
    SCOPED_TRACE("batch " + std::to_string(batch) + ", chunks " + std::to_string(n));
    for (auto& r : recorders) r->seen.clear();
    auto x = torch::arange(batch, torch::kDouble).reshape({batch, 1});
    expect_close(pipe->forward(x, mpipe::chunks(n)), x, 0.0);
    for (auto& r : recorders) EXPECT_EQ(r->seen, starts);
    // The same split spelled as rows per micro-batch.
    for (auto& r : recorders) r->seen.clear();
    pipe->forward(x, (batch + n - 1) / n);
    for (auto& r : recorders) EXPECT_EQ(r->seen, starts);
  }
  auto x = torch::randn({4, 1}, torch::kDouble);
  MPIPE_EXPECT_ERROR(pipe->forward(x, mpipe::chunks(0)), "forward", "chunks must be positive, got 0");
  MPIPE_EXPECT_ERROR(pipe->forward({x}, mpipe::chunks(-2)), "chunks must be positive, got -2");
  EXPECT_EQ(pipe->forward(x, mpipe::chunks(2)).sizes(), x.sizes());  // still usable
}

TEST_P(Pipeline, ChunksAreTransparentLikeRows) {
  torch::manual_seed(3);
  auto stages = mlp_stages(3, 5);
  auto pipe = make();
  for (auto& s : stages) pipe->append(s, "cpu");
  std::vector<torch::Device> devices(stages.size(), torch::kCPU);
  for (int64_t n : {1, 2, 3, 4, 7, 11, 40}) {
    SCOPED_TRACE("chunks " + std::to_string(n));
    auto x = torch::randn({11, 5}, torch::kDouble);
    expect_transparent(
        *pipe, x, [&](const torch::Tensor& in) { return pipe->forward(in, mpipe::chunks(n)); },
        [&](const torch::Tensor& in) { return plain_forward(stages, devices, in); });
  }
}

TEST_P(Pipeline, ConstantForwardMatchesPlainLoopWithState) {
  torch::manual_seed(1);
  const int64_t width = 5;
  for (int64_t n_stages : {1, 2, 4}) {
    std::vector<Leaky> stages;
    for (int64_t i = 0; i < n_stages; ++i) stages.emplace_back(width, 0.3 + 0.1 * i);
    auto pipe = make();
    for (auto& s : stages) {
      s->to(torch::kDouble);
      pipe->append(s, "cpu");
    }
    auto reset = [&] {
      for (auto& s : stages) s->reset_state();
    };
    std::vector<torch::Device> devices(stages.size(), torch::kCPU);
    for (int64_t T : {int64_t{1}, int64_t{2}, n_stages, n_stages + 3}) {
      for (bool reduce : {true, false}) {
        SCOPED_TRACE("stages=" + std::to_string(n_stages) + " T=" + std::to_string(T) +
                     " reduce=" + std::to_string(reduce));
        auto x = torch::randn({3, width}, torch::kDouble);
        expect_transparent(
            *pipe, x,
            [&](const torch::Tensor& in) {
              reset();
              for (auto& s : stages) s->calls = 0;
              auto y = pipe->constant_forward(in, T, reduce);
              for (auto& s : stages) EXPECT_EQ(s->calls, T) << "each stage runs exactly T times";
              EXPECT_EQ(y.size(0), reduce ? 3 : 3 * T);
              return y;
            },
            [&](const torch::Tensor& in) {
              reset();
              std::vector<torch::Tensor> outs;
              for (int64_t t = 0; t < T; ++t) outs.push_back(plain_forward(stages, devices, in));
              return reduce ? torch::stack(outs).sum(0) : torch::cat(outs, 0);
            });
      }
    }
  }
}

TEST_P(Pipeline, ConstantForwardStageCallCountsAreExactlyT) {
  // The reference class runs stage k T + max(0, n - 2 - k) times; mpipe runs T.
  auto pipe = make();
  std::vector<Recorder> recorders(5);
  for (auto& r : recorders) pipe->append(r, "cpu");
  auto x = torch::ones({2, 2});
  auto y = pipe->constant_forward(x, 3, true);
  for (auto& r : recorders) EXPECT_EQ(r->seen.size(), 3u);
  expect_close(y, x * 3, 0.0);
}

TEST_P(Pipeline, ResetStateEachCallStartsEveryTimeStepCallFromRest) {
  torch::manual_seed(31);
  Leaky a(4, 0.6), b(4, 0.3);
  const auto x = torch::randn({3, 4});
  const auto seq = torch::randn({5, 3, 4});
  // The plain loops, from reset state.
  mpipe::reset_states(*a);
  mpipe::reset_states(*b);
  torch::Tensor plain_sum;
  for (int t = 0; t < 4; ++t) {
    auto y = b(a(x));
    plain_sum = plain_sum.defined() ? plain_sum + y : y;
  }
  mpipe::reset_states(*a);
  mpipe::reset_states(*b);
  std::vector<torch::Tensor> steps;
  for (int64_t t = 0; t < 5; ++t) steps.push_back(b(a(seq[t])));
  const auto plain_seq = torch::stack(steps);
  for (bool on : {false, true}) {
    SCOPED_TRACE(on ? "reset_state_each_call" : "state carried");
    auto pipe = ModelPipeline(
        ModelPipelineOptions().worker_threads(GetParam()).reset_state_each_call(on));
    pipe->append(a, "cpu").append(b, "cpu");
    mpipe::reset_states(*pipe);
    const auto first = pipe->constant_forward(x, 4);
    const auto second = pipe->constant_forward(x, 4);  // no reset in between
    expect_close(first, plain_sum, 0.0, "first call");
    if (on) {
      expect_close(second, plain_sum, 0.0, "second call");
      EXPECT_FALSE(a->state.slots().empty()) << "the call leaves its state for inspection";
    } else {
      EXPECT_FALSE(torch::equal(first, second)) << "state carried into the second call";
    }
    mpipe::reset_states(*pipe);
    pipe->sequence_forward(seq);
    const auto again = pipe->sequence_forward(seq);
    if (on) {
      expect_close(again, plain_seq, 0.0, "sequence_forward after another call");
    } else {
      EXPECT_FALSE(torch::equal(again, plain_seq));
    }
  }
}

TEST_P(Pipeline, GradModeAndInferenceModeReachTheStages) {
  auto pipe = make();
  pipe->append(mlp_stage(4, 4), "cpu").append(mlp_stage(4, 4), "cpu");
  auto x = torch::randn({6, 4});
  {
    torch::NoGradGuard no_grad;
    auto y = pipe->forward(x, 2);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_FALSE(pipe->constant_forward(x, 3).requires_grad());
  }
  {
    c10::InferenceMode guard;
    EXPECT_TRUE(pipe->forward(x, 2).is_inference());
  }
  EXPECT_TRUE(pipe->forward(x, 2).requires_grad());
}

TEST_P(Pipeline, StageErrorNamesStageAndItemAndPipelineStaysUsable) {
  auto pipe = make();
  Failing failing(/*fail_at=*/2);
  pipe->append(mlp_stage(3, 3), "cpu").append(failing, "cpu").append(mlp_stage(3, 3), "cpu");
  auto x = torch::randn({8, 3});
  MPIPE_EXPECT_ERROR(pipe->forward(x, 2), "stage 1", "micro-batch 2 of 4", "planted failure",
                     "forward");
  failing->calls = 0;
  failing->fail_at = 3;
  MPIPE_EXPECT_ERROR(pipe->constant_forward(x, 5), "stage 1", "time step 3 of 5",
                     "planted failure", "constant_forward");
  // The next calls work and are right, in values and gradients.
  failing->fail_at = -1;
  auto plain = [&](const torch::Tensor& xi) {
    return pipe->stage(2)->as<torch::nn::Sequential>()->forward(
        pipe->stage(0)->as<torch::nn::Sequential>()->forward(xi) * 2);
  };
  zero_grads(*pipe);  // the failed calls may have left partial gradients
  for (int rep = 0; rep < 3; ++rep) {
    expect_transparent(
        *pipe, x, [&](const torch::Tensor& xi) { return pipe->forward(xi, 2); }, plain, 1e-6);
    expect_transparent(
        *pipe, x, [&](const torch::Tensor& xi) { return pipe->constant_forward(xi, 3); },
        [&](const torch::Tensor& xi) { return plain(xi) + plain(xi) + plain(xi); }, 1e-5);
  }
}

TEST_P(Pipeline, ErrorInLastStageAndFirstStage) {
  for (int where : {0, 2}) {
    auto pipe = make();
    for (int i = 0; i < 3; ++i) {
      if (i == where) {
        pipe->append(Failing(1), "cpu");
      } else {
        pipe->append(mlp_stage(3, 3), "cpu");
      }
    }
    MPIPE_EXPECT_ERROR(pipe->forward(torch::randn({9, 3}), 3),
                       "stage " + std::to_string(where), "micro-batch 1 of 3");
    EXPECT_EQ(pipe->forward(torch::randn({9, 3}), 3).sizes(), (torch::IntArrayRef{9, 3}));
  }
}

TEST_P(Pipeline, BadInputsAreRefusedClearly) {
  auto empty = make();
  MPIPE_EXPECT_ERROR(empty->forward(torch::randn({4, 2}), 2), "no stages", "append");
  MPIPE_EXPECT_ERROR(empty->constant_forward(torch::randn({4, 2}), 2), "no stages");
  MPIPE_EXPECT_ERROR(empty->output_device(), "no stages");

  auto pipe = make();
  pipe->append(mlp_stage(2, 2), "cpu");
  auto x = torch::randn({4, 2});
  MPIPE_EXPECT_ERROR(pipe->forward(x, 0), "split_size must be positive, got 0");
  MPIPE_EXPECT_ERROR(pipe->forward(x, -3), "split_size must be positive, got -3");
  MPIPE_EXPECT_ERROR(pipe->constant_forward(x, 0), "T (the number of time steps)", "got 0");
  MPIPE_EXPECT_ERROR(pipe->constant_forward(x, -2), "got -2");
  MPIPE_EXPECT_ERROR(pipe->forward(torch::tensor(1.0), 1), "batch dimension", "0-dim");
  MPIPE_EXPECT_ERROR(pipe->constant_forward(torch::tensor(1.0), 2), "batch dimension");
  MPIPE_EXPECT_ERROR(pipe->forward(torch::Tensor(), 1), "undefined");
  MPIPE_EXPECT_ERROR(pipe->forward(torch::randn({0, 2}), 1), "batch is empty", "[0, 2]");
  // A wrong feature size fails inside stage 0 and says so.
  MPIPE_EXPECT_ERROR(pipe->forward(torch::randn({4, 3}), 2), "stage 0", "micro-batch 0 of 2");
  // Still usable.
  EXPECT_EQ(pipe->forward(x, 3).sizes(), x.sizes());
}

TEST_P(Pipeline, ZeroDimOutputsCannotBeConcatenated) {
  struct SumImpl : torch::nn::Module {
    torch::Tensor forward(const torch::Tensor& x) { return x.sum(); }
  };
  auto pipe = make();
  pipe->append(std::make_shared<SumImpl>(), "cpu");
  auto x = torch::ones({4, 2});
  MPIPE_EXPECT_ERROR(pipe->forward(x, 2), "stage 0 returned a 0-dim tensor", "micro-batch 0");
  MPIPE_EXPECT_ERROR(pipe->constant_forward(x, 2, false), "0-dim", "time step 0",
                     "reduce = true");
  expect_close(pipe->constant_forward(x, 3, true), torch::tensor(24.0), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Cpu, Pipeline, ::testing::Bool(), threads_name);

// ---------------------------------------------------------------------------
// Building a pipeline.

TEST(PipelineBuild, AcceptsEveryModuleForm) {
  auto pipe = ModelPipeline();
  pipe->append(torch::nn::Linear(4, 5), "cpu");                               // holder
  pipe->append(std::make_shared<torch::nn::TanhImpl>(), torch::kCPU);         // shared_ptr
  pipe->append(torch::nn::AnyModule(torch::nn::Linear(5, 3)), torch::Device("cpu"));  // AnyModule
  pipe->append(mlp_stage(3, 2), std::string("cpu"));                           // Sequential
  struct ScaleImpl : torch::nn::Module {
    torch::Tensor forward(torch::Tensor x) { return 3 * x; }  // by value: also accepted
  };
  pipe->append(std::make_shared<ScaleImpl>(), "cpu");                          // user module
  EXPECT_EQ(pipe->size(), 5u);
  EXPECT_FALSE(pipe->is_empty());
  auto x = torch::randn({7, 4});
  EXPECT_EQ(pipe->forward(x, 2).sizes(), (torch::IntArrayRef{7, 2}));
}

TEST(PipelineBuild, AccessorsAndRegistration) {
  auto a = mlp_stage(3, 4), b = mlp_stage(4, 2);
  auto pipe = ModelPipeline();
  pipe->append(a, "cpu").append(b, torch::kCPU);
  EXPECT_EQ(pipe->stage(0).get(), a.ptr().get());
  EXPECT_EQ(pipe->stage(1).get(), b.ptr().get());
  EXPECT_EQ(pipe->device(1), torch::Device(torch::kCPU));
  EXPECT_EQ(pipe->devices().size(), 2u);
  EXPECT_EQ(pipe->output_device(), torch::Device(torch::kCPU));
  MPIPE_EXPECT_ERROR(pipe->stage(2), "index 2 is out of range", "2 stage(s)");
  MPIPE_EXPECT_ERROR(pipe->device(5), "index 5");

  // Parameters are registered under stages.<i>.
  auto named = pipe->named_parameters();
  EXPECT_EQ(named.size(), a->parameters().size() + b->parameters().size());
  EXPECT_TRUE(named.contains("stages.0.0.weight"));
  EXPECT_TRUE(named.contains("stages.1.2.bias"));
  EXPECT_TRUE(named["stages.1.0.weight"].is_same(b[0]->as<torch::nn::Linear>()->weight));

  pipe->eval();
  EXPECT_FALSE(a->is_training());
  EXPECT_FALSE(b[1]->is_training());
  pipe->train();
  EXPECT_TRUE(b->is_training());

  auto y = pipe->forward(torch::randn({5, 3}), 2);
  y.sum().backward();
  for (auto& p : pipe->parameters()) EXPECT_TRUE(p.grad().defined());
  pipe->zero_grad();
  for (auto& p : pipe->parameters()) {
    EXPECT_TRUE(!p.grad().defined() || p.grad().abs().sum().item<double>() == 0.0);
  }

  std::ostringstream printed;
  printed << *pipe;
  EXPECT_NE(printed.str().find("mpipe::ModelPipeline(devices=[cpu, cpu])"), std::string::npos)
      << printed.str();
}

TEST(PipelineBuild, SaveLoadRoundTrip) {
  torch::manual_seed(3);
  auto build = [] {
    auto p = ModelPipeline();
    p->append(mlp_stage(4, 6), "cpu").append(mlp_stage(6, 2), "cpu");
    return p;
  };
  auto original = build();
  auto copy = build();  // different random init
  auto x = torch::randn({5, 4});
  ASSERT_GT((original->forward(x, 2) - copy->forward(x, 2)).abs().max().item<double>(), 1e-4);

  std::stringstream buffer;
  torch::save(original, buffer);
  torch::load(copy, buffer);
  for (const auto& p : original->named_parameters()) {
    expect_close(p.value(), copy->named_parameters()[p.key()], 0.0, p.key());
  }
  expect_close(original->forward(x, 2), copy->forward(x, 3), 1e-6);
  EXPECT_EQ(copy->device(0), torch::Device(torch::kCPU));
}

TEST(PipelineBuild, SameModuleTwiceIsRefused) {
  auto s = mlp_stage(2, 2);
  auto pipe = ModelPipeline();
  pipe->append(s, "cpu");
  MPIPE_EXPECT_ERROR(pipe->append(s, "cpu"), "stage 1 is the same module object as stage 0");
  EXPECT_EQ(pipe->size(), 1u);
  MPIPE_EXPECT_ERROR(pipe->append(torch::nn::AnyModule(), "cpu"), "stage 1", "empty AnyModule");
  MPIPE_EXPECT_ERROR(pipe->append(std::shared_ptr<torch::nn::LinearImpl>(), "cpu"), "null");
}

TEST(PipelineBuild, DtypeCastsKeepPlacementAndDeviceMovesAreChecked) {
  auto pipe = ModelPipeline();
  pipe->append(torch::nn::Linear(3, 3), "cpu").append(torch::nn::Linear(3, 2), "cpu");
  pipe->to(torch::kDouble);
  for (auto& p : pipe->parameters()) EXPECT_EQ(p.scalar_type(), torch::kDouble);
  pipe->to(torch::kCPU);  // every stage is there already: allowed
  pipe->to(torch::kCPU, torch::kFloat);
  for (auto& p : pipe->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
  MPIPE_EXPECT_ERROR(pipe->to(torch::Device("cuda:0")), "to(cuda:0)", "placement",
                     "stage 0 is on cpu");
  MPIPE_EXPECT_ERROR(pipe->to(torch::Device("cuda:0"), torch::kDouble), "placement");
  for (auto& p : pipe->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat);
}

TEST(PipelineBuild, CudaGraphsOptionRunsEagerlyWhereItCannotCapture) {
  torch::manual_seed(4);
  auto stage = mlp_stage(3, 3);
  auto plain = ModelPipeline();
  auto graphed = ModelPipeline(ModelPipelineOptions().cuda_graphs(true));
  plain->append(stage, "cpu");
  graphed->append(stage, "cpu");
  torch::NoGradGuard no_grad;  // CPU stages: no graph, the same result
  auto x = torch::randn({5, 3});
  expect_close(graphed->forward(x, 2), plain->forward(x, 2), 0.0);
  expect_close(graphed->constant_forward(x, 3), plain->constant_forward(x, 3), 0.0);
}

TEST(PipelineBuild, LanesAreRefusedBelowZeroAndChangeNothingOnTheCpu) {
  torch::manual_seed(13);
  auto a = mlp_stage(6, 6), b = mlp_stage(6, 6);
  auto pipe = ModelPipeline(ModelPipelineOptions().lanes(3));
  pipe->append(a, "cpu").append(b, "cpu");
  const auto x = torch::randn({9, 6});
  torch::NoGradGuard no_grad;
  expect_close(pipe->forward(x, 2), b->forward(a->forward(x)), 1e-6, "lanes on the CPU");
  pipe->options.lanes(-1);
  MPIPE_EXPECT_ERROR(pipe->forward(x, 2), "lanes must be 0 (automatic) or positive", "got -1");
  pipe->options.lanes(0);  // the default: automatic
  expect_close(pipe->forward(x, 2), b->forward(a->forward(x)), 1e-6, "lanes(0)");
  pipe->options.lanes(1);
  expect_close(pipe->forward(x, 2), b->forward(a->forward(x)), 1e-6, "usable after the error");
}
