// TorchScript modules as stages (Note [TorchScript stages]): a module built
// as Python's torch.jit.script(nn.Sequential(...)) would be, split by its
// children or at named ones, gives the whole module's outputs and gradients
// bit for bit; its parameters are the pipeline's, train, save and load. And
// AOTInductor packages as stages (Note [Exported stages]).

#include "common.h"

#include <mpipe/script.h>

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

// AOTInductor's package loader, where this LibTorch has it (2.x).
#if defined(__has_include)
#if __has_include(<torch/csrc/inductor/aoti_package/model_package_loader.h>)
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#define MPIPE_TEST_WITH_AOTI 1
#endif
#endif

using namespace mpipe_test;
using mpipe::ModelPipeline;
using mpipe::ModelPipelineOptions;

namespace {

/// An empty TorchScript module with the `training` flag every module
/// scripted in Python has (train() and eval() set it).
torch::jit::Module new_module(const std::string& type) {
  torch::jit::Module m(type);
  m.register_attribute("training", c10::BoolType::get(), true);
  return m;
}

/// A TorchScript Linear, as torch.jit.script(nn.Linear(in, out)) holds it.
torch::jit::Module script_linear(int64_t in, int64_t out) {
  torch::jit::Module m = new_module("Linear");
  torch::nn::Linear init(in, out);  // PyTorch's initialisation
  m.register_parameter("weight", init->weight.detach().clone().requires_grad_(), false);
  m.register_parameter("bias", init->bias.detach().clone().requires_grad_(), false);
  m.define(R"(
    def forward(self, x):
        return torch.linear(x, self.weight, self.bias)
  )");
  return m;
}

torch::jit::Module script_tanh() {
  torch::jit::Module m = new_module("Tanh");
  m.define(R"(
    def forward(self, x):
        return torch.tanh(x)
  )");
  return m;
}

/// nn.Sequential(fc0, act0, fc1, act1, ..., head) in TorchScript: 2 * hidden
/// + 1 children, named as given, and a forward that calls them in order.
torch::jit::Module script_mlp(int64_t width, int64_t hidden, int64_t out) {
  torch::manual_seed(11);
  torch::jit::Module seq = new_module("Sequential");
  std::string body = "    def forward(self, x):\n";
  for (int64_t l = 0; l < hidden; ++l) {
    seq.register_module("fc" + std::to_string(l), script_linear(width, width));
    seq.register_module("act" + std::to_string(l), script_tanh());
    body += "        x = self.fc" + std::to_string(l) + ".forward(x)\n";
    body += "        x = self.act" + std::to_string(l) + ".forward(x)\n";
  }
  seq.register_module("head", script_linear(width, out));
  body += "        return self.head.forward(x)\n";
  seq.define(body);
  return seq;
}

/// Every parameter's gradient of `m`, by name, cloned; then zeroes them.
std::map<std::string, torch::Tensor> take_grads(const torch::jit::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) {
    out[p.name] = p.value.grad().defined() ? p.value.grad().clone() : torch::Tensor();
    if (p.value.grad().defined()) p.value.mutable_grad() = torch::Tensor();
  }
  return out;
}

void expect_equal_grads(const std::map<std::string, torch::Tensor>& a,
                        const std::map<std::string, torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& kv : a) {
    ASSERT_TRUE(kv.second.defined() && b.at(kv.first).defined()) << kv.first;
    EXPECT_TRUE(torch::equal(kv.second, b.at(kv.first)))
        << "grad of " << kv.first << ": max difference "
        << (kv.second - b.at(kv.first)).abs().max().item<double>();
  }
}

