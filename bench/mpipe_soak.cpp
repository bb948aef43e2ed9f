// mpipe's soak test: many training steps and constant_forward calls on one
// pipeline, with a planted failure every --fail-every calls, while resident
// memory, heap or caching-allocator memory and the thread count are watched.
// They must stay flat: the figures after the warm-up and at the end are
// compared, and the tool exits 1 when they grew. See docs/RELIABILITY.md.

#include <mpipe/mpipe.h>
#include <mpipe/snn.h>

#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#ifdef MPIPE_BENCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <malloc.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace {

namespace nn = torch::nn;
namespace snn = mpipe::snn;
using json = nlohmann::json;

/// A field of /proc/self/status in kB (VmRSS) or as a count (Threads).
int64_t proc_status(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, field.size() + 1, field + ":") == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

struct Figures {
  int64_t calls = 0;
  double rss_mib = 0;
  double heap_mib = 0;       // malloc's bytes in use (glibc mallinfo2)
  double allocator_mib = -1; // CUDA caching allocator: allocated bytes now
  int64_t threads = 0;
  json to_json() const {
    return {{"calls", calls}, {"rss_mib", rss_mib}, {"heap_mib", heap_mib},
            {"cuda_allocated_mib", allocator_mib}, {"threads", threads}};
  }
};

Figures measure(int64_t calls, const torch::Device& device) {
  Figures f;
  f.calls = calls;
  f.rss_mib = static_cast<double>(proc_status("VmRSS")) / 1024.0;
  f.threads = proc_status("Threads");
  const struct mallinfo2 mi = mallinfo2();
  f.heap_mib = static_cast<double>(mi.uordblks + mi.hblkhd) / 1048576.0;
#ifdef MPIPE_BENCH_CUDA
  if (device.is_cuda()) {
    torch::cuda::synchronize(device.index());
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    f.allocator_mib =
        static_cast<double>(
            stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                .current) /
        1048576.0;
  }
#endif
  return f;
}

void print(const char* label, const Figures& f) {
  std::printf("%-10s calls %6lld  rss %8.1f MiB  heap %8.1f MiB  cuda allocated %8.1f MiB  threads %lld\n",
              label, static_cast<long long>(f.calls), f.rss_mib, f.heap_mib, f.allocator_mib,
              static_cast<long long>(f.threads));
  std::fflush(stdout);
}

