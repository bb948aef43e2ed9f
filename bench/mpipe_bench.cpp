// mpipe's benchmark: the four workloads of shared/notes/benchmark-workloads.md
// through mpipe and through plain LibTorch (the same stages called one after
// another), forward only and as a training step; and the memory and time of a
// training step under GPipe, 1F1B and checkpointing; and a training step under
// every schedule. Median of --reps runs
// after warm-up, each run ending when the device is idle. Prints a table and
// writes JSON (--json). See bench/README.md.

#include <mpipe/mpipe.h>
#include <mpipe/snn.h>

#include "lm_costs.h"

#include <ATen/Context.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>
#include <torch/version.h>

#ifdef MPIPE_BENCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace nn = torch::nn;
using json = nlohmann::json;

struct Config {
  int64_t reps = 15;
  int64_t warmup = 3;
  std::string device = "auto";
  std::string only;  // comma-separated workload names; empty: all
  std::string json_path;
  bool cpu_sizes = false;  // shrink the workloads (for CPUs and CI)
  bool inline_host = false;
  bool memory = true;
  std::string timelines;  // folder for the schedules' timelines (SVG, Chrome trace); empty: none
  std::string profile;    // folder for one profiled call per measurement; empty: none
  bool count_ops = false;
  std::string ops_by_name;  // folder for --count-ops' operations by name; empty: none
};

// --profile: after each measurement, one more call runs under LibTorch's
// profiler (Kineto: CPU ops of every thread, CUDA kernels), saved as a Chrome
// trace <dir>/<workload>.<n>.json; n counts the workload's measurements in
// the order of the JSON keys' assignments. bench/trace_summary.py reads them.
struct Profiling {
  std::string dir;
  std::string workload;
  int n = 0;
};
Profiling profiling;

void profile_once(const std::function<void()>& fn, const std::function<void()>& sync) {
  if (profiling.dir.empty()) return;
  namespace tp = torch::profiler::impl;
  const std::string path =
      profiling.dir + "/" + profiling.workload + "." + std::to_string(profiling.n++) + ".json";
  try {
    const tp::ProfilerConfig config(tp::ProfilerState::KINETO);
    std::set<tp::ActivityType> activities{tp::ActivityType::CPU};
    if (torch::cuda::is_available()) activities.insert(tp::ActivityType::CUDA);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
    fn();
    sync();
    torch::autograd::profiler::disableProfiler()->save(path);
    std::printf("profiled: %s\n", path.c_str());
  } catch (const c10::Error& e) {
    std::printf("profiling %s failed: %s\n", path.c_str(), e.what_without_backtrace());
  }
}

// --count-ops: the ATen operations one call makes, on every thread (worker
// threads and autograd's included), nested ones too. A host-side cost that
// does not depend on the machine's load: on a GPU most of them launch a
// kernel, so a row that makes more than its plain row pays for each one.
// With --ops-by-name DIR, each counted call's operations by name go to
// DIR/<workload>.<n>.txt, n numbered as --profile's traces.
struct OpCount {
  std::mutex mutex;
  int64_t total = 0;
  bool by_name = false;
  std::map<std::string, int64_t> names;
};
OpCount op_count;

int64_t count_ops(const std::function<void()>& fn) {
  {
    std::lock_guard<std::mutex> lock(op_count.mutex);
    op_count.total = 0;
    op_count.names.clear();
  }
  const auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& f) -> std::unique_ptr<at::ObserverContext> {
            std::lock_guard<std::mutex> lock(op_count.mutex);
            ++op_count.total;
            if (op_count.by_name) ++op_count.names[f.name()];
            return nullptr;
          })
          .scopes({at::RecordScope::FUNCTION}));
  fn();
  at::removeCallback(handle);
  std::lock_guard<std::mutex> lock(op_count.mutex);
  if (op_count.by_name && !profiling.dir.empty()) {
    const std::string path =
        profiling.dir + "/" + profiling.workload + "." + std::to_string(profiling.n++) + ".txt";
    std::ofstream out(path);
    for (const auto& n : op_count.names) out << n.second << " " << n.first << "\n";
  }
  return op_count.total;
}

/// The median of `v` (the mean of the middle two for an even count).
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct Timer {
  bool cuda;
  int64_t reps, warmup;
  /// Wraps every timed call (an autocast scope per call, as a training loop
  /// opens one per step); empty: none.
  std::function<void(const std::function<void()>&)> around;
  bool ops = false;  // --count-ops: each "time" is the ATen operations of one call
  double median_ms(const std::function<void()>& call) const {
    const std::function<void()> fn = around ? std::function<void()>([&] { around(call); }) : call;
    for (int64_t i = 0; i < warmup; ++i) fn();
    sync();
    if (ops) {
      const auto n = count_ops(fn);
      sync();
      return static_cast<double>(n);
    }
    std::vector<double> ms;
    for (int64_t r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      sync();
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                       .count());
    }
    profile_once(fn, [this] { sync(); });
    return median(std::move(ms));
  }
  /// Waits for every GPU, not just the current one: stages may sit on several.
  void sync() const {
    if (!cuda) return;
    for (int64_t d = 0; d < static_cast<int64_t>(torch::cuda::device_count()); ++d) torch::cuda::synchronize(d);
  }
};

/// r[key] = time(), or r[key + "_error"] = the error's text: a variant that
/// fails (a capture that is not possible, say) must not end the whole run.
void guarded(json& r, const std::string& key, const std::function<double()>& time) {
  try {
    r[key] = time();
  } catch (const c10::Error& e) {
    std::cerr << key << " failed: " << e.what_without_backtrace() << "\n";
    r[key + "_error"] = e.what_without_backtrace();
  } catch (const std::exception& e) {
    std::cerr << key << " failed: " << e.what() << "\n";
    r[key + "_error"] = e.what();
  }
}

std::vector<torch::Device> placement(const torch::Device& device, int64_t n) {
  // One GPU: every stage on it; N >= n GPUs: stage i on cuda:i.
  std::vector<torch::Device> out;
  const int64_t gpus = static_cast<int64_t>(torch::cuda::device_count());
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(device.is_cuda() && gpus >= n
                      ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(i))
                      : device);
  }
  return out;
}

torch::Tensor run_plain(std::vector<nn::Sequential>& stages,
                        const std::vector<torch::Device>& devices, torch::Tensor x) {
  for (size_t i = 0; i < stages.size(); ++i) x = stages[i]->forward(x.to(devices[i]));
  return x;
}