/// The whole module's loss and gradients on (x, y), cut into micro-batches
/// of `rows` rows as train_step cuts them: each micro-batch's loss weighted
/// by its share of the rows, its gradients accumulated, the losses summed in
/// order. The same kernels in the same order as the pipeline's.
std::pair<torch::Tensor, std::map<std::string, torch::Tensor>> whole_module(
    torch::jit::Module& m, const torch::Tensor& x, const torch::Tensor& y, int64_t rows) {
  torch::jit::GraphOptimizerEnabledGuard as_written(false);  // as stages run
  torch::Tensor loss;
  const auto batch = static_cast<double>(x.size(0));
  for (int64_t start = 0; start < x.size(0); start += rows) {
    const int64_t n = std::min(rows, x.size(0) - start);
    const auto part = mse(m.forward({x.narrow(0, start, n)}).toTensor(), y.narrow(0, start, n)) *
                      (static_cast<double>(n) / batch);
    part.backward();
    loss = loss.defined() ? loss + part.detach() : part.detach();
  }
  return {loss, take_grads(m)};
}

}  // namespace

TEST(ScriptStages, SplitByChildrenOrNamesEqualsTheWholeModuleForEverySchedule) {
  auto model = script_mlp(8, 3, 4);  // 7 children
  const auto x = torch::randn({12, 8}), y = torch::randn({12, 4});
  const auto [loss, grads] = whole_module(model, x, y, 3);
  torch::Tensor out;  // micro-batch by micro-batch: a CPU GEMM's bits may depend on its rows
  {
    torch::NoGradGuard no_grad;
    torch::jit::GraphOptimizerEnabledGuard as_written(false);
    std::vector<torch::Tensor> parts;
    for (const auto& part : x.split(3)) parts.push_back(model.forward({part}).toTensor());
    out = torch::cat(parts);
  }
  const auto layers = mpipe::script_layers(model);
  ASSERT_EQ(layers->size(), 7u);
  for (bool by_name : {false, true}) {
    for (bool threads : {true, false}) {
      SCOPED_TRACE(std::string(by_name ? "cut at names" : "by sizes") + (threads ? ", threads" : ", inline"));
      const auto options = ModelPipelineOptions().worker_threads(threads);
      auto pipe = by_name ? mpipe::balance::from_sequential(layers, {"cpu", "cpu", "cpu", "cpu"},
                                                            {"act0", "fc2", "head"}, options)
                          : mpipe::balance::from_sequential(layers, {"cpu", "cpu", "cpu", "cpu"},
                                                            {2, 2, 2, 1}, options);
      ASSERT_EQ(pipe->size(), 4u);
      {
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(torch::equal(pipe->forward(x, 3), out)) << "forward";
      }
      for (auto schedule : all_schedules()) {
        SCOPED_TRACE(schedule_name(schedule));
        const auto l = pipe->train_step(x, y, mse, schedule_options(schedule, 3, 4));
        EXPECT_TRUE(torch::equal(l, loss)) << "loss";
        expect_equal_grads(take_grads(model), grads);
      }
    }
  }
}

// The balance tools take script_layers as any Sequential: profiled, split
// by cost, the pipeline gives the whole module's outputs.
TEST(ScriptStages, TheBalanceToolsSplitTheLayersByTheirCost) {
  auto model = script_mlp(16, 3, 4);  // 7 children
  const auto layers = mpipe::script_layers(model);
  const auto x = torch::randn({8, 16});
  const auto costs = mpipe::balance::profile_time(layers, x.narrow(0, 0, 4), 2);
  ASSERT_EQ(costs.size(), 7u);
  for (double c : costs) EXPECT_GE(c, 0.0);
  auto pipe = mpipe::balance::balanced(layers, {"cpu", "cpu", "cpu"}, costs);
  ASSERT_EQ(pipe->size(), 3u);
  torch::NoGradGuard no_grad;
  torch::jit::GraphOptimizerEnabledGuard as_written(false);
  EXPECT_TRUE(torch::equal(pipe->forward(x, 4), model.forward({x}).toTensor()));
  for (const auto& p : model.named_parameters()) {
    EXPECT_FALSE(p.value.grad().defined()) << "profiling left a gradient on " << p.name;
  }
}

