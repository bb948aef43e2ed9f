// Pipelines across processes on the CPU: N ranks with one thread each, one
// stage each, against one process with one thread holding all N stages (the
// same ModelPipeline, inline), on a compute-bound MLP. Prints, from rank 0,
// the median time of a forward and of a training step both ways, the
// speed-up and its fraction of the ideal m*n/(m+n-1).
//
// --snn: an SNN training step (constant_train_step, multi-step stages of
// SeqToANN(Linear) + LIF, T steps) as micro-batches x time chunks (Note
// [Micro-batches over time]), against the plain multi-step model in one
// thread: on N ranks (one stage each), and with N stages in one process
// (worker threads). Also schedules::simulate's prediction for 4 and 8 devices
// from the stage's measured cost per item.
//
//   mpipe-launch -n 2 -- build/bench/mpipe_dist_bench [--width 1024] [--split 32] ...
//   mpipe-launch -n 2 -- build/bench/mpipe_dist_bench --snn [--T 8] [--grid 1x8,2x8,...]

#include <mpipe/mpipe.h>
#include <mpipe/simulate.h>
#include <mpipe/snn.h>

#include "mpipe/detail/runtime/programs.h"  // constant_train_step's programs, simulated

#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
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
  bool snn = false;
  int64_t T = 8;
  // micro-batches x time chunk (steps per item), e.g. "1x8,2x8,4x4"
  std::string grid = "1x8,1x4,1x2,1x1,2x8,4x8,8x8,2x4,4x4,4x2";
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

/// The SNN stages: SeqToANN(Linear, ..., Linear) with `layers` Linear layers,
/// then a multi-step LIF neuron.
std::vector<torch::nn::Sequential> make_snn_stages(const Config& c, int64_t n) {
  torch::manual_seed(0);
  std::vector<torch::nn::Sequential> stages;
  for (int64_t s = 0; s < n; ++s) {
    torch::nn::Sequential inner;
    for (int64_t l = 0; l < c.layers; ++l) inner->push_back(torch::nn::Linear(c.width, c.width));
    torch::nn::Sequential seq;
    seq->push_back(mpipe::snn::SeqToANN(inner));
    seq->push_back(mpipe::snn::LIFNode(mpipe::snn::LIFNodeOptions()
                                           .v_threshold(0.5)
                                           .step_mode(mpipe::snn::StepMode::Multi)));
    stages.push_back(seq);
  }
  return stages;
}

/// (micro-batches, time chunk) pairs of --grid.
std::vector<std::pair<int64_t, int64_t>> parse_grid(const std::string& grid) {
  std::vector<std::pair<int64_t, int64_t>> out;
  std::stringstream in(grid);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto x = item.find('x');
    if (x == std::string::npos) throw std::runtime_error("--grid: MxK, got " + item);
    out.emplace_back(std::stoll(item.substr(0, x)), std::stoll(item.substr(x + 1)));
  }
  return out;
}