json mlp_workload(const Timer& timer, const torch::Device& device, int64_t width, int64_t depth,
                  int64_t batch, int64_t split, bool inline_host,
                  torch::Dtype dtype = torch::kFloat, bool mpipe_linear = false) {
  torch::manual_seed(0);
  const auto devices = placement(device, 4);
  std::vector<nn::Sequential> stages;
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().worker_threads(!inline_host));
  for (int s = 0; s < 4; ++s) {
    nn::Sequential stage;
    for (int64_t l = 0; l < depth / 4; ++l) {
      if (mpipe_linear) {
        stage->push_back(mpipe::Linear(width, width));
      } else {
        stage->push_back(nn::Linear(width, width));
      }
      stage->push_back(nn::ReLU());
    }
    stage->to(dtype);
    pipe->append(stage, devices[static_cast<size_t>(s)]);
    stages.push_back(stage);
  }
  auto x = torch::randn({batch, width}, torch::TensorOptions(devices.front()).dtype(dtype));
  auto target = torch::empty({batch, 1}, torch::TensorOptions(devices.back()));
  auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
  json r;
  {
    torch::NoGradGuard no_grad;
    r["plain_fwd_ms"] = timer.median_ms([&] { run_plain(stages, devices, x); });
    // Default options: on CUDA the repeated call is replayed from a graph
    // after two eager runs (Note [Automatic CUDA graphs]).
    r["mpipe_fwd_ms"] = timer.median_ms([&] { pipe->forward(x, split); });
    if (timer.cuda) {  // eager calls; the same stages replayed from a CUDA graph
      mpipe::ModelPipeline eager(mpipe::ModelPipelineOptions()
                                     .worker_threads(!inline_host)
                                     .auto_cuda_graphs(false));
      for (size_t s = 0; s < stages.size(); ++s) eager->append(stages[s], devices[s]);
      r["mpipe_eager_fwd_ms"] = timer.median_ms([&] { eager->forward(x, split); });
      mpipe::ModelPipeline graphed(mpipe::ModelPipelineOptions().cuda_graphs(true));
      for (size_t s = 0; s < stages.size(); ++s) graphed->append(stages[s], devices[s]);
      guarded(r, "mpipe_graph_fwd_ms",
              [&] { return timer.median_ms([&] { graphed->forward(x, split); }); });
      // Eager with one stream per stage (lanes(1)) and two lanes per GPU;
      // graphed with 2, 4 and 8 lanes (Note [Lanes]).
      for (const auto& lg : std::vector<std::pair<int64_t, bool>>{{1, false}, {2, false}, {2, true}, {4, true}, {8, true}}) {
        mpipe::ModelPipeline laned(mpipe::ModelPipelineOptions()
                                       .worker_threads(!inline_host)
                                       .lanes(lg.first)
                                       .cuda_graphs(lg.second)
                                       .auto_cuda_graphs(false));
        for (size_t s = 0; s < stages.size(); ++s) laned->append(stages[s], devices[s]);
        guarded(r, c10::str(lg.second ? "mpipe_graph_lanes" : "mpipe_lanes", lg.first, "_fwd_ms"),
                [&] { return timer.median_ms([&] { laned->forward(x, split); }); });
      }
    }
  }
  r["plain_train_ms"] = timer.median_ms([&] {
    pipe->zero_grad();
    run_plain(stages, devices, x).pow(2).mean().backward();
  });
  // Plain LibTorch on the same micro-batches (gradient accumulation, one
  // stream): what micro-batching itself costs, pipeline or not.
  r["plain_microbatch_train_ms"] = timer.median_ms([&] {
    pipe->zero_grad();
    const double n = static_cast<double>(x.numel());
    for (const auto& chunk : x.split(split)) run_plain(stages, devices, chunk).pow(2).sum().div(n).backward();
  });
  r["mpipe_train_ms"] = timer.median_ms([&] {
    pipe->zero_grad();
    pipe->train_step(x, target, loss_fn, mpipe::TrainStepOptions(split));
  });
  r["mpipe_fwd_bwd_ms"] = timer.median_ms([&] {
    pipe->zero_grad();
    pipe->forward(x, split).pow(2).mean().backward();
  });
  if (timer.cuda) {  // the whole step (forward and backward) replayed from a CUDA graph
    mpipe::ModelPipeline graphed(mpipe::ModelPipelineOptions().cuda_graphs(true));
    for (size_t s = 0; s < stages.size(); ++s) graphed->append(stages[s], devices[s]);
    guarded(r, "mpipe_graph_train_ms", [&] {
      return timer.median_ms([&] {
        graphed->zero_grad();
        graphed->train_step(x, target, loss_fn, mpipe::TrainStepOptions(split));
      });
    });
    r["mpipe_graph_train_graphs"] = graphed->cuda_graphs_captured();  // 1: it was replayed
  }
  return r;
}

json snn_workload(const Timer& timer, const torch::Device& device, int64_t width, int64_t batch,
                  int64_t T, bool inline_host) {
  torch::manual_seed(0);
  const auto devices = placement(device, 4);
  // The same Linear layers with fused LIF neurons (the default) and with the
  // ATen path (Note [Fused neurons]).
  // And as multi-step stages (SeqToANN(Linear), multi-step LIF), which the
  // pipeline feeds time chunks (Note [Time chunks]).
  std::vector<nn::Sequential> stages, aten_stages, multi_stages;
  const auto options = mpipe::ModelPipelineOptions().worker_threads(!inline_host);
  mpipe::ModelPipeline pipe(options), aten_pipe(options), multi_pipe(options);
  const auto multi = mpipe::snn::LIFNodeOptions().step_mode(mpipe::snn::StepMode::Multi);
  for (int s = 0; s < 4; ++s) {
    // LIF: tau 2, decay_input, v_threshold 1, hard reset to 0, Sigmoid(alpha 4).
    nn::Linear fc(width, width);
    nn::Sequential stage(fc, mpipe::snn::LIFNode());
    nn::Sequential aten_stage(fc, mpipe::snn::LIFNode(mpipe::snn::LIFNodeOptions().fused(false)));
    nn::Sequential multi_stage{mpipe::snn::SeqToANN(fc), mpipe::snn::LIFNode(multi)};
    pipe->append(stage, devices[static_cast<size_t>(s)]);
    aten_pipe->append(aten_stage, devices[static_cast<size_t>(s)]);
    multi_pipe->append(multi_stage, devices[static_cast<size_t>(s)]);
    stages.push_back(stage);
    aten_stages.push_back(aten_stage);
    multi_stages.push_back(multi_stage);
  }
  const std::vector<int64_t> chunks{1, 2, 4, 8, T};
  auto x = torch::rand({batch, width}, torch::TensorOptions(devices.front())) * 2;
  auto loop = [&] {
    mpipe::reset_states(*pipe);
    torch::Tensor out;
    for (int64_t t = 0; t < T; ++t) {
      auto y = run_plain(stages, devices, x);
      out = out.defined() ? out + y : y;
    }
    return out;
  };
  auto piped = [&](mpipe::ModelPipeline& p) {
    mpipe::reset_states(*p);
    return p->constant_forward(x, T, true);
  };
  const auto mean = [](const torch::Tensor& y, const torch::Tensor&) { return y.mean(); };
  json r;
  {
    torch::NoGradGuard no_grad;
    r["plain_loop_fwd_ms"] = timer.median_ms([&] { loop(); });
    r["mpipe_aten_constant_fwd_ms"] = timer.median_ms([&] { piped(aten_pipe); });
    r["mpipe_constant_fwd_ms"] = timer.median_ms([&] { piped(pipe); });
    if (timer.cuda) {  // the same stages, replayed from a CUDA graph
      mpipe::ModelPipeline graphed(mpipe::ModelPipelineOptions().cuda_graphs(true));
      for (size_t s = 0; s < stages.size(); ++s) graphed->append(stages[s], devices[s]);
      guarded(r, "mpipe_graph_constant_fwd_ms",
              [&] { return timer.median_ms([&] { piped(graphed); }); });
    }
    // Multi-step stages: a plain call on all T steps, and the pipeline's chunks.
    r["plain_multistep_fwd_ms"] = timer.median_ms([&] {
      mpipe::reset_states(*multi_pipe);
      run_plain(multi_stages, devices, x.unsqueeze(0).expand({T, batch, width})).sum(0);
    });
    for (int64_t k : chunks) {
      r["mpipe_chunk" + std::to_string(k) + "_constant_fwd_ms"] = timer.median_ms([&] {
        mpipe::reset_states(*multi_pipe);
        multi_pipe->constant_forward(x, T, true, k);
      });
    }
    if (timer.cuda) {
      mpipe::ModelPipeline graphed(mpipe::ModelPipelineOptions().cuda_graphs(true));
      for (size_t s = 0; s < multi_stages.size(); ++s) graphed->append(multi_stages[s], devices[s]);
      for (int64_t k : {int64_t{4}, T}) {
        guarded(r, "mpipe_graph_chunk" + std::to_string(k) + "_constant_fwd_ms", [&] {
          return timer.median_ms([&] {
            mpipe::reset_states(*graphed);  // as every row: state reset before the call
            graphed->constant_forward(x, T, true, k);
          });
        });
      }
    }
  }
  mpipe::reset_states(*multi_pipe);
  r["plain_multistep_train_ms"] = timer.median_ms([&] {
    multi_pipe->zero_grad();
    run_plain(multi_stages, devices, x.unsqueeze(0).expand({T, batch, width}))
        .sum(0)
        .mean()
        .backward();
    mpipe::reset_states(*multi_pipe);
  });
  for (int64_t k : chunks) {
    r["mpipe_chunk" + std::to_string(k) + "_constant_train_step_ms"] = timer.median_ms([&] {
      multi_pipe->zero_grad();
      multi_pipe->constant_train_step(x, T, torch::Tensor(), mean, k);
    });
  }
  // Micro-batches x time chunks (Note [Micro-batches over time]): M
  // micro-batches of chunks of k steps, M * T / k items.
  for (const auto& mk : std::vector<std::pair<int64_t, int64_t>>{
           {2, T}, {4, T}, {8, T}, {2, 8}, {4, 4}}) {
    r["mpipe_mb" + std::to_string(mk.first) + "_chunk" + std::to_string(mk.second) +
      "_constant_train_step_ms"] = timer.median_ms([&] {
      multi_pipe->zero_grad();
      multi_pipe->constant_train_step(x, T, torch::Tensor(), mean, mk.second,
                                      mpipe::chunks(mk.first));
    });
  }
  if (timer.cuda) {
    mpipe::ModelPipeline graphed(mpipe::ModelPipelineOptions().cuda_graphs(true));
    for (size_t s = 0; s < multi_stages.size(); ++s) graphed->append(multi_stages[s], devices[s]);
    for (int64_t k : {int64_t{4}, T}) {
      guarded(r, "mpipe_graph_chunk" + std::to_string(k) + "_constant_train_ms", [&] {
        return timer.median_ms([&] {
          graphed->zero_grad();
          graphed->constant_train_step(x, T, torch::Tensor(), mean, k);
        });
      });
    }
  }
  r["plain_loop_train_ms"] = timer.median_ms([&] {
    pipe->zero_grad();
    loop().mean().backward();
  });
  mpipe::reset_states(*pipe);
  r["mpipe_aten_constant_train_ms"] = timer.median_ms([&] {
    aten_pipe->zero_grad();
    piped(aten_pipe).mean().backward();
  });
  // Neuron state holds the last step's autograd graph; drop it, as training
  // code does after each step (a live graph also blocks graph capture).
  mpipe::reset_states(*aten_pipe);
  mpipe::reset_states(*pipe);
  r["mpipe_constant_train_ms"] = timer.median_ms([&] {
    pipe->zero_grad();
    piped(pipe).mean().backward();
  });
  mpipe::reset_states(*pipe);
  r["mpipe_constant_train_step_ms"] = timer.median_ms([&] {
    pipe->zero_grad();
    pipe->constant_train_step(x, T, torch::Tensor(), mean);
  });
  if (timer.cuda) {  // forward and backward replayed from one CUDA graph
    mpipe::ModelPipeline graphed(mpipe::ModelPipelineOptions().cuda_graphs(true));
    for (size_t s = 0; s < stages.size(); ++s) graphed->append(stages[s], devices[s]);
    guarded(r, "mpipe_graph_constant_train_ms", [&] {
      return timer.median_ms([&] {
        graphed->zero_grad();
        graphed->constant_train_step(x, T, torch::Tensor(), mean);
      });
    });
    r["mpipe_graph_constant_train_graphs"] = graphed->cuda_graphs_captured();
  }
  return r;
}