// On a GPU: the split module on cuda:0 gives the whole module's outputs and
// training step, eager and in the calls that default options replay from
// CUDA graphs (Note [Automatic CUDA graphs]), every call the same.
TEST(ScriptStages, OnTheGpuEagerAndReplayedCallsEqualTheWholeModule_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
  const torch::Device gpu("cuda:0");
  auto model = script_mlp(32, 3, 8);
  model.to(gpu);
  const auto x = torch::randn({16, 32}, gpu), y = torch::randn({16, 8}, gpu);
  const auto [loss, grads] = whole_module(model, x, y, 4);
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    torch::jit::GraphOptimizerEnabledGuard as_written(false);
    out = model.forward({x}).toTensor();
  }
  auto pipe = mpipe::balance::from_sequential(mpipe::script_layers(model), {gpu, gpu, gpu},
                                              {"act0", "fc2"});
  for (int call = 0; call < 5; ++call) {  // the third and later calls replay a graph
    SCOPED_TRACE("call " + std::to_string(call));
    {
      torch::NoGradGuard no_grad;
      EXPECT_TRUE(torch::equal(pipe->forward(x, 4), out)) << "forward";
    }
    pipe->zero_grad();
    EXPECT_TRUE(torch::equal(pipe->train_step(x, y, mse, mpipe::TrainStepOptions(4)), loss));
    expect_equal_grads(take_grads(model), grads);
  }
  EXPECT_GE(pipe->cuda_graphs_captured(), 1u) << "no call was replayed";
}

TEST(ScriptStages, AppendedModulesMixWithTorchNnStagesAndTrainTheScriptModule) {
  auto model = script_mlp(8, 1, 8);  // fc0, act0, head
  torch::manual_seed(2);
  torch::nn::Linear tail(8, 3);
  const auto x = torch::randn({6, 8}), y = torch::randn({6, 3});
  // The plain model: the TorchScript module, then the C++ Linear (one
  // micro-batch: the same kernels).
  torch::Tensor plain_loss;
  {
    torch::jit::GraphOptimizerEnabledGuard as_written(false);
    plain_loss = mse(tail->forward(model.forward({x}).toTensor()), y);
    plain_loss.backward();
  }
  const auto grads = take_grads(model);
  const auto tail_grad = tail->weight.grad().clone();
  tail->weight.mutable_grad() = torch::Tensor();

  ModelPipeline pipe;
  pipe->append(model, "cpu").append(tail, "cpu");
  // The TorchScript module's parameters are the pipeline's, under their names.
  std::vector<std::string> names;
  for (const auto& p : pipe->named_parameters()) names.push_back(p.key());
  EXPECT_EQ(names, (std::vector<std::string>{"stages.0.fc0.weight", "stages.0.fc0.bias",
                                              "stages.0.head.weight", "stages.0.head.bias",
                                              "stages.1.weight", "stages.1.bias"}));
  const auto loss = pipe->train_step(x, y, mse, mpipe::TrainStepOptions(6));
  EXPECT_TRUE(torch::equal(loss, plain_loss.detach()));
  expect_equal_grads(take_grads(model), grads);
  EXPECT_TRUE(torch::equal(tail->weight.grad(), tail_grad));

  // An optimizer over the pipeline's parameters trains the TorchScript
  // module itself, and the module saved as Python would load it holds that.
  pipe->zero_grad();
  torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(0.1));
  const auto before = model.attr("head").toModule().attr("weight").toTensor().clone();
  pipe->train_step(x, y, mse, mpipe::TrainStepOptions(2));
  opt.step();
  const auto after = model.attr("head").toModule().attr("weight").toTensor();
  EXPECT_FALSE(torch::equal(before, after)) << "the step did not change the TorchScript module";
  std::stringstream saved;
  model.save(saved);
  auto loaded = torch::jit::load(saved);
  EXPECT_TRUE(torch::equal(loaded.attr("head").toModule().attr("weight").toTensor(), after));
}

