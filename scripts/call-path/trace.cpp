// Records which of mpipe's source files one call runs code from, in the order
// it enters them (scripts/call-path/call-path.sh). Built header-only with
// -finstrument-functions, torch's and the standard library's headers excluded,
// so every recorded function is mpipe's own (or this file's: the user's loss).
#include <mpipe/mpipe.h>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {
std::atomic<bool> tracing{false};
std::mutex mutex;
struct Event { void* fn; void* site; size_t thread; bool enter; };
std::vector<Event>* events = new std::vector<Event>();
thread_local size_t thread_id = 0;
std::atomic<size_t> next_thread{1};
}  // namespace

extern "C" {
void __cyg_profile_func_enter(void* fn, void* site) __attribute__((no_instrument_function));
void __cyg_profile_func_exit(void* fn, void* site) __attribute__((no_instrument_function));
void __cyg_profile_func_enter(void* fn, void* site) {
  if (!tracing.load(std::memory_order_relaxed)) return;
  if (thread_id == 0) thread_id = next_thread++;
  std::lock_guard<std::mutex> lock(mutex);
  events->push_back({fn, site, thread_id, true});
}
void __cyg_profile_func_exit(void* fn, void* site) {
  if (!tracing.load(std::memory_order_relaxed)) return;
  if (thread_id == 0) thread_id = next_thread++;
  std::lock_guard<std::mutex> lock(mutex);
  events->push_back({fn, site, thread_id, false});
}
}

__attribute__((no_instrument_function)) static void dump(const char* path) {
  FILE* f = std::fopen(path, "w");
  for (const Event& e : *events)
    std::fprintf(f, "%zu %c %p %p\n", e.thread, e.enter ? '>' : '<', e.fn, e.site);
  std::fclose(f);
  events->clear();
}

template <class F>
__attribute__((no_instrument_function)) static void traced(const char* path, F&& call) {
  call();  // warm: the first call may build what later calls reuse
  tracing = true;
  call();
  tracing = false;
  dump(path);
}

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : ".";
  torch::manual_seed(0);
  mpipe::ModelPipeline pipe;
  for (int s = 0; s < 4; ++s) pipe->append(torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::ReLU()), "cpu");
  auto x = torch::randn({32, 16}), y = torch::randn({32, 16});
  auto mse = [](const at::Tensor& a, const at::Tensor& b) { return (a - b).pow(2).mean(); };
  traced((out + "/train_step.events").c_str(), [&] {
    pipe->train_step(x, y, mse, mpipe::TrainStepOptions(mpipe::chunks(8)).schedule(mpipe::Schedule::OneFOneB));
  });
  traced((out + "/constant_train_step.events").c_str(), [&] {
    pipe->constant_train_step(x, 8, y, mse, /*time_chunk=*/4);
  });
  return 0;
}