/// Peak memory and time of one training step under each schedule and
/// checkpointing mode (CUDA only: the caching allocator's statistics).
json memory_workload(const Timer& timer, const torch::Device& device, int64_t width,
                     int64_t layers_per_stage, int64_t batch, int64_t split, bool inline_host) {
  json out = json::array();
#ifdef MPIPE_BENCH_CUDA
  const auto devices = placement(device, 4);
  struct Mode {
    const char* name;
    mpipe::Schedule schedule;
    mpipe::Checkpoint checkpoint;
    int64_t virtual_stages;  // stages = 4 * virtual_stages, the same layers
  };
  for (const Mode& mode : {Mode{"gpipe", mpipe::Schedule::GPipe, mpipe::Checkpoint::Never, 1},
                           Mode{"1f1b", mpipe::Schedule::OneFOneB, mpipe::Checkpoint::Never, 1},
                           Mode{"zb-h1", mpipe::Schedule::ZeroBubbleH1, mpipe::Checkpoint::Never, 1},
                           Mode{"interleaved-1f1b(v=2)", mpipe::Schedule::Interleaved1F1B,
                                mpipe::Checkpoint::Never, 2},
                           Mode{"gpipe+checkpoint(except_last)", mpipe::Schedule::GPipe,
                                mpipe::Checkpoint::ExceptLast, 1},
                           Mode{"1f1b+checkpoint(always)", mpipe::Schedule::OneFOneB,
                                mpipe::Checkpoint::Always, 1}}) {
    torch::manual_seed(0);
    timer.sync();
    // Frees the blocks earlier modes left waiting on stream events, so every
    // mode starts from the same baseline.
    c10::cuda::CUDACachingAllocator::emptyCache();
    mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions()
                                  .worker_threads(!inline_host)
                                  .checkpoint(mode.checkpoint));
    const int64_t n_stages = 4 * mode.virtual_stages;
    for (int64_t s = 0; s < n_stages; ++s) {  // stage s on the device of stage s % 4
      nn::Sequential stage;
      for (int64_t l = 0; l < 4 * layers_per_stage / n_stages; ++l) {
        stage->push_back(nn::Linear(width, width));
        stage->push_back(nn::ReLU());
      }
      pipe->append(stage, devices[static_cast<size_t>(s % 4)]);
    }
    auto x = torch::randn({batch, width}, torch::TensorOptions(devices.front()));
    auto target = torch::empty({batch, 1}, torch::TensorOptions(devices.back()));
    auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
    auto step = [&] {
      pipe->zero_grad();
      pipe->train_step(x, target, loss_fn,
                       mpipe::TrainStepOptions(split).schedule(mode.schedule).virtual_stages(
                           mode.virtual_stages));
    };
    step();  // gradients allocated, as in steady training
    timer.sync();
    c10::cuda::CUDACachingAllocator::emptyCache();
    json r;
    r["mode"] = mode.name;
    std::map<int, bool> seen;
    for (const auto& d : devices) {
      if (seen[d.index()]) continue;
      seen[d.index()] = true;
      c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
    }
    const auto base = c10::cuda::CUDACachingAllocator::getDeviceStats(devices.front().index());
    step();
    timer.sync();
    json peaks = json::object(), above = json::object();
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    for (const auto& kv : seen) {
      const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(kv.first);
      peaks["cuda:" + std::to_string(kv.first)] = stats.allocated_bytes[agg].peak / 1048576.0;
      if (kv.first == devices.front().index()) {
        r["before_step_mib"] = base.allocated_bytes[agg].current / 1048576.0;
        above["cuda:" + std::to_string(kv.first)] =
            (stats.allocated_bytes[agg].peak - base.allocated_bytes[agg].current) / 1048576.0;
      }
    }
    r["peak_allocated_mib"] = peaks;
    // With one device, the step's own memory (activations, gradients in flight).
    if (seen.size() == 1) r["step_peak_above_baseline_mib"] = above;
    r["train_ms"] = timer.median_ms(step);
    out.push_back(r);
  }
#else
  (void)timer, (void)device, (void)width, (void)layers_per_stage, (void)batch, (void)split,
      (void)inline_host;
#endif
  return out;
}

