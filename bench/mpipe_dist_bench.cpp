// Pipelines across processes on the CPU: N ranks with one thread each, one
// stage each, against one process with one thread holding all N stages (the
// same ModelPipeline, inline), on a compute-bound MLP. Prints, from rank 0,
// the median time of a forward and of a training step both ways, the
// speed-up and its fraction of the ideal m*n/(m+n-1).
//
//   mpipe-launch -n 2 -- build/bench/mpipe_dist_bench [--width 1024] [--split 32] ...

#include <mpipe/mpipe.h>

#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <vector>

namespace {

struct Config {
  int64_t width = 1024;
  int64_t layers = 4;  // Linear + ReLU per stage
  int64_t batch = 256;
  int64_t split = 32;
  int64_t reps = 15;
  int64_t warmup = 3;
  std::string json;
};

std::vector<torch::nn::Sequential> make_stages(const Config& c, int64_t n) {
  torch::manual_seed(0);
  std::vector<torch::nn::Sequential> stages;
  for (int64_t s = 0; s < n; ++s) {
    torch::nn::Sequential seq;
    for (int64_t l = 0; l < c.layers; ++l) {
      seq->push_back(torch::nn::Linear(c.width, c.width));
      seq->push_back(torch::nn::ReLU());
    }
    stages.push_back(seq);
  }
  return stages;
}

/// Median seconds of `reps` runs of `fn` after `warmup` (each run after `sync`).
double median_seconds(const Config& c, const std::function<void()>& fn,
                      const std::function<void()>& sync) {
  std::vector<double> t;
  for (int64_t k = 0; k < c.warmup + c.reps; ++k) {
    sync();
    const auto start = std::chrono::steady_clock::now();
    fn();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (k >= c.warmup) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"mpipe across processes: N ranks (1 thread each) vs 1 process (1 thread)"};
  app.add_option("--width", c.width, "MLP width")->check(CLI::PositiveNumber);
  app.add_option("--layers", c.layers, "Linear+ReLU layers per stage")->check(CLI::PositiveNumber);
  app.add_option("--batch", c.batch, "batch rows")->check(CLI::PositiveNumber);
  app.add_option("--split", c.split, "micro-batch rows")->check(CLI::PositiveNumber);
  app.add_option("--reps", c.reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", c.warmup, "untimed repetitions first");
  app.add_option("--json", c.json, "also write the figures here (rank 0)");
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);
  at::set_num_interop_threads(1);
  auto group = mpipe::distributed::init_from_env();
  const int64_t n = group.pipeline_size();
  const auto stages = make_stages(c, n);
  torch::manual_seed(1);
  const at::Tensor x = torch::randn({c.batch, c.width});
  const at::Tensor y = torch::randn({c.batch, c.width});
  auto loss_fn = [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); };
  const auto step = mpipe::TrainStepOptions(c.split).schedule(mpipe::Schedule::OneFOneB);
  auto barrier = [&] { group.barrier(); };

  // One process, one thread, all stages (rank 0 only; the others wait).
  double one_fwd = 0, one_train = 0;
  if (group.rank() == 0) {
    mpipe::ModelPipeline one(mpipe::ModelPipelineOptions().worker_threads(false));
    for (const auto& s : stages) {
      one->append(torch::nn::Sequential(
                      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(s->clone())),
                  "cpu");
    }
    auto none = [] {};
    one_fwd = median_seconds(c, [&] {
      torch::NoGradGuard no_grad;
      one->forward(x, c.split);
    }, none);
    one_train = median_seconds(c, [&] {
      one->zero_grad();
      one->train_step(x, y, loss_fn, step);
    }, none);
  }
  barrier();

  // N ranks: rank r holds stage r.
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group));
  const auto range = group.stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) {
    pipe->append(stages[static_cast<size_t>(s)], "cpu");
  }
  const double dist_fwd = median_seconds(c, [&] {
    torch::NoGradGuard no_grad;
    pipe->forward(x, c.split);
  }, barrier);
  const double dist_train = median_seconds(c, [&] {
    pipe->zero_grad();
    pipe->train_step(x, y, loss_fn, step);
  }, barrier);
  barrier();

  if (group.rank() == 0) {
    const int64_t m = (c.batch + c.split - 1) / c.split;
    const double ideal = static_cast<double>(m * n) / static_cast<double>(m + n - 1);
    nlohmann::json out = {
        {"ranks", n}, {"width", c.width}, {"layers_per_stage", c.layers}, {"batch", c.batch},
        {"split", c.split}, {"micro_batches", m}, {"reps", c.reps}, {"ideal_speedup", ideal},
        {"forward", {{"one_process_s", one_fwd}, {"ranks_s", dist_fwd},
                     {"speedup", one_fwd / dist_fwd}, {"of_ideal", one_fwd / dist_fwd / ideal}}},
        {"train_step_1f1b",
         {{"one_process_s", one_train}, {"ranks_s", dist_train},
          {"speedup", one_train / dist_train}, {"of_ideal", one_train / dist_train / ideal}}}};
    std::printf("%s\n", out.dump(2).c_str());
    std::printf("forward: %.1f ms one process, %.1f ms on %lld ranks: %.2fx (%.0f%% of the ideal "
                "%.2fx)\n", 1e3 * one_fwd, 1e3 * dist_fwd, static_cast<long long>(n),
                one_fwd / dist_fwd, 100 * one_fwd / dist_fwd / ideal, ideal);
    std::printf("train_step (1F1B): %.1f ms one process, %.1f ms on %lld ranks: %.2fx (%.0f%% of "
                "the ideal %.2fx)\n", 1e3 * one_train, 1e3 * dist_train, static_cast<long long>(n),
                one_train / dist_train, 100 * one_train / dist_train / ideal, ideal);
    if (!c.json.empty()) std::ofstream(c.json) << out.dump(2) << "\n";
  }
  return 0;
}