TEST(ScriptStages, SaveLoadAndContinueAreBitIdentical) {
  auto run = [](bool reload) {
    auto model = script_mlp(6, 2, 2);
    auto pipe = mpipe::balance::from_sequential(mpipe::script_layers(model), {"cpu", "cpu"}, {3, 2});
    auto opt = std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-2));
    torch::manual_seed(4);
    const auto x = torch::randn({8, 6}), y = torch::randn({8, 2});
    std::vector<torch::Tensor> losses;
    for (int step = 0; step < 4; ++step) {
      if (reload && step == 2) {
        std::stringstream weights, state;
        torch::save(pipe, weights);
        torch::save(*opt, state);
        // A new process: the module as it was loaded, the saved training.
        auto fresh = script_mlp(6, 2, 2);
        pipe = mpipe::balance::from_sequential(mpipe::script_layers(fresh), {"cpu", "cpu"}, {3, 2});
        torch::load(pipe, weights);
        opt = std::make_unique<torch::optim::Adam>(pipe->parameters(), torch::optim::AdamOptions(1e-2));
        torch::load(*opt, state);
      }
      opt->zero_grad();
      losses.push_back(pipe->train_step(x, y, mse, mpipe::TrainStepOptions(4)));
      opt->step();
    }
    losses.push_back(pipe->parameters().back().detach().clone());
    return losses;
  };
  const auto whole = run(false), resumed = run(true);
  for (size_t k = 0; k < whole.size(); ++k) EXPECT_TRUE(torch::equal(whole[k], resumed[k])) << k;
}

TEST(ScriptStages, CheckpointingAndEvalModeReachTheScriptModule) {
  auto model = script_mlp(8, 2, 4);
  const auto x = torch::randn({8, 8}), y = torch::randn({8, 4});
  const auto [loss, grads] = whole_module(model, x, y, 2);
  auto pipe = mpipe::balance::from_sequential(
      mpipe::script_layers(model), {"cpu", "cpu"}, {2, 3},
      ModelPipelineOptions().checkpoint(mpipe::Checkpoint::Always));
  EXPECT_TRUE(torch::equal(pipe->train_step(x, y, mse, mpipe::TrainStepOptions(2)), loss));
  expect_equal_grads(take_grads(model), grads);
  pipe->eval();
  EXPECT_FALSE(model.attr("fc0").toModule().is_training());
  pipe->train();
  EXPECT_TRUE(model.attr("fc0").toModule().is_training());
}

TEST(ScriptStages, AResettableModuleRunsTimeStepsAndRefusesSeveralMicroBatches) {
  // A leaky accumulator whose state is an attribute, reset by reset().
  torch::jit::Module acc = new_module("Accumulator");
  acc.register_attribute("v", c10::TensorType::get(), torch::zeros({1}));
  acc.define(R"(
    def forward(self, x):
        self.v = 0.5 * self.v + x
        return self.v
    def reset(self):
        self.v = torch.zeros(1)
  )");
  ModelPipeline pipe;
  pipe->append(acc, "cpu").append(torch::nn::Linear(3, 2), "cpu");
  const auto x = torch::randn({4, 3});
  torch::NoGradGuard no_grad;
  const auto y = pipe->constant_forward(x, 3, /*reduce=*/false);
  // The same by hand: three steps of the accumulator, then the Linear.
  auto lin = std::dynamic_pointer_cast<torch::nn::LinearImpl>(pipe->stage(1));
  ASSERT_TRUE(lin);
  torch::Tensor v = torch::zeros({1}), expected;
  std::vector<torch::Tensor> steps;
  for (int t = 0; t < 3; ++t) {
    v = 0.5 * v + x;
    steps.push_back(lin->forward(v));
  }
  EXPECT_TRUE(torch::equal(y, torch::cat(steps))) << "time steps";
  // The state carries on (as a neuron's), and reset_states resets it
  // through the module's reset().
  EXPECT_FALSE(torch::equal(pipe->constant_forward(x, 3, false), y)) << "the state carried on";
  mpipe::reset_states(*pipe);
  EXPECT_TRUE(torch::equal(pipe->constant_forward(x, 3, false), y)) << "reset_states";
  MPIPE_EXPECT_ERROR(pipe->forward(x, 2), "stage 0", "reset()", "one micro-batch", "into 2");
  mpipe::reset_states(*pipe);
  EXPECT_TRUE(torch::equal(pipe->constant_forward(x, 3, false), y)) << "usable after the error";
}