/// One training step of an MLP (depth Linear+ReLU layers of `width`) under
/// each schedule: GPipe, 1F1B and ZB-H1 over 4 stages, Interleaved1F1B over
/// 8 stages (2 chunks per worker, stage s on the device of stage s % 4), ZB-V
/// over 8 stages in a V, and Tailored and Auto with each stage's costs from
/// balance::profile_time. Each row: the
/// median step time, its peak allocated memory above the step's start (CUDA),
/// and a recorded step's measured bubble beside the schedule's predicted one;
/// with `timeline_dir`, that step's timeline as SVG and Chrome trace.
json schedules_workload(const Timer& timer, const torch::Device& device, const std::string& name,
                        int64_t width, int64_t depth, int64_t batch, int64_t split,
                        bool inline_host, const std::string& timeline_dir) {
  json out = json::array();
  const auto devices4 = placement(device, 4);
  torch::manual_seed(0);
  std::vector<nn::Linear> layers;  // the same layers for every schedule, each followed by ReLU
  for (int64_t l = 0; l < depth; ++l) layers.emplace_back(width, width);
  for (auto& l : layers) l->to(devices4.front());
  auto x = torch::randn({batch, width}, torch::TensorOptions(devices4.front()));
  auto target = torch::empty({batch, 1}, torch::TensorOptions(devices4.back()));
  auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
  // Auto's costs: forward + backward of each stage for one micro-batch
  // (balance::profile_time on a micro-batch, balance::stage_costs).
  mpipe::schedules::Costs costs;
  {
    nn::Sequential all;
    for (auto& l : layers) {
      all->push_back(l);
      all->push_back(nn::ReLU());
    }
    const auto per_layer = mpipe::balance::profile_time(all, x.narrow(0, 0, split), 3);
    costs = mpipe::balance::stage_costs(per_layer, std::vector<int64_t>(4, 2 * depth / 4));
    for (auto& l : layers) l->zero_grad();
  }
  struct Mode {
    std::string name;
    mpipe::Schedule schedule;
    int64_t stages;
    std::string file;
  };
  const std::vector<Mode> modes = {
      {"gpipe", mpipe::Schedule::GPipe, 4, "gpipe"},
      {"1f1b", mpipe::Schedule::OneFOneB, 4, "1f1b"},
      {"zb-h1", mpipe::Schedule::ZeroBubbleH1, 4, "zb-h1"},
      {"interleaved-1f1b(v=2)", mpipe::Schedule::Interleaved1F1B, 8, "interleaved-1f1b-v2"},
      {"zb-v", mpipe::Schedule::ZeroBubbleV, 8, "zb-v"},
      {"dualpipe-v", mpipe::Schedule::DualPipeV, 8, "dualpipe-v"},
      {"tailored", mpipe::Schedule::Tailored, 4, "tailored"},
      {"auto", mpipe::Schedule::Auto, 4, "auto"}};
  for (const Mode& mode : modes) {
    json r;
    r["workload"] = name;
    r["schedule"] = mode.name;
    auto build = [&](bool record) {
      mpipe::ModelPipeline pipe(
          mpipe::ModelPipelineOptions().worker_threads(!inline_host).record_timeline(record));
      for (int64_t s = 0; s < mode.stages; ++s) {
        nn::Sequential stage;
        for (int64_t l = s * depth / mode.stages; l < (s + 1) * depth / mode.stages; ++l) {
          stage->push_back(layers[static_cast<size_t>(l)]);
          stage->push_back(nn::ReLU());
        }
        // Interleaved: stage s on worker s % 4's device; ZB-V, DualPipeV: in a V.
        const bool vee = mode.schedule == mpipe::Schedule::ZeroBubbleV ||
                         mode.schedule == mpipe::Schedule::DualPipeV;
        const int64_t worker = vee ? (s < 4 ? s : 7 - s) : s % 4;
        pipe->append(stage, devices4[static_cast<size_t>(worker)]);
      }
      return pipe;
    };
    const bool costed = mode.schedule == mpipe::Schedule::Auto ||
                        mode.schedule == mpipe::Schedule::Tailored;
    const auto options =
        mpipe::TrainStepOptions(split)
            .schedule(mode.schedule)
            .virtual_stages(mode.schedule == mpipe::Schedule::Interleaved1F1B ? 2 : 1)
            .stage_costs(costed ? costs : mpipe::schedules::Costs{});
    guarded(r, "train_ms", [&] {
      auto pipe = build(false);
      auto step = [&] {
        pipe->zero_grad();
        pipe->train_step(x, target, loss_fn, options);
      };
#ifdef MPIPE_BENCH_CUDA
      if (timer.cuda) {
        step();
        timer.sync();
        c10::cuda::CUDACachingAllocator::resetPeakStats(devices4.front().index());
        const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
        const auto base = c10::cuda::CUDACachingAllocator::getDeviceStats(devices4.front().index())
                              .allocated_bytes[agg].current;
        step();
        timer.sync();
        const auto peak = c10::cuda::CUDACachingAllocator::getDeviceStats(devices4.front().index())
                              .allocated_bytes[agg].peak;
        r["step_peak_above_start_mib"] = static_cast<double>(peak - base) / 1048576.0;
      }
#endif
      return timer.median_ms(step);
    });
    guarded(r, "bubble_measured", [&] {
      auto pipe = build(true);
      pipe->zero_grad();
      pipe->train_step(x, target, loss_fn, options);  // warm-up
      pipe->zero_grad();
      pipe->train_step(x, target, loss_fn, options);
      const mpipe::Timeline t = pipe->timeline();
      r["bubble_schedule"] = t.schedule_bubble;
      r["ran"] = t.schedule;
      r["recorded_makespan_ms"] = t.makespan_ms();
      if (!timeline_dir.empty()) {
        std::filesystem::create_directories(timeline_dir);
        const std::string stem = timeline_dir + "/timeline-" + name + "-" + mode.file;
        t.save_svg(stem + ".svg");
        t.save_chrome_trace(stem + ".json");
      }
      return t.bubble_fraction();
    });
    if (mode.schedule == mpipe::Schedule::Auto) {
      std::vector<int64_t> labels;  // stages on one device share it
      for (const auto& d : devices4) labels.push_back(d.is_cuda() ? d.index() : -1);
      const auto choice = mpipe::choose_schedule((batch - 1) / split + 1, 4, options, labels);
      json preds = json::array();
      for (const auto& c : choice.candidates) {
        preds.push_back({{"schedule", mpipe::to_string(c.schedule)}, {"predicted_ms", c.time},
                         {"bubble", c.bubble}});
      }
      r["predictions"] = preds;
    }
    for (auto& l : layers) l->zero_grad();
    out.push_back(r);
  }
  return out;
}

/// Training throughput of wide-mlp's stages on 1, 2 and 4 GPUs (stage s on
/// cuda:(s * g / 4)) with 8 and 32 micro-batches, GPipe; each row with its
/// speed-up over one GPU and the ideal m * g / (m + g - 1) of a fill-drain
/// pipeline over g devices (issue 7). On the CPU, one row per m.
json scaling_workload(const Timer& timer, const torch::Device& device, int64_t width,
                      int64_t layers_per_stage, int64_t batch, bool inline_host) {
  json out = json::array();
  const int64_t gpus = device.is_cuda() ? static_cast<int64_t>(torch::cuda::device_count()) : 1;
  std::map<int64_t, double> one_gpu_ms;  // by micro-batch count
  for (int64_t g : {1, 2, 4}) {
    if (g > gpus) break;
    for (int64_t m : {8, 32}) {
      torch::manual_seed(0);
      mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().worker_threads(!inline_host));
      std::vector<torch::Device> devices;
      for (int64_t s = 0; s < 4; ++s) {
        devices.push_back(device.is_cuda()
                              ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(s * g / 4))
                              : device);
        nn::Sequential stage;
        for (int64_t l = 0; l < layers_per_stage; ++l) {
          stage->push_back(nn::Linear(width, width));
          stage->push_back(nn::ReLU());
        }
        pipe->append(stage, devices.back());
      }
      auto x = torch::randn({batch, width}, torch::TensorOptions(devices.front()));
      auto target = torch::empty({batch, 1}, torch::TensorOptions(devices.back()));
      auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
      const double ms = timer.median_ms([&] {
        pipe->zero_grad();
        pipe->train_step(x, target, loss_fn, mpipe::TrainStepOptions(batch / m));
      });
      if (g == 1) one_gpu_ms[m] = ms;
      json r;
      r["gpus"] = g;
      r["micro_batches"] = m;
      r["train_ms"] = ms;
      r["samples_per_s"] = static_cast<double>(batch) / ms * 1000.0;
      r["speedup"] = one_gpu_ms[m] / ms;
      r["ideal_speedup"] = static_cast<double>(m * g) / static_cast<double>(m + g - 1);
      r["efficiency"] = r["speedup"].get<double>() / r["ideal_speedup"].get<double>();
      out.push_back(r);
    }
  }
  return out;
}