int snn_main(const Config& c, mpipe::distributed::ProcessGroup& group) {
  const int64_t n = group.pipeline_size();
  const auto stages = make_snn_stages(c, n);
  const auto grid = parse_grid(c.grid);
  torch::manual_seed(1);
  const at::Tensor x = torch::rand({c.batch, c.width}) * 2;
  const at::Tensor y = torch::rand({c.batch, c.width});
  auto loss_fn = [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); };
  auto barrier = [&] { group.barrier(); };
  auto none = [] {};
  nlohmann::json out = {{"ranks", n},         {"width", c.width}, {"layers_per_stage", c.layers},
                        {"batch", c.batch},   {"T", c.T},         {"reps", c.reps},
                        {"grid", nlohmann::json::array()}};
  std::vector<torch::nn::Sequential> local;  // rank 0's copies, for one-process runs
  double plain = 0;
  if (group.rank() == 0) {
    local = make_snn_stages(c, n);  // the same draws as `stages`
    // The plain model: all T steps in one multi-step call of every stage.
    plain = median_seconds(c, [&] {
      for (auto& s : local) s->zero_grad();
      at::Tensor h = x.unsqueeze(0).expand({c.T, c.batch, c.width});
      for (auto& s : local) h = s->forward(h);
      loss_fn(h.sum(0), y).backward();
      for (auto& s : local) mpipe::reset_states(*s);
    }, none);
    out["plain_s"] = plain;
    // One stage's cost per item of each grid entry (F, then B of its
    // output's sum), for schedules::simulate.
    for (const auto& mk : grid) {
      const int64_t rows = (c.batch + mk.first - 1) / mk.first, k = std::min(mk.second, c.T);
      const at::Tensor xi = torch::rand({k, rows, c.width}) * 2;
      auto& s = local[0];
      double f = 0;
      const double fb = median_seconds(c, [&] {
        s->zero_grad();
        const auto t0 = std::chrono::steady_clock::now();
        at::Tensor h = s->forward(xi);
        f = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        h.sum().backward();
        mpipe::reset_states(*s);
      }, none);
      const int64_t items = mk.first * ((c.T + k - 1) / k);
      nlohmann::json e = {{"micro_batches", mk.first}, {"chunk", k}, {"items", items},
                          {"stage_item_f_s", f}, {"stage_item_b_s", fb - f}};
      for (int64_t d : {int64_t{4}, int64_t{8}}) {
        const double span = mpipe::schedules::makespan(
            mpipe::detail::chained(items, d), {mpipe::schedules::StageCost{f, fb - f, 0, 0}});
        // The plain model of d such stages takes d times one stage's whole step.
        const double plain_d = static_cast<double>(d) * plain / static_cast<double>(n);
        const double speedup = plain_d / span;
        e["simulated_" + std::to_string(d) + "_devices"] = {{"speedup", speedup},
                                                            {"of_ideal", speedup / d}};
      }
      out["grid"].push_back(e);
    }
    // n stages in one process, threaded (a worker per stage).
    mpipe::ModelPipeline one;
    for (const auto& s : local) one->append(s, "cpu");
    size_t g = 0;
    for (const auto& mk : grid) {
      const double t = median_seconds(c, [&] {
        one->zero_grad();
        one->constant_train_step(x, c.T, y, loss_fn, mk.second, mpipe::chunks(mk.first));
      }, none);
      out["grid"][g]["one_process_s"] = t;
      out["grid"][g]["one_process_speedup"] = plain / t;
      out["grid"][g]["one_process_of_ideal"] = plain / t / static_cast<double>(n);
      ++g;
    }
  }
  barrier();

  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group));
  const auto range = group.stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) {
    pipe->append(stages[static_cast<size_t>(s)], "cpu");
  }
  size_t g = 0;
  for (const auto& mk : grid) {
    const double t = median_seconds(c, [&] {
      pipe->zero_grad();
      pipe->constant_train_step(x, c.T, y, loss_fn, mk.second, mpipe::chunks(mk.first));
    }, barrier);
    if (group.rank() == 0) {
      auto& e = out["grid"][g];
      e["ranks_s"] = t;
      e["ranks_speedup"] = plain / t;
      e["ranks_of_ideal"] = plain / t / static_cast<double>(n);
      const double items = e["items"].get<double>();
      e["fill_drain_ideal"] = items * n / (items + n - 1);
    }
    ++g;
  }
  barrier();
  if (group.rank() == 0) {
    std::printf("%s\n", out.dump(2).c_str());
    std::printf("SNN constant_train_step, T = %lld, batch %lld, width %lld x %lld layers per stage; "
                "plain model %.1f ms\n", static_cast<long long>(c.T),
                static_cast<long long>(c.batch), static_cast<long long>(c.width),
                static_cast<long long>(c.layers), 1e3 * plain);
    std::printf("%-6s %-6s %-6s | %-26s | %-26s | %s\n", "M", "k", "items",
                "one process (threads)", "ranks", "simulated: 4 / 8 devices");
    for (const auto& e : out["grid"]) {
      std::printf("%-6lld %-6lld %-6lld | %7.1f ms %5.2fx %4.0f%% | %7.1f ms %5.2fx %4.0f%% | "
                  "%5.2fx %4.0f%% / %5.2fx %4.0f%%\n",
                  static_cast<long long>(e["micro_batches"].get<int64_t>()),
                  static_cast<long long>(e["chunk"].get<int64_t>()),
                  static_cast<long long>(e["items"].get<int64_t>()),
                  1e3 * e["one_process_s"].get<double>(), e["one_process_speedup"].get<double>(),
                  100 * e["one_process_of_ideal"].get<double>(), 1e3 * e["ranks_s"].get<double>(),
                  e["ranks_speedup"].get<double>(), 100 * e["ranks_of_ideal"].get<double>(),
                  e["simulated_4_devices"]["speedup"].get<double>(),
                  100 * e["simulated_4_devices"]["of_ideal"].get<double>(),
                  e["simulated_8_devices"]["speedup"].get<double>(),
                  100 * e["simulated_8_devices"]["of_ideal"].get<double>());
    }
    if (!c.json.empty()) std::ofstream(c.json) << out.dump(2) << "\n";
  }
  return 0;
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
  app.add_flag("--snn", c.snn, "an SNN training step as micro-batches x time chunks instead");
  app.add_option("--T", c.T, "--snn: time steps")->check(CLI::PositiveNumber);
  app.add_option("--grid", c.grid, "--snn: micro-batches x time chunk pairs, e.g. 1x8,2x8,4x4");
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);
  at::set_num_interop_threads(1);
  auto group = mpipe::distributed::init_from_env();
  if (c.snn) return snn_main(c, group);
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