TEST(ScriptStages, BadSplitsAndInputsGetClearErrors) {
  auto model = script_mlp(4, 1, 2);  // fc0, act0, head
  const auto layers = mpipe::script_layers(model);
  MPIPE_EXPECT_ERROR(mpipe::balance::from_sequential(layers, {"cpu", "cpu"}, {"fc9"}),
                     "no layer named 'fc9'", "fc0, act0, head");
  MPIPE_EXPECT_ERROR(mpipe::balance::from_sequential(layers, {"cpu", "cpu"}, {"fc0"}),
                     "leaves stage 0 empty");
  MPIPE_EXPECT_ERROR(mpipe::balance::from_sequential(layers, {"cpu", "cpu", "cpu"}, {"head"}),
                     "1 cut(s) for 3 device(s)");
  // Two names (which a std::vector<int64_t> would take as an iterator range).
  EXPECT_EQ(mpipe::balance::from_sequential(layers, {"cpu", "cpu", "cpu"}, {"act0", "head"})->size(),
            3u);
  MPIPE_EXPECT_ERROR(mpipe::script_layers(script_tanh()), "no children", "Tanh");
  // A stage whose forward takes two inputs after a stage that gives one.
  torch::jit::Module pair = new_module("Pair");
  pair.define(R"(
    def forward(self, a, b):
        return a + b
  )");
  ModelPipeline pipe;
  pipe->append(script_linear(4, 4), "cpu").append(pair, "cpu");
  MPIPE_EXPECT_ERROR(pipe->forward(torch::randn({4, 4}), 2), "stage 1", "micro-batch 0",
                     "Pair", "takes 2 input(s)", "given 1");
  // A child that returns two tensors cannot be a layer of a Sequential.
  torch::jit::Module two = new_module("Two");
  two.define(R"(
    def forward(self, x):
        return x, x
  )");
  torch::jit::Module outer = new_module("Outer");
  outer.register_module("two", two);
  outer.define(R"(
    def forward(self, x):
        return self.two.forward(x)
  )");
  auto split = mpipe::balance::from_sequential(mpipe::script_layers(outer), {"cpu"},
                                               std::vector<int64_t>{1});
  MPIPE_EXPECT_ERROR(split->forward(torch::randn({2, 4}), 1), "stage 0", "Two",
                     "returned 2 tensors", "returns one");
}