/// Beside each timing "<base>_ms" of `r`: "<base>_tflops" (a training step
/// counts 3x the forward's flops) and "<base>_of_peak", its share of `peak_tflops`.
void add_tflops(json& r, double fwd_flops, double peak_tflops) {
  json extra;
  for (auto it = r.begin(); it != r.end(); ++it) {
    const std::string key = it.key();
    if (!it->is_number() || key.size() < 3 || key.compare(key.size() - 3, 3, "_ms") != 0) continue;
    const bool train = key.find("train") != std::string::npos || key.find("fwd_bwd") != std::string::npos;
    const double tflops = (train ? 3 : 1) * fwd_flops / (it->get<double>() * 1e-3) / 1e12;
    const std::string base = key.substr(0, key.size() - 3);
    extra[base + "_tflops"] = tflops;
    extra[base + "_of_peak"] = tflops / peak_tflops;
  }
  r.update(extra);
}

/// A pre-norm transformer block: LayerNorm, QKV, causal attention, projection,
/// LayerNorm, MLP (4x, GELU), each with a residual. Its Linears are
/// mpipe::Linear (aten::linear, as Python's nn.Linear: Note [Linear under
/// autocast]), so it runs the ops of the reference runner's block.
struct BlockImpl : nn::Module {
  BlockImpl(int64_t d, int64_t heads) : heads(heads) {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({d})));
    qkv = register_module("qkv", mpipe::Linear(d, 3 * d));
    proj = register_module("proj", mpipe::Linear(d, d));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", mpipe::Linear(d, 4 * d));
    fc2 = register_module("fc2", mpipe::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) {
    const int64_t b = x.size(0), s = x.size(1), d = x.size(2);
    const auto parts = qkv(ln1(x)).view({b, s, 3, heads, d / heads}).permute({2, 0, 3, 1, 4});
    const auto q = parts[0], k = parts[1], v = parts[2];
#if TORCH_VERSION_MAJOR >= 2
    torch::Tensor a = at::scaled_dot_product_attention(q, k, v, c10::nullopt, 0.0, /*is_causal=*/true);
#else  // LibTorch 1.13: attention written out
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d / heads));
    const auto mask = torch::ones({s, s}, torch::TensorOptions(x.device()).dtype(torch::kBool)).triu(1);
    torch::Tensor a = torch::matmul(scores.masked_fill(mask, -INFINITY).softmax(-1), v);
#endif
    x = x + proj(a.transpose(1, 2).reshape({b, s, d}));
    return x + fc2(torch::gelu(fc1(ln2(x))));
  }
  int64_t heads;
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  mpipe::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

/// 8 blocks in 4 stages, trained in bf16 autocast (fp32 weights: `timer`
/// opens the scope around each call), loss
/// mean(y^2): plain LibTorch on the whole batch, and mpipe with micro-batches
/// of 1 and 2 sequences under 1F1B.
json transformer_workload(const Timer& timer, const torch::Device& device, int64_t d,
                          int64_t heads, int64_t seq, int64_t batch, double peak_tflops,
                          bool inline_host) {
  torch::manual_seed(0);
  const auto devices = placement(device, 4);
  std::vector<nn::Sequential> stages;
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().worker_threads(!inline_host));
  for (int s = 0; s < 4; ++s) {
    nn::Sequential stage(Block(d, heads), Block(d, heads));
    pipe->append(stage, devices[static_cast<size_t>(s)]);
    stages.push_back(stage);
  }
  const auto x = torch::randn({batch, seq, d}, torch::TensorOptions(devices.front()));
  const auto target = torch::empty({batch, 1}, torch::TensorOptions(devices.back()));
  auto loss_fn = [](const torch::Tensor& y, const torch::Tensor&) { return y.pow(2).mean(); };
  json r;
  r["plain_train_ms"] = timer.median_ms([&] {
    pipe->zero_grad();
    run_plain(stages, devices, x).pow(2).mean().backward();
  });
  for (int64_t split : {int64_t{1}, int64_t{2}}) {
    for (auto schedule : {mpipe::Schedule::OneFOneB, mpipe::Schedule::GPipe}) {
      const std::string key = std::string("mpipe_") + (schedule == mpipe::Schedule::GPipe ? "gpipe" : "1f1b") +
                              "_split" + std::to_string(split) + "_train_ms";
      guarded(r, key, [&] {
        return timer.median_ms([&] {
          pipe->zero_grad();
          pipe->train_step(x, target, loss_fn, mpipe::TrainStepOptions(split).schedule(schedule));
        });
      });
    }
  }
  // Forward flops: per token and block, 24 d^2 in the Linears and 4 s d in
  // attention (counted as if it were not causal).
  const double fwd = 8.0 * static_cast<double>(batch * seq) *
                     (24.0 * static_cast<double>(d * d) + 4.0 * static_cast<double>(seq * d));
  add_tflops(r, fwd, peak_tflops);
  return r;
}