/// Passes its input on; throws when `armed` (set by the soak loop).
struct TripImpl : nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    TORCH_CHECK(!armed, "planted soak failure");
    return x;
  }
  bool armed = false;
};
TORCH_MODULE(Trip);

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mpipe soak test: memory and threads stay flat over many calls"};
  std::string device_name = "auto", json_path;
  int64_t steps = 10000, forwards = 10000, fail_every = 100, width = 256, batch = 64;
  double max_rss_growth_mib = 64, max_heap_growth_mib = 32, max_allocator_growth_mib = 1;
  app.add_option("--device", device_name, "auto (cuda:0 if present), cpu or cuda:N");
  app.add_option("--steps", steps, "train_step calls");
  app.add_option("--forwards", forwards, "constant_forward calls");
  app.add_option("--fail-every", fail_every, "plant a failure every N calls (0: never)");
  app.add_option("--width", width, "layer width");
  app.add_option("--batch", batch, "batch size");
  app.add_option("--max-rss-growth", max_rss_growth_mib, "allowed growth of resident memory (MiB)");
  app.add_option("--max-heap-growth", max_heap_growth_mib, "allowed growth of malloc's heap (MiB)");
  app.add_option("--max-allocator-growth", max_allocator_growth_mib,
                 "allowed growth of the CUDA caching allocator's allocated bytes (MiB)");
  app.add_option("--json", json_path, "write the figures here");
  CLI11_PARSE(app, argc, argv);

  const torch::Device device = device_name == "auto"
                                   ? (torch::cuda::is_available() ? torch::Device("cuda:0")
                                                                  : torch::Device(torch::kCPU))
                                   : torch::Device(device_name);
  std::printf("mpipe soak on %s: %lld train_steps, %lld constant_forward calls, a failure every %lld\n",
              device.str().c_str(), static_cast<long long>(steps),
              static_cast<long long>(forwards), static_cast<long long>(fail_every));
  torch::manual_seed(0);

  // Four stages with every kind of state: LIF neurons, a DeferredBatchNorm,
  // and a stage that can be made to fail. 1F1B with checkpointing, threads.
  Trip trip;
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().checkpoint(mpipe::Checkpoint::ExceptLast));
  pipe->append(nn::Sequential(nn::Linear(width, width), snn::LIFNode()), device)
      .append(nn::Sequential(nn::Linear(width, width), mpipe::DeferredBatchNorm(width), nn::Tanh()),
              device)
      .append(nn::Sequential(nn::Linear(width, width), snn::IFNode(), trip), device)
      .append(nn::Linear(width, 10), device);
  torch::optim::SGD optimizer(pipe->parameters(), torch::optim::SGDOptions(1e-3));
  const auto x = torch::rand({batch, width}, device) * 2;
  const auto labels = torch::randint(0, 10, {batch}, torch::TensorOptions(device).dtype(torch::kLong));
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  const auto options = mpipe::TrainStepOptions(batch / 4).schedule(mpipe::Schedule::OneFOneB);

  int64_t calls = 0, failures = 0;
  auto one_call = [&](bool train) {
    const bool fail = fail_every > 0 && calls % fail_every == fail_every - 1;
    trip->armed = fail;
    try {
      if (train) {
        optimizer.zero_grad();
        pipe->train_step(x, labels, loss_fn, options);
        optimizer.step();
      } else {
        torch::NoGradGuard no_grad;
        pipe->constant_forward(x, 4);
      }
      TORCH_CHECK(!fail, "a planted failure did not surface");
    } catch (const c10::Error& e) {
      if (!fail) throw;
      ++failures;
    }
    trip->armed = false;
    mpipe::reset_states(*pipe);
    ++calls;
  };

  std::vector<Figures> samples;
  samples.push_back(measure(0, device));
  print("start", samples.back());
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t total = steps + forwards;
  const int64_t warmup = std::max<int64_t>(1, total / 100);
  const int64_t every = std::max<int64_t>(1, total / 10);
  Figures after_warmup;
  for (int64_t i = 0; i < total; ++i) {
    // Interleaved: a training step, then a constant_forward, while both last.
    const bool train = (i % 2 == 0 && i / 2 < steps) || i / 2 >= forwards;
    one_call(train);
    if (calls == warmup) {
      after_warmup = measure(calls, device);
      print("warmed up", after_warmup);
    } else if (calls % every == 0) {
      samples.push_back(measure(calls, device));
      print("", samples.back());
    }
  }
  const Figures end = measure(calls, device);
  print("end", end);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const double rss_growth = end.rss_mib - after_warmup.rss_mib;
  const double heap_growth = end.heap_mib - after_warmup.heap_mib;
  const double allocator_growth =
      end.allocator_mib >= 0 ? end.allocator_mib - after_warmup.allocator_mib : 0.0;
  const bool threads_ok = end.threads == after_warmup.threads;
  const bool ok = rss_growth <= max_rss_growth_mib && heap_growth <= max_heap_growth_mib &&
                  allocator_growth <= max_allocator_growth_mib && threads_ok &&
                  failures == (fail_every > 0 ? total / fail_every : 0);
  std::printf("%lld calls (%lld planted failures) in %.1f s; after the warm-up: rss %+.1f MiB, "
              "heap %+.1f MiB, cuda allocated %+.2f MiB, threads %+lld -> %s\n",
              static_cast<long long>(calls), static_cast<long long>(failures), seconds, rss_growth,
              heap_growth, allocator_growth,
              static_cast<long long>(end.threads - after_warmup.threads), ok ? "flat" : "GREW");
  if (!json_path.empty()) {
    json j{{"device", device.str()},          {"steps", steps},
           {"forwards", forwards},            {"failures", failures},
           {"seconds", seconds},              {"start", samples.front().to_json()},
           {"after_warmup", after_warmup.to_json()}, {"end", end.to_json()},
           {"flat", ok}};
    for (const auto& s : samples) j["samples"].push_back(s.to_json());
    std::ofstream(json_path) << j.dump(2) << "\n";
  }
  return ok ? 0 : 1;
}