// Exported programs: AOTInductor .pt2 packages as stages (Note [Exported
// stages]). The packages come from tests/export_packages.py, run with
// python3's torch, on machines whose LibTorch has the package loader.
namespace {

std::filesystem::path scratch_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("mpipe_exported_" + name + "_" + std::to_string(::getpid()));
  remove_tree(dir.string());
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST(ExportedStages, AMissingPackageOrALibTorchWithoutTheLoaderGetsAClearError) {
  const auto dir = scratch_dir("errors");
  ModelPipeline pipe;
  MPIPE_EXPECT_ERROR(pipe->append(dir / "missing.pt2", "cpu"), "stage 0", "missing.pt2",
                     "is not a file");
#ifndef MPIPE_TEST_WITH_AOTI
  std::ofstream(dir / "model.pt2") << "not read";
  MPIPE_EXPECT_ERROR(pipe->append(dir / "model.pt2", "cpu"), "stage 0", "model.pt2",
                     "no package loader", TORCH_VERSION, "torch::jit::load");
#endif
  EXPECT_EQ(pipe->size(), 0u) << "a refused stage is not appended";
  pipe->append(torch::nn::Linear(3, 2), "cpu");  // still usable
  EXPECT_EQ(pipe->forward(torch::ones({4, 3}), 2).sizes(), (std::vector<int64_t>{4, 2}));
  remove_tree(dir.string());
}

// On a GPU: two packages as two stages give what the packages give run one
// after another on each micro-batch, threaded and inline, in repeated calls
// (AOTInductor's runner cannot be captured in a CUDA graph: those calls stay
// eager) and in the time-step calls; a training step through them and a
// gradient through them are refused with clear errors.
TEST(ExportedStages, PackagesOnTheGpuRunAsTheyDoOneAfterAnother_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
#ifndef MPIPE_TEST_WITH_AOTI
  FAIL() << "this LibTorch has CUDA but no AOTInductor package loader";
#else
  const torch::Device gpu("cuda:0");
  const auto dir = scratch_dir("gpu");
  const std::string make = "python3 " MPIPE_TEST_SOURCE_DIR "/tests/export_packages.py " +
                           dir.string() + " cuda";
  ASSERT_EQ(std::system(make.c_str()), 0) << make;
  const std::string front = (dir / "front.pt2").string(), back = (dir / "back.pt2").string();
  torch::inductor::AOTIModelPackageLoader front_alone(front), back_alone(back);
  torch::manual_seed(3);
  const auto x = torch::randn({24, 32}, gpu), y = torch::randn({24, 16}, gpu);
  // What the packages give one after another, micro-batch by micro-batch.
  auto alone = [&](int64_t chunks) {
    std::vector<torch::Tensor> outs;
    for (const auto& part : x.chunk(chunks)) {
      std::vector<torch::Tensor> in{part};
      std::vector<torch::Tensor> mid = front_alone.run(in);
      outs.push_back(back_alone.run(mid)[0]);
    }
    return torch::cat(outs);
  };
  for (bool threads : {true, false}) {
    SCOPED_TRACE(threads ? "worker threads" : "inline");
    ModelPipeline pipe(ModelPipelineOptions().worker_threads(threads));
    pipe->append(std::filesystem::path(front), gpu).append(std::filesystem::path(back), gpu);
    for (int64_t chunks : {1, 3, 4}) {
      const auto expected = alone(chunks);
      EXPECT_TRUE(torch::equal(pipe->forward(x, mpipe::chunks(chunks)), expected))
          << chunks << " micro-batches, gradients on, eval mode";
      torch::NoGradGuard no_grad;
      for (int call = 0; call < 4; ++call) {  // the third and later would replay a graph
        EXPECT_TRUE(torch::equal(pipe->forward(x, mpipe::chunks(chunks)), expected))
            << chunks << " micro-batches, call " << call;
      }
    }
    EXPECT_EQ(pipe->cuda_graphs_captured(), 0u) << "torch 2.11: the capture fails, calls stay eager";
    torch::NoGradGuard no_grad;
    const auto one = alone(1);
    EXPECT_TRUE(torch::equal(pipe->constant_forward(x, 3, true), one + one + one));
  }
  // A training step through the packages: refused in training mode, and in
  // eval mode too, since the step hands every stage's input a gradient.
  ModelPipeline pipe;
  pipe->append(std::filesystem::path(front), gpu)
      .append(std::filesystem::path(back), gpu)
      .append(torch::nn::Linear(16, 16), gpu);
  pipe->train();
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, mpipe::TrainStepOptions(1)), "stage 0",
                     "front.pt2", "runs inference only", "training mode");
  pipe->eval();
  MPIPE_EXPECT_ERROR(pipe->train_step(x, y, mse, mpipe::TrainStepOptions(1)), "stage 1",
                     "back.pt2", "cannot pass a gradient back");
  // A stage that trains before a package: its gradient cannot pass.
  ModelPipeline behind;
  behind->append(torch::nn::Linear(32, 32), gpu).append(std::filesystem::path(front), gpu);
  behind->eval();
  MPIPE_EXPECT_ERROR(behind->forward(x, 2), "stage 1", "micro-batch 0", "front.pt2",
                     "cannot pass a gradient back", "input 0");
  {
    torch::NoGradGuard no_grad;
    EXPECT_EQ(behind->forward(x, 2).sizes(), (std::vector<int64_t>{24, 64})) << "usable after";
  }
  // A package compiled for CUDA on a CPU stage.
  MPIPE_EXPECT_ERROR(ModelPipeline()->append(std::filesystem::path(front), "cpu"), "stage 0",
                     "compiled for cuda", "cpu");
  remove_tree(dir.string());
#endif
}