/// Medians (ms) of `calls`, each timed once per repetition in turn, so that
/// a machine whose speed drifts during the run slows them alike. With
/// --count-ops, each call's ATen operations (Timer::median_ms).
std::vector<double> interleaved_ms(const Timer& timer, const std::vector<std::function<void()>>& calls) {
  std::vector<double> out;
  if (timer.ops) {
    for (const auto& c : calls) out.push_back(timer.median_ms(c));
    return out;
  }
  for (int64_t i = 0; i < timer.warmup; ++i) {
    for (const auto& c : calls) c();
  }
  timer.sync();
  std::vector<std::vector<double>> ms(calls.size());
  for (int64_t rep = 0; rep < timer.reps; ++rep) {
    for (size_t k = 0; k < calls.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      calls[k]();
      timer.sync();
      ms[k].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  for (auto& m : ms) out.push_back(median(std::move(m)));
  for (const auto& c : calls) profile_once(c, [&timer] { timer.sync(); });  // --profile
  return out;
}

/// The host's own latency for waking a sleeping thread (µs): half the round
/// trip of a condition-variable ping-pong between two threads, median over
/// the timer's repetitions of 200 round trips each. Worker threads pay it
/// whenever a stage's input arrives while its thread sleeps.
double wake_us(const Timer& timer) {
  std::mutex m;
  std::condition_variable cv;
  int turn = 0;  // 1: the partner's move, 0: the main thread's; -1: stop
  std::thread partner([&] {
    std::unique_lock<std::mutex> lock(m);
    for (;;) {
      cv.wait(lock, [&] { return turn != 0; });
      if (turn < 0) return;
      turn = 0;
      cv.notify_all();
    }
  });
  const int64_t trips = 200;
  const double ms = timer.median_ms([&] {
    std::unique_lock<std::mutex> lock(m);
    for (int64_t k = 0; k < trips; ++k) {
      turn = 1;
      cv.notify_all();
      cv.wait(lock, [&] { return turn == 0; });
    }
  });
  {
    std::lock_guard<std::mutex> lock(m);
    turn = -1;
  }
  cv.notify_all();
  partner.join();
  return 1e3 * ms / static_cast<double>(2 * trips);
}

/// `calls[k]` on a thread of its own, with `streams[k]` current if given,
/// all started at once: the time (µs) from the start until the last thread
/// is done and `sync` has returned on it. Each thread makes its call once
/// before the start (its first use of the GPU's libraries) and spins until
/// the start, so no thread's setup or wake-up is timed. Where the threads
/// take as long as one thread making all the calls, they contend (on a GPU:
/// for the driver's and the caching allocator's locks).
double on_threads_at_once_us(const std::vector<std::function<void()>>& calls,
                             const std::vector<c10::Stream>& streams,
                             const std::function<void()>& sync) {
  using clock = std::chrono::steady_clock;
  const auto n = static_cast<int>(calls.size());
  std::atomic<int> ready{0}, done{0};
  std::atomic<bool> go{false};
  clock::time_point start, end;
  std::vector<std::thread> threads;
  for (size_t k = 0; k < calls.size(); ++k) {
    threads.emplace_back([&, k] {
      c10::optional<c10::StreamGuard> stream;
      if (k < streams.size()) stream.emplace(streams[k]);
      torch::NoGradGuard no_grad;
      calls[k]();
      ++ready;
      while (!go.load()) std::this_thread::yield();
      calls[k]();
      if (++done == n) {
        sync();
        end = clock::now();
      }
    });
  }
  while (ready.load() < n) std::this_thread::yield();
  start = clock::now();
  go = true;
  for (auto& t : threads) t.join();
  return std::chrono::duration<double, std::micro>(end - start).count();
}

/// The runtime's own cost per task: 4 stages of one Linear(4, 4) and 8
/// micro-batches of one row, so the work is nothing and the time is host
/// overhead. Plain: the same 32 stage calls in a loop on the caller's thread.
json overhead_workload(const Timer& timer, const torch::Device& device) {
  torch::manual_seed(0);
  std::vector<nn::Sequential> stages;
  for (int s = 0; s < 4; ++s) {
    stages.push_back(nn::Sequential(nn::Linear(4, 4)));
    stages.back()->to(device);  // the plain loop runs them before the pipeline moves them
  }
  const auto x = torch::randn({8, 4}, torch::TensorOptions(device));
  const auto y = torch::randn({8, 4}, torch::TensorOptions(device));
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) { return (o - t).pow(2).mean(); };
  // The runtime's own cost: eager calls (no automatic graphs), with worker
  // threads and inline, against the plain loop of the same 32 stage calls.
  // They are timed in turn within each repetition (interleaved_ms): the
  // machine's speed drifts by tens of percent between runs, and a difference
  // of a few µs per call would drown in it.
  auto make = [&](bool threads, int64_t lanes = 0) {
    mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions()
                                  .worker_threads(threads)
                                  .lanes(lanes)
                                  .auto_cuda_graphs(false));
    for (auto& st : stages) pipe->append(st, device);
    return pipe;
  };
  mpipe::ModelPipeline threaded = make(true), inline_ = make(false);
  json r;
  {
    torch::NoGradGuard no_grad;
    std::vector<std::function<void()>> calls = {[&] {
                                                  for (int i = 0; i < 8; ++i) {
                                                    torch::Tensor h = x.narrow(0, i, 1);
                                                    for (auto& st : stages) h = st->forward(h);
                                                  }
                                                },
                                                [&] { threaded->forward(x, 1); },
                                                [&] { inline_->forward(x, 1); }};
    // On a GPU also each stage on its own stream (lanes(1)): an event per hand-off.
    mpipe::ModelPipeline own_streams{nullptr};
    if (timer.cuda) {
      own_streams = make(true, 1);
      calls.push_back([&] { own_streams->forward(x, 1); });
    }
    const auto ms = interleaved_ms(timer, calls);
    r["plain_32_calls_us"] = 1e3 * ms[0];
    // The host, without mpipe: the same 32 calls as 4 threads of 8 (thread s
    // calls stage s), started at once, against the plain loop's one thread,
    // and the latency of waking a thread (docs/performance.md).
    if (!timer.ops) {
      std::vector<std::function<void()>> per_stage;
      std::vector<c10::Stream> streams;  // the same four in every repetition
      for (auto& st : stages) {
        per_stage.push_back([&x, st]() mutable {
          for (int i = 0; i < 8; ++i) st->forward(x.narrow(0, i, 1));
        });
        if (device.is_cuda()) {
          streams.push_back(c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device));
        }
      }
      std::vector<double> us;
      for (int64_t k = 0; k < timer.warmup + timer.reps; ++k) {
        const double t = on_threads_at_once_us(per_stage, streams, [&timer] { timer.sync(); });
        if (k >= timer.warmup) us.push_back(t);
      }
      r["plain_32_calls_4_threads_us"] = median(std::move(us));
      r["host_wake_us"] = wake_us(timer);
    }
    r["forward_threads_us"] = 1e3 * ms[1];
    r["forward_inline_us"] = 1e3 * ms[2];
    if (timer.cuda) {
      r["forward_threads_lanes1_us"] = 1e3 * ms[3];
      r["forward_threads_lanes1_added_per_task_us"] = (ms[3] - ms[0]) * 1e3 / 32;
    }
  }
  {
    const auto ms = interleaved_ms(timer, {[&] {
                                             for (int i = 0; i < 8; ++i) {
                                               torch::Tensor h = x.narrow(0, i, 1);
                                               for (auto& st : stages) h = st->forward(h);
                                               loss_fn(h, y.narrow(0, i, 1)).backward();
                                             }
                                           },
                                           [&] {
                                             threaded->train_step(x, y, loss_fn,
                                                                  mpipe::TrainStepOptions(1));
                                           },
                                           [&] {
                                             inline_->train_step(x, y, loss_fn,
                                                                 mpipe::TrainStepOptions(1));
                                           }});
    r["plain_32_calls_train_us"] = 1e3 * ms[0];
    r["train_step_threads_us"] = 1e3 * ms[1];
    r["train_step_inline_us"] = 1e3 * ms[2];
  }
  for (const std::string mode : {"threads", "inline"}) {
    // What the pipeline adds to the plain loop, per call and per task, and
    // the ratio that the smoke test guards.
    const double fwd = r["forward_" + mode + "_us"], train = r["train_step_" + mode + "_us"];
    const double plain_fwd = r["plain_32_calls_us"], plain_train = r["plain_32_calls_train_us"];
    r["forward_" + mode + "_per_task_us"] = fwd / 32;
    r["train_step_" + mode + "_per_task_us"] = train / 64;
    r["forward_" + mode + "_added_per_task_us"] = (fwd - plain_fwd) / 32;
    r["train_step_" + mode + "_added_per_task_us"] = (train - plain_train) / 64;
    r["forward_" + mode + "_to_plain"] = fwd / plain_fwd;
    r["train_step_" + mode + "_to_plain"] = train / plain_train;
  }
  if (timer.cuda) {  // replayed: the cost of a replay per call
    mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().cuda_graphs(true));
    for (auto& st : stages) pipe->append(st, device);
    {
      torch::NoGradGuard no_grad;
      guarded(r, "forward_graphed_us",
              [&] { return 1e3 * timer.median_ms([&] { pipe->forward(x, 1); }); });
    }
    guarded(r, "train_step_graphed_us", [&] {
      return 1e3 * timer.median_ms([&] {
        pipe->train_step(x, y, loss_fn, mpipe::TrainStepOptions(1));
      });
    });
    // A replay per task: its whole cost over the tasks it replays.
    if (r.contains("forward_graphed_us")) {
      r["forward_graphed_per_task_us"] = r["forward_graphed_us"].get<double>() / 32;
    }
    if (r.contains("train_step_graphed_us")) {
      r["train_step_graphed_per_task_us"] = r["train_step_graphed_us"].get<double>() / 64;
    }
  }
  return r;
}

