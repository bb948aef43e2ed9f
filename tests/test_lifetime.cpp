// Lifetime: a program that builds pipelines again and again (a search over
// splits, a server) must not lose threads or memory with each one (Note
// [Shared streams and workers] in mpipe/detail/runtime/workers-inl.h).

#include "common.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#ifdef MPIPE_TEST_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

using namespace mpipe_test;
using mpipe::ModelPipeline;
using mpipe::TrainStepOptions;

namespace {

// AddressSanitizer keeps freed memory in quarantine, so RSS grows under it
// without a leak (LeakSanitizer checks leaks there).
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssIsMeaningful = false;
#else
constexpr bool kRssIsMeaningful = true;
#endif

/// A field of /proc/self/status (Threads, VmRSS in kB); -1 where unavailable.
int64_t proc_status(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream value(line.substr(field.size() + 1));
      int64_t v = -1;
      value >> v;
      return v;
    }
  }
  return -1;
}

/// Builds a 4-stage pipeline on `device`, runs one train_step and one
/// forward, and destroys it.
void build_use_and_drop(const torch::Device& device, int64_t width) {
  auto pipe = ModelPipeline();
  for (int i = 0; i < 4; ++i) pipe->append(mlp_stage(width, width), device);
  auto x = torch::randn({64, width}, device);
  auto target = torch::randn({64, width}, device);
  pipe->train_step(x, target, [](const torch::Tensor& y, const torch::Tensor& t) {
    return torch::mse_loss(y, t);
  }, TrainStepOptions(16));
  torch::NoGradGuard no_grad;
  pipe->forward(x, 16);
}

}  // namespace

TEST(Lifetime, ManyPipelinesKeepThreadsAndHostMemoryFlat) {
  build_use_and_drop(torch::kCPU, 64);
  const int64_t threads = proc_status("Threads"), rss_kb = proc_status("VmRSS");
  if (threads < 0 || rss_kb < 0) GTEST_SKIP() << "no /proc/self/status here";
  for (int i = 1; i < 20; ++i) build_use_and_drop(torch::kCPU, 64);
  EXPECT_EQ(proc_status("Threads"), threads) << "threads after 20 pipelines";
  if (kRssIsMeaningful) {
    EXPECT_LT(proc_status("VmRSS") - rss_kb, 32 * 1024) << "host memory grew (kB)";
  }
}

TEST(Lifetime, ManyPipelinesLeaveNoGpuMemoryBehind_CUDA) {
  MPIPE_REQUIRE_CUDA(1);
#ifdef MPIPE_TEST_WITH_CUDA
  namespace alloc = c10::cuda::CUDACachingAllocator;
  auto allocated_mib = [] {
    torch::cuda::synchronize();
    alloc::emptyCache();
    return static_cast<double>(alloc::getDeviceStats(0).allocated_bytes[0].current) / (1 << 20);
  };
  const torch::Device gpu("cuda:0");
  build_use_and_drop(gpu, 1024);
  const double level = allocated_mib();
  const int64_t threads = proc_status("Threads"), rss_kb = proc_status("VmRSS");
  double highest = level;
  for (int i = 1; i < 20; ++i) {
    build_use_and_drop(gpu, 1024);
    highest = std::max(highest, allocated_mib());
  }
  std::printf("[lifetime] allocated after the first pipeline %.1f MiB, highest after any of "
              "the next 19 %.1f MiB\n", level, highest);
  EXPECT_LE(highest, level + 1.0) << "GPU memory grew with each pipeline (MiB)";
  EXPECT_EQ(proc_status("Threads"), threads) << "threads after 20 pipelines";
  if (kRssIsMeaningful) {
    EXPECT_LT(proc_status("VmRSS") - rss_kb, 64 * 1024) << "host memory grew (kB)";
  }
#endif
}
