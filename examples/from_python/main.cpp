// A model written in Python, pipelined from C++: load a TorchScript module
// (make_model.py saves one), split it into 4 stages balanced by measured
// cost, check the pipeline against the whole module, fine-tune it on
// Fashion-MNIST through train_step, and save it back for Python's
// torch.jit.load. Without --model it builds the same module in C++. See
// README.md.

#include "fashion_mnist.h"
#include "training.h"

#include <mpipe/balance.h>
#include <mpipe/model_pipeline.h>
#include <mpipe/script.h>

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>

namespace {

struct Config {
  examples::CommonFlags common;
  std::string model;  // a TorchScript file; empty: built in C++
  int64_t steps = 0;  // 0: 600 on a GPU, 150 on the CPU or with --quick
  int64_t batch_size = 128;
  int64_t micro_batches = 4;
  double lr = 1e-3;
};

/// A TorchScript module with the `training` flag every scripted module has.
torch::jit::Module new_module(const std::string& type) {
  torch::jit::Module m(type);
  m.register_attribute("training", c10::BoolType::get(), true);
  return m;
}

/// make_model.py's mlp_classifier(), scripted, built in C++: the same
/// children, parameters and forward methods (torch::jit::Module::define).
torch::jit::Module mlp_classifier() {
  torch::jit::Module seq = new_module("Sequential");
  torch::jit::Module flatten = new_module("Flatten");
  flatten.define("def forward(self, x):\n    return torch.flatten(x, 1)\n");
  seq.register_module("flatten", flatten);
  const int64_t widths[] = {28 * 28, 256, 256, 128, 10};
  std::string body = "def forward(self, x):\n    x = self.flatten.forward(x)\n";
  for (int k = 0; k < 4; ++k) {
    const std::string name = k < 3 ? "fc" + std::to_string(k) : "head";
    torch::nn::Linear init(widths[k], widths[k + 1]);  // PyTorch's initialisation
    torch::jit::Module fc = new_module("Linear");
    fc.register_parameter("weight", init->weight.detach().requires_grad_(), false);
    fc.register_parameter("bias", init->bias.detach().requires_grad_(), false);
    fc.define("def forward(self, x):\n    return torch.linear(x, self.weight, self.bias)\n");
    seq.register_module(name, fc);
    body += "    x = self." + name + ".forward(x)\n";
    if (k < 3) {
      torch::jit::Module act = new_module("ReLU");
      act.define("def forward(self, x):\n    return torch.relu(x)\n");
      seq.register_module("act" + std::to_string(k), act);
      body += "    x = self.act" + std::to_string(k) + ".forward(x)\n";
    }
  }
  seq.define(body + "    return x\n");
  return seq;
}

double accuracy(const std::function<torch::Tensor(const torch::Tensor&)>& model,
                const examples::Dataset& test) {
  torch::NoGradGuard no_grad;
  int64_t correct = 0;
  for (int64_t start = 0; start < test.size(); start += 1000) {
    const int64_t n = std::min<int64_t>(1000, test.size() - start);
    const auto logits = model(test.images.narrow(0, start, n));
    correct += logits.argmax(1).cpu().eq(test.labels.narrow(0, start, n).cpu()).sum().item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& labels) {
  return torch::nn::functional::cross_entropy(logits, labels);
}

int run(Config cfg) {
  examples::CommonFlags& common = cfg.common;
  const auto devices = examples::stage_devices(common.devices, 4);
  const bool cuda = devices.front().is_cuda();
  if (common.quick && common.train_limit == 0) common.train_limit = 10000;
  if (common.quick && common.test_limit == 0) common.test_limit = 2000;
  if (cfg.steps == 0) cfg.steps = common.quick || !cuda ? 150 : 600;
  torch::manual_seed(common.seed);
  if (cuda) torch::cuda::manual_seed_all(common.seed);
  examples::Dataset train, test;
  if (!examples::load_data(common, devices.front(), devices.back(), train, test)) {
    return examples::kSkipExitCode;
  }

  // 1. The module: loaded from Python's file, or built here.
  torch::jit::Module model = cfg.model.empty() ? mlp_classifier() : torch::jit::load(cfg.model);
  std::printf("model: %s, %zu parameters tensors, on %s\n",
              cfg.model.empty() ? "built in C++ (no --model)" : cfg.model.c_str(),
              model.parameters().size(), examples::device_list(devices).c_str());
  // The module runs its graph as written, split or whole (Note [TorchScript
  // stages]): so the two can be compared bit for bit.
  torch::jit::setGraphExecutorOptimize(false);
  model.to(devices.front());

  // 2. Split into 4 stages by its children, balanced by measured time.
  const auto layers = mpipe::script_layers(model);
  const auto sample = train.images.narrow(0, 0, cfg.batch_size / cfg.micro_batches);
  const auto costs = mpipe::balance::profile_time(layers, sample);
  auto pipe = mpipe::balance::balanced(
      layers, std::vector<mpipe::DeviceArg>(devices.begin(), devices.end()), costs,
      mpipe::ModelPipelineOptions().worker_threads(!common.inline_host));
  std::string split;
  const auto names = layers->named_children();
  for (size_t j = 0, at = 0; j < pipe->size(); ++j) {
    const auto stage = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(pipe->stage(j));
    for (size_t l = 0; l < stage->size(); ++l, ++at) {
      split += (l ? " " : j ? " | " : "") + names[at].key();
    }
  }
  std::printf("stages: %s\n", split.c_str());

  // 3. The pipeline against the whole module: outputs and one step's gradients.
  const auto x = train.images.narrow(0, 0, cfg.batch_size);
  const auto y = train.labels.narrow(0, 0, cfg.batch_size);
  const auto whole = [&](const torch::Tensor& in) {
    return model.forward({in.to(devices.front())}).toTensor().to(devices.back());
  };
  // The whole module on the same micro-batches (a GPU's matrix products may
  // round otherwise on another number of rows); train_step's loss: each
  // micro-batch's weighted by its share of the rows.
  const auto xs = x.chunk(cfg.micro_batches), ys = y.chunk(cfg.micro_batches);
  std::vector<torch::Tensor> outs;
  for (const auto& part : xs) outs.push_back(whole(part));
  bool same = torch::equal(pipe->forward(x, mpipe::chunks(cfg.micro_batches)), torch::cat(outs));
  for (size_t m = 0; m < xs.size(); ++m) {
    const auto part = cross_entropy(whole(xs[m]), ys[m].to(devices.back()));
    (part * (static_cast<double>(xs[m].size(0)) / static_cast<double>(x.size(0)))).backward();
  }
  std::vector<torch::Tensor> whole_grads;
  for (const auto& p : model.parameters()) whole_grads.push_back(p.grad().clone());
  pipe->zero_grad();
  pipe->train_step(x, y, cross_entropy, mpipe::TrainStepOptions(mpipe::chunks(cfg.micro_batches)));
  size_t k = 0;
  for (const auto& p : model.parameters()) same = same && torch::equal(p.grad(), whole_grads[k++]);
  std::printf("the pipeline's outputs and gradients equal the whole module's: %s\n",
              same ? "yes" : "NO");
  if (!same) return 1;

  // 4. Fine-tune through the pipeline: its parameters are the module's.
  torch::optim::AdamW opt(pipe->parameters(), torch::optim::AdamWOptions(cfg.lr));
  std::printf("test accuracy before fine-tuning: %.2f%%\n", 100 * accuracy(whole, test));
  const auto t0 = examples::Clock::now();
  const auto order = torch::randperm(train.size(), torch::TensorOptions().dtype(torch::kLong));
  for (int64_t step = 0, start = 0; step < cfg.steps; ++step, start += cfg.batch_size) {
    if (start + cfg.batch_size > train.size()) start = 0;
    const auto idx = order.narrow(0, start, cfg.batch_size);
    pipe->zero_grad();
    const auto loss = pipe->train_step(train.images.index_select(0, idx.to(devices.front())),
                                       train.labels.index_select(0, idx.to(devices.back())),
                                       cross_entropy,
                                       mpipe::TrainStepOptions(mpipe::chunks(cfg.micro_batches)));
    opt.step();
    if ((step + 1) % 50 == 0 || step + 1 == cfg.steps) {
      std::printf("step %4lld/%lld  loss %.4f\n", static_cast<long long>(step + 1),
                  static_cast<long long>(cfg.steps), loss.item<double>());
    }
  }
  const double after = accuracy([&](const torch::Tensor& in) {
    return pipe->forward(in, mpipe::chunks(cfg.micro_batches));
  }, test);
  std::printf("test accuracy after %lld steps (%.1f s): %.2f%%\n",
              static_cast<long long>(cfg.steps), examples::seconds_since(t0), 100 * after);

  // 5. Save it back, on the CPU, where any machine's torch.jit.load reads it;
  //    and load it again here: the same accuracy.
  std::filesystem::create_directories(common.out);
  const std::string saved = (std::filesystem::path(common.out) / "finetuned.pt").string();
  model.to(torch::kCPU);
  model.save(saved);
  torch::jit::Module reloaded = torch::jit::load(saved);
  const double again = accuracy([&](const torch::Tensor& in) {
    return reloaded.forward({in.cpu()}).toTensor();
  }, test);
  std::printf("saved %s; loaded again: test accuracy %.2f%%\n", saved.c_str(), 100 * again);
  if (std::abs(again - after) > 0.005) {  // only rounding apart (another batching, device)
    std::printf("FAILED: the saved module does not give the fine-tuned accuracy\n");
    return 1;
  }
  std::printf("read it in Python: python3 make_model.py check --model %s\n", saved.c_str());
  return examples::accuracy_exit_code(after, common.min_accuracy);
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  cfg.common.out = "from_python_out";
  CLI::App app{"A TorchScript model from Python, split into 4 pipeline stages and fine-tuned"};
  app.add_option("--model", cfg.model,
                 "the TorchScript file make_model.py saved; none: the same model built in C++");
  app.add_option("--steps", cfg.steps, "fine-tuning steps (default 600 on a GPU, 150 on the CPU)");
  app.add_option("--batch-size", cfg.batch_size, "images per step")->check(CLI::PositiveNumber);
  app.add_option("--micro-batches", cfg.micro_batches, "micro-batches per step")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", cfg.lr, "AdamW's learning rate");
  examples::add_common_flags(app, cfg.common, "150 steps on a data subset, for a quick check",
                             /*full=*/false);
  CLI11_PARSE(app, argc, argv);
  return examples::run_guarded([&] { return run(cfg); });
}