/// The transformer_lm example's model and training step at its GPU defaults
/// (6 blocks of 384, 6 heads, context 256, batch 64 in 8 micro-batches, bf16
/// autocast, AdamW, gradients clipped to norm 1; `small`: its CPU defaults,
/// 2 blocks of 64, context 64, batch 16, fp32) on one device, vocabulary 100:
/// plain LibTorch on the whole batch and on the same 8 micro-batches with
/// their gradients accumulated (the fair baseline), the pipeline of 4 stages
/// (1F1B) eager and with default options (repeated steps replayed from a
/// CUDA graph), each layer's cost per micro-batch, and schedules::simulate's
/// prediction of the step on 2, 4 and 8 devices (1F1B, interleaved, ZB-H1)
/// from those costs, the runtime's cost per task and an NVLink-like hand-off.
json lm_workload(const Timer& timer, const torch::Device& device, bool small) {
  const int64_t n_blocks = small ? 2 : 6, dim = small ? 64 : 384, heads = small ? 4 : 6;
  const int64_t context = small ? 64 : 256, batch = small ? 16 : 64, m = 8, vocab = 100;
  const bool bf16 = device.is_cuda();
  torch::manual_seed(0);
  transformer_lm::Layers layers(vocab, n_blocks, dim, heads, context);
  auto plain = layers.all();
  plain->to(device);
  const auto ids = torch::TensorOptions(device).dtype(torch::kLong);
  const auto x = torch::randint(vocab, {batch, context}, ids);
  const auto y = torch::randint(vocab, {batch, context}, ids);
  auto scope = [&] {
    return bf16 ? std::make_unique<mpipe::AutocastGuard>(device.type(), torch::kBFloat16) : nullptr;
  };
  const auto params = plain->parameters();
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-4).betas({0.9, 0.95}).weight_decay(0.1));
  const auto& loss_fn = transformer_lm::lm_loss;
  json r = {{"blocks", n_blocks}, {"dim", dim}, {"context", context}, {"batch", batch},
            {"micro_batches", m}, {"precision", bf16 ? "bf16 autocast" : "fp32"}};

  // Each layer alone, per micro-batch, and the split that evens them out.
  const auto costs = lm_bench::measure_layers(layers, x.narrow(0, 0, batch / m),
                                              y.narrow(0, 0, batch / m), bf16,
                                              [&] { timer.sync(); });
  json layer_rows = json::array();
  for (const auto& c : costs) {
    layer_rows.push_back({{"forward_ms", c.forward}, {"backward_ms", c.backward},
                          {"backward_input_ms", c.backward_input},
                          {"backward_weight_ms", c.backward_weight}});
  }
  r["layers"] = layer_rows;
  const auto split = lm_bench::split_of(costs, 4);
  r["split"] = split;

  r["plain_whole_ms"] = timer.median_ms([&] {
    opt.zero_grad();
    torch::Tensor loss;
    {
      const auto cast = scope();
      loss = loss_fn(plain->forward(x), y);
    }
    loss.backward();
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    opt.step();
  });
  r["plain_fair_ms"] = timer.median_ms([&] {  // as transformer_lm --plain does
    opt.zero_grad();
    const auto xs = x.chunk(m), ys = y.chunk(m);
    for (size_t i = 0; i < xs.size(); ++i) {
      torch::Tensor part;
      {
        const auto cast = scope();
        part = loss_fn(plain->forward(xs[i]), ys[i]) * (static_cast<double>(xs[i].size(0)) / batch);
      }
      part.backward();
    }
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    opt.step();
  });
  r["optimizer_ms"] = timer.median_ms([&] {  // clipping and AdamW's step alone
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    opt.step();
  });
  for (bool automatic : {false, true}) {
    mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().auto_cuda_graphs(automatic));
    int64_t at = 0;
    for (int64_t n : split) {
      torch::nn::Sequential stage;
      for (int64_t k = 0; k < n; ++k) layers.push(stage, at + k);
      at += n;
      pipe->append(stage, device);
    }
    const auto options = mpipe::TrainStepOptions(mpipe::chunks(m));
    auto step = [&] {
      opt.zero_grad();
      {
        const auto cast = scope();
        pipe->train_step(x, y, loss_fn, options);
      }
      mpipe::clip_grad_norm(*pipe, 1.0);
      opt.step();
    };
    for (int k = 0; k < 4; ++k) step();  // automatic graphs: captured at the fourth
    const std::string key = automatic ? "mpipe_default_ms" : "mpipe_eager_ms";
    r[key] = timer.median_ms(step);
    if (automatic) r["mpipe_default_graphs_held"] = pipe->cuda_graphs_captured();
  }
  const double fair = r["plain_fair_ms"];
  r["eager_to_fair_plain"] = r["mpipe_eager_ms"].get<double>() / fair;
  r["default_to_fair_plain"] = r["mpipe_default_ms"].get<double>() / fair;
  r["whole_to_fair_plain"] = r["plain_whole_ms"].get<double>() / fair;

  // Several devices, predicted: each stage on its own device with its own
  // worker thread, a task costing its layers' measured time plus the
  // runtime's cost per task (the overhead workload's, with threads); a
  // hand-off of the activation (fp32 [rows, context, dim]) at 200 GB/s plus
  // 10 µs; the optimizer's share of each device, optimizer_ms / D.
  const json overhead = overhead_workload(timer, device);
  const double host_ms = std::max(0.0, overhead["forward_threads_added_per_task_us"].get<double>()) / 1e3;
  const double bytes = 4.0 * static_cast<double>(batch / m * context * dim);
  const double transfer_ms = bytes / 200e9 * 1e3 + 0.010;
  r["predicted_host_ms_per_task"] = host_ms;
  r["predicted_transfer_ms"] = transfer_ms;
  const std::pair<const char*, mpipe::Schedule> schedules[] = {
      {"1f1b", mpipe::Schedule::OneFOneB},
      {"interleaved", mpipe::Schedule::Interleaved1F1B},
      {"zbh1", mpipe::Schedule::ZeroBubbleH1}};
  for (int64_t d : {int64_t{2}, int64_t{4}, int64_t{8}}) {
    for (const auto& s : schedules) {
      const double span = lm_bench::predict_ms(costs, d, s.second, m, host_ms, transfer_ms);
      const std::string key = "predicted_" + std::to_string(d) + "_devices_" + s.first;
      if (span < 0) {
        r[key + "_ms"] = nullptr;  // fewer layers than stages
        continue;
      }
      const double step_ms = span + r["optimizer_ms"].get<double>() / static_cast<double>(d);
      r[key + "_ms"] = step_ms;
      r[key + "_speedup_vs_fair_plain"] = fair / step_ms;
    }
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"mpipe benchmark: the four workloads, mpipe vs plain LibTorch, and training memory"};
  app.add_option("--reps", cfg.reps, "timed runs per measurement (median)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", cfg.warmup, "untimed runs first");
  app.add_option("--device", cfg.device, "auto, cpu or cuda")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--only", cfg.only,
                 "comma-separated workloads: narrow-mlp, wide-mlp, snn-1024, snn-256, memory, "
                 "schedules, wide-mlp-bf16, wide-mlp-bf16-linear, wide-mlp-bf16w, transformer, lm, overhead, scaling "
                 "(the last only when named or with 2+ GPUs)");
  app.add_option("--json", cfg.json_path, "write the results here");
  app.add_flag("--cpu-sizes", cfg.cpu_sizes, "shrink every workload (for CPUs and CI)");
  app.add_option("--timelines", cfg.timelines,
                 "write each schedule's timeline of the schedules workload here (SVG, JSON)");
  app.add_flag("--inline", cfg.inline_host, "issue all stages from the caller's thread");
  app.add_option("--profile", cfg.profile,
                 "after each measurement, profile one more call into this folder (Chrome traces)");
  app.add_flag("--count-ops", cfg.count_ops,
               "count the ATen operations of one call instead of timing (keys *_ops)");
  app.add_option("--ops-by-name", cfg.ops_by_name,
                 "with --count-ops: each call's operations by name into this folder");
  CLI11_PARSE(app, argc, argv);

  const bool cuda = cfg.device == "cuda" || (cfg.device == "auto" && static_cast<int64_t>(torch::cuda::device_count()) > 0);
  const torch::Device device = cuda ? torch::Device("cuda:0") : torch::Device(torch::kCPU);
  if (!cuda) cfg.cpu_sizes = true;
  if (cuda) {  // fp32, TF32 off, as the reference runner
    at::globalContext().setAllowTF32CuBLAS(false);
    at::globalContext().setAllowTF32CuDNN(false);
  }
  Timer timer{cuda, cfg.reps, cfg.warmup};
  timer.ops = cfg.count_ops;
  // The CPU form keeps each workload's shape but shrinks it to run in seconds.
  const bool small = cfg.cpu_sizes;
  auto wanted_name = [&](const std::string& name) {
    return cfg.only.empty() || ("," + cfg.only + ",").find("," + name + ",") != std::string::npos;
  };

  json results;
  results["device"] = device.str();
  results["cpu_sizes"] = cfg.cpu_sizes;
  results["threads"] = !cfg.inline_host;
  results["reps"] = cfg.reps;
  results["count_ops"] = cfg.count_ops;
  if (cfg.count_ops) {
    std::printf("mpipe %s benchmark on %s%s, ATen operations per call\n", MPIPE_VERSION_STRING,
                device.str().c_str(), cfg.cpu_sizes ? " (CPU sizes)" : "");
  } else {
    std::printf("mpipe %s benchmark on %s%s, median of %lld runs (ms)\n", MPIPE_VERSION_STRING,
                device.str().c_str(), cfg.cpu_sizes ? " (CPU sizes)" : "",
                static_cast<long long>(cfg.reps));
  }
  if (!cfg.ops_by_name.empty()) {
    if (!cfg.count_ops || !cfg.profile.empty()) {
      std::fprintf(stderr, "--ops-by-name needs --count-ops and no --profile\n");
      return 2;
    }
    cfg.profile = cfg.ops_by_name;  // the same folder and numbering
    op_count.by_name = true;
  }
  if (!cfg.profile.empty()) std::filesystem::create_directories(cfg.profile);
  profiling.dir = cfg.profile;
  auto wanted = [&](const std::string& name) {
    profiling.workload = name;
    profiling.n = 0;
    return wanted_name(name);
  };
  // Counted rows keep the counts as "<row>_ops" (the overhead workload's µs
  // rows, which scale ms by 1000, scaled back: its per-task rows become
  // operations per task) and the ratios to the plain loop; TFLOP/s and the
  // like mean nothing there.
  auto counted = [](const json& r) {
    json out;
    auto ends = [](const std::string& key, const std::string& tail) {
      return key.size() > tail.size() &&
             key.compare(key.size() - tail.size(), tail.size(), tail) == 0;
    };
    for (auto it = r.begin(); it != r.end(); ++it) {
      const std::string& key = it.key();
      const std::string stem = key.substr(0, key.size() - 3);
      if (ends(key, "_ms")) out[stem + "_ops"] = *it;
      if (ends(key, "_us")) out[stem + "_ops"] = it->get<double>() / 1e3;
      if (ends(key, "_to_plain")) out[key] = *it;
    }
    return out;
  };
  auto report = [&](const std::string& name, const json& measured) {
    const json r = cfg.count_ops && measured.is_object() ? counted(measured) : measured;
    results["workloads"][name] = r;
    std::printf("%-11s %s\n", name.c_str(), r.dump().c_str());
    std::fflush(stdout);
  };
  if (wanted("narrow-mlp")) {
    report("narrow-mlp", small ? mlp_workload(timer, device, 128, 32, 64, 8, cfg.inline_host)
                               : mlp_workload(timer, device, 1024, 32, 512, 64, cfg.inline_host));
  }
  if (wanted("wide-mlp")) {
    report("wide-mlp", small ? mlp_workload(timer, device, 256, 8, 256, 32, cfg.inline_host)
                             : mlp_workload(timer, device, 8192, 8, 8192, 1024, cfg.inline_host));
  }
  // bf16: wide-mlp under autocast (fp32 weights) and with bf16 weights; TFLOP/s
  // against the H200's bf16 figure (790; on a CPU the share means nothing).
  const double peak = 790;
  const double wide_fwd = small ? 2.0 * 256 * 256 * 256 * 8 : 2.0 * 8192 * 8192 * 8192 * 8;
  // Under autocast every timed call, plain or mpipe, opens its own scope, as
  // a training loop does per step: its casts are made once per call.
  Timer autocast_timer = timer;
  autocast_timer.around = [&](const std::function<void()>& call) {
    mpipe::AutocastGuard bf16(device.type(), torch::kBFloat16);
    call();
  };
  if (wanted("wide-mlp-bf16")) {
    json r = small ? mlp_workload(autocast_timer, device, 256, 8, 256, 32, cfg.inline_host)
                   : mlp_workload(autocast_timer, device, 8192, 8, 8192, 1024, cfg.inline_host);
    add_tflops(r, wide_fwd, peak);
    report("wide-mlp-bf16", r);
  }
  // The same with mpipe::Linear: weights cast once per call, not once per
  // micro-batch (Note [Linear under autocast]).
  if (wanted("wide-mlp-bf16-linear")) {
    json r = small ? mlp_workload(autocast_timer, device, 256, 8, 256, 32, cfg.inline_host,
                                  torch::kFloat, true)
                   : mlp_workload(autocast_timer, device, 8192, 8, 8192, 1024, cfg.inline_host,
                                  torch::kFloat, true);
    add_tflops(r, wide_fwd, peak);
    report("wide-mlp-bf16-linear", r);
  }
  if (wanted("wide-mlp-bf16w")) {
    json r = small ? mlp_workload(timer, device, 256, 8, 256, 32, cfg.inline_host, torch::kBFloat16)
                   : mlp_workload(timer, device, 8192, 8, 8192, 1024, cfg.inline_host,
                                  torch::kBFloat16);
    add_tflops(r, wide_fwd, peak);
    report("wide-mlp-bf16w", r);
  }
  if (wanted("transformer")) {
    report("transformer",
           small ? transformer_workload(autocast_timer, device, 64, 4, 32, 4, peak, cfg.inline_host)
                 : transformer_workload(autocast_timer, device, 4096, 32, 2048, 8, peak,
                                        cfg.inline_host));
  }
  if (wanted("overhead")) report("overhead", overhead_workload(timer, device));
  if (wanted("lm")) report("lm", lm_workload(timer, device, small));
  if (wanted("snn-1024")) {
    report("snn-1024", small ? snn_workload(timer, device, 128, 32, 32, cfg.inline_host)
                             : snn_workload(timer, device, 1024, 256, 32, cfg.inline_host));
  }
  if (wanted("snn-256")) {
    report("snn-256", small ? snn_workload(timer, device, 32, 8, 64, cfg.inline_host)
                            : snn_workload(timer, device, 256, 64, 64, cfg.inline_host));
  }
  // wide-mlp's training throughput on 1, 2 and 4 GPUs: by default only where
  // there are several.
  const bool named_scaling = ("," + cfg.only + ",").find(",scaling,") != std::string::npos;
  if (named_scaling || (cfg.only.empty() && cuda && static_cast<int64_t>(torch::cuda::device_count()) >= 2)) {
    report("scaling", small ? scaling_workload(timer, device, 256, 2, 256, cfg.inline_host)
                            : scaling_workload(timer, device, 8192, 2, 8192, cfg.inline_host));
  }
  if (wanted("schedules")) {
    // wide-mlp and narrow-mlp training steps under every schedule.
    json rows = json::array();
    for (const json& r : small ? schedules_workload(timer, device, "wide-mlp", 256, 8, 256, 32,
                                                    cfg.inline_host, cfg.timelines)
                               : schedules_workload(timer, device, "wide-mlp", 8192, 8, 8192, 1024,
                                                    cfg.inline_host, cfg.timelines)) {
      rows.push_back(r);
    }
    for (const json& r : small ? schedules_workload(timer, device, "narrow-mlp", 128, 32, 64, 8,
                                                    cfg.inline_host, cfg.timelines)
                               : schedules_workload(timer, device, "narrow-mlp", 1024, 32, 512, 64,
                                                    cfg.inline_host, cfg.timelines)) {
      rows.push_back(r);
    }
    report("schedules", rows);
  }
  if (wanted("memory") && cuda) {
    // 4 stages x 2 x Linear(4096, 4096), batch 8192 in 16 micro-batches of 512.
    report("memory", memory_workload(timer, device, 4096, 2, 8192, 512, cfg.inline_host));
  }
  if (!cfg.json_path.empty()) std::ofstream(cfg.json_path) << results.dump(1) << "\n";
  return 0;
}
