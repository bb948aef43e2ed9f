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
// --lm: the transformer_lm example's model at its CPU defaults (2 blocks of
// 64, context 64, batch 16 in 8 micro-batches, AdamW, clipping), one stage
// per rank, its train_step (1F1B and ZB-H1) against the same model trained
// plain in one thread on the same micro-batches (the fair baseline), and
// schedules::simulate's prediction from each layer's measured cost.
//
//   mpipe-launch -n 2 -- build/bench/mpipe_dist_bench [--width 1024] [--split 32] ...
//   mpipe-launch -n 2 -- build/bench/mpipe_dist_bench --snn [--T 8] [--grid 1x8,2x8,...]
//   OPENBLAS_NUM_THREADS=1 mpipe-launch -n 2 -- build/bench/mpipe_dist_bench --lm

#include <mpipe/mpipe.h>
#include <mpipe/simulate.h>
#include <mpipe/snn.h>

#include "lm_costs.h"

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
  bool lm = false;
  double host_us = 4;  // --lm: the runtime's cost per task (bench/RESULTS.md, the CPU)
  int64_t blocks = 2;  // --lm: transformer blocks
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

/// --lm: see the file's comment.
int lm_main(const Config& c, mpipe::distributed::ProcessGroup& group) {
  const int64_t n = group.pipeline_size(), m = 8, vocab = 100, batch = 16, context = 64;
  torch::manual_seed(0);
  transformer_lm::Layers layers(vocab, /*layers=*/c.blocks, /*dim=*/64, /*heads=*/4, context);
  const auto x = torch::randint(vocab, {batch, context}, torch::kLong);
  const auto y = torch::randint(vocab, {batch, context}, torch::kLong);
  const auto& loss_fn = transformer_lm::lm_loss;
  auto none = [] {};
  auto barrier = [&] { group.barrier(); };
  auto make_opt = [](const std::vector<at::Tensor>& params) {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(1e-4).betas({0.9, 0.95}).weight_decay(0.1));
  };
  // Rank 0 alone: each layer's cost, the fair baseline, and a hand-off.
  std::vector<lm_bench::LayerCost> costs(static_cast<size_t>(layers.size()));
  double plain = 0, optimizer = 0;
  if (group.rank() == 0) {
    costs = lm_bench::measure_layers(layers, x.narrow(0, 0, batch / m), y.narrow(0, 0, batch / m),
                                     false, none);
    auto all = layers.all();
    const auto params = all->parameters();
    auto opt = make_opt(params);
    plain = median_seconds(c, [&] {
      opt->zero_grad();
      const auto xs = x.chunk(m), ys = y.chunk(m);
      for (size_t i = 0; i < xs.size(); ++i) {
        (loss_fn(all->forward(xs[i]), ys[i]) * (static_cast<double>(xs[i].size(0)) / batch)).backward();
      }
      torch::nn::utils::clip_grad_norm_(params, 1.0);
      opt->step();
    }, none);
    optimizer = median_seconds(c, [&] {
      torch::nn::utils::clip_grad_norm_(params, 1.0);
      opt->step();
    }, none);
  }
  barrier();
  for (auto& lc : costs) {  // rank 0's figures on every rank (the others give 0)
    for (double* v : {&lc.forward, &lc.backward, &lc.backward_input, &lc.backward_weight}) {
      *v = group.max(*v);
    }
  }
  plain = group.max(plain);
  optimizer = group.max(optimizer);
  // The same plain step on every rank at once: how much slower a rank runs
  // while the others compute (1 on a machine with a free core per rank; a
  // shared or virtual machine gives less). The prediction is also given with
  // the layers' costs scaled by it.
  double together = 0;
  {
    torch::manual_seed(0);
    transformer_lm::Layers copy(vocab, c.blocks, 64, 4, context);
    auto all = copy.all();
    auto opt_copy = make_opt(all->parameters());
    together = group.max(median_seconds(c, [&] {
      opt_copy->zero_grad();
      const auto xs = x.chunk(m), ys = y.chunk(m);
      for (size_t i = 0; i < xs.size(); ++i) {
        (loss_fn(all->forward(xs[i]), ys[i]) * (static_cast<double>(xs[i].size(0)) / batch)).backward();
      }
      torch::nn::utils::clip_grad_norm_(all->parameters(), 1.0);
      opt_copy->step();
    }, barrier));
  }
  const double contention = together / plain;
  std::vector<lm_bench::LayerCost> contended = costs;
  for (auto& lc : contended) {
    for (double* v : {&lc.forward, &lc.backward, &lc.backward_input, &lc.backward_weight}) *v *= contention;
  }
  const auto split = lm_bench::split_of(costs, n);
  // A hand-off between ranks: identity stages, m micro-batches of one
  // activation each; the forward's time per micro-batch.
  double handoff = 0;
  {
    mpipe::ModelPipeline ids(mpipe::ModelPipelineOptions().process_group(group));
    const auto range = group.stage_range(n);
    for (int64_t s = range.first; s < range.second; ++s) ids->append(torch::nn::Identity(), "cpu");
    const auto acts = torch::randn({batch, context, 64});
    handoff = median_seconds(c, [&] {
      torch::NoGradGuard no_grad;
      ids->forward(acts, mpipe::chunks(m));
    }, barrier) / static_cast<double>(m);
  }
  nlohmann::json layer_rows = nlohmann::json::array();
  for (const auto& lc : costs) {
    layer_rows.push_back({{"forward_ms", lc.forward}, {"backward_ms", lc.backward},
                          {"backward_input_ms", lc.backward_input},
                          {"backward_weight_ms", lc.backward_weight}});
  }
  nlohmann::json out = {{"ranks", n}, {"micro_batches", m}, {"split", split}, {"layers", layer_rows},
                        {"plain_fair_ms", 1e3 * plain}, {"optimizer_ms", 1e3 * optimizer},
                        {"handoff_ms", 1e3 * handoff}, {"host_us_per_task", c.host_us},
                        {"plain_fair_all_ranks_at_once_ms", 1e3 * together},
                        {"contention", contention}};
  // The same stages in one process, a worker thread each (rank 0 alone).
  auto stages_of = [&] {
    std::vector<torch::nn::Sequential> stages;
    int64_t at = 0;
    for (int64_t s = 0; s < n; ++s) {
      torch::nn::Sequential stage;
      for (int64_t k = 0; k < split[static_cast<size_t>(s)]; ++k) layers.push(stage, at + k);
      at += split[static_cast<size_t>(s)];
      stages.push_back(stage);
    }
    return stages;
  };
  if (group.rank() == 0) {
    mpipe::ModelPipeline one;
    for (const auto& s : stages_of()) one->append(s, "cpu");
    auto one_opt = make_opt(one->parameters());
    const auto options = mpipe::TrainStepOptions(mpipe::chunks(m));
    out["one_process_threads_1f1b_ms"] = 1e3 * median_seconds(c, [&] {
      one_opt->zero_grad();
      one->train_step(x, y, loss_fn, options);
      mpipe::clip_grad_norm(*one, 1.0);
      one_opt->step();
    }, none);
  }
  barrier();
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group));
  {
    const auto range = group.stage_range(n);
    int64_t at = 0;
    for (int64_t s = 0; s < n; ++s) {
      torch::nn::Sequential stage;
      for (int64_t k = 0; k < split[static_cast<size_t>(s)]; ++k) layers.push(stage, at + k);
      at += split[static_cast<size_t>(s)];
      if (s >= range.first && s < range.second) pipe->append(stage, "cpu");
    }
  }
  auto opt = make_opt(pipe->parameters());
  const std::pair<const char*, mpipe::Schedule> schedules[] = {
      {"1f1b", mpipe::Schedule::OneFOneB},
      {"zbh1", mpipe::Schedule::ZeroBubbleH1},
      {"tailored", mpipe::Schedule::Tailored}};
  // One schedule's step, timed, against the prediction for it.
  auto time_step = [&](const char* name, mpipe::Schedule schedule, mpipe::ModelPipeline& p,
                       torch::optim::Optimizer& o, const mpipe::TrainStepOptions& options) {
    const double t = median_seconds(c, [&] {
      o.zero_grad();
      p->train_step(x, y, loss_fn, options);
      mpipe::clip_grad_norm(*p, 1.0);
      o.step();
    }, barrier);
    const double predicted =
        lm_bench::predict_ms(costs, n, schedule, m, c.host_us / 1e3, 1e3 * handoff) +
        1e3 * optimizer / static_cast<double>(n);
    const double predicted_contended =
        lm_bench::predict_ms(contended, n, schedule, m, c.host_us / 1e3, 1e3 * handoff) +
        1e3 * optimizer * contention / static_cast<double>(n);
    out[name] = {{"measured_ms", 1e3 * t}, {"predicted_ms", predicted},
                 {"measured_to_predicted", 1e3 * t / predicted},
                 {"predicted_with_contention_ms", predicted_contended},
                 {"measured_to_predicted_with_contention", 1e3 * t / predicted_contended},
                 {"speedup_vs_fair_plain", plain / t},
                 {"predicted_speedup_vs_fair_plain", 1e3 * plain / predicted}};
  };
  // Tailored is built for the measured costs (rank 0's, on every rank).
  const auto measured = lm_bench::stage_costs_of(costs, n, true, c.host_us / 1e3, 1e3 * handoff);
  for (const auto& sc : schedules) {
    auto options = mpipe::TrainStepOptions(mpipe::chunks(m)).schedule(sc.second);
    if (sc.second == mpipe::Schedule::Tailored) options.stage_costs(measured);
    time_step(sc.first, sc.second, pipe, *opt, options);
  }
  // The V: 2n stages, rank r holding stages r and 2n - 1 - r (stage_numbers).
  std::vector<std::pair<const char*, mpipe::Schedule>> ran(std::begin(schedules), std::end(schedules));
  if (2 * n <= layers.size()) {
    const auto v_split = lm_bench::split_of(costs, 2 * n);
    const auto mine = group.v_stages(2 * n);
    mpipe::ModelPipeline vee(
        mpipe::ModelPipelineOptions().process_group(group).stage_numbers(mine));
    int64_t at = 0;
    for (int64_t s = 0; s < 2 * n; ++s) {
      torch::nn::Sequential stage;
      for (int64_t k = 0; k < v_split[static_cast<size_t>(s)]; ++k) layers.push(stage, at + k);
      at += v_split[static_cast<size_t>(s)];
      if (s == mine[0] || s == mine[1]) vee->append(stage, "cpu");
    }
    auto v_opt = make_opt(vee->parameters());
    for (const auto& sc : {std::make_pair("zbv", mpipe::Schedule::ZeroBubbleV),
                           std::make_pair("dualpipev", mpipe::Schedule::DualPipeV)}) {
      time_step(sc.first, sc.second, vee, *v_opt,
                mpipe::TrainStepOptions(mpipe::chunks(m)).schedule(sc.second));
      ran.push_back(sc);
    }
  }
  // Predicted peak activations per rank, in one layer's activations of one
  // micro-batch (a stage of k layers holds k per micro-batch in flight).
  for (const auto& sc : ran) {
    const int64_t n_stages = lm_bench::stages_of(sc.second, n);
    const auto programs =
        sc.second == mpipe::Schedule::Tailored
            ? mpipe::choose_schedule(m, n_stages, mpipe::TrainStepOptions(1)
                                                      .schedule(sc.second)
                                                      .stage_costs(measured))
                  .programs
            : mpipe::programs_for(sc.second, m, n_stages);
    const auto sizes = lm_bench::split_of(costs, n_stages);
    const std::vector<double> per_stage(sizes.begin(), sizes.end());
    double peak = 0;
    for (const auto& p : programs) peak = std::max(peak, mpipe::schedules::peak_activations(p, per_stage));
    out[sc.first]["predicted_peak_layer_activations"] = peak;
  }
  barrier();
  if (group.rank() == 0) {
    std::printf("%s\n", out.dump(2).c_str());
    for (const auto& sc : ran) {
      const auto& e = out[sc.first];
      std::printf("lm %s on %lld ranks: %.1f ms measured, %.1f ms predicted (%.2f), %.1f ms "
                  "with the ranks' contention %.2f (%.2f); fair plain baseline %.1f ms: %.2fx "
                  "measured, %.2fx predicted; peak %.0f layer activations (predicted)\n",
                  sc.first, static_cast<long long>(n), e["measured_ms"].get<double>(),
                  e["predicted_ms"].get<double>(), e["measured_to_predicted"].get<double>(),
                  e["predicted_with_contention_ms"].get<double>(), contention,
                  e["measured_to_predicted_with_contention"].get<double>(), 1e3 * plain,
                  e["speedup_vs_fair_plain"].get<double>(),
                  e["predicted_speedup_vs_fair_plain"].get<double>(),
                  e["predicted_peak_layer_activations"].get<double>());
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
  app.add_flag("--lm", c.lm, "the transformer_lm example's model instead, against the prediction");
  app.add_option("--host-us", c.host_us, "--lm: the runtime's cost per task for the prediction (µs)");
  app.add_option("--blocks", c.blocks, "--lm: transformer blocks (2 + blocks layers)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  at::set_num_threads(1);
  at::set_num_interop_threads(1);
  auto group = mpipe::distributed::init_from_env();
  if (c.snn) return snn_main(c, group);
  if (c.lm) return lm_main(c, group);
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
