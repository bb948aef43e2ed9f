// A training job that survives its ranks being killed or stalled: run under
// `mpipe-launch --max-restarts R`, it resumes from mpipe::JobCheckpoints and
// must end with the uninterrupted run's weights, optimizer state and loss,
// bit for bit (tests/resume_check.cmake runs both and compares).
//
//   mpipe-launch -n 3 --max-restarts 3 -- mpipe_resume_job --dir D --out O \
//     --fault 0:1:37 --fault 1:2:80:save [--replicas 2] [--steps 120] [--every 10]
//   mpipe_resume_job --compare O1 O2 --world 3
//
// --fault A:R:S[:save|:stall]: on attempt A (TORCHELASTIC_RESTART_COUNT), rank
// R is killed (SIGKILL) before step S; with :save, after step S while the
// other ranks write that step's checkpoint; with :stall, it stops there
// instead of dying.

#include "../optimizer_state.h"

#include <mpipe/distributed.h>
#include <mpipe/job_checkpoints.h>
#include <mpipe/model_pipeline.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Fault {
  int64_t attempt, rank, step;
  std::string kind;  // "kill", "save", "stall"
};

Fault parse_fault(const std::string& s) {
  Fault f{0, 0, 0, "kill"};
  size_t a = s.find(':'), b = s.find(':', a + 1), c = s.find(':', b + 1);
  if (a == std::string::npos || b == std::string::npos) {
    throw std::runtime_error("--fault A:R:S[:save|:stall], got " + s);
  }
  f.attempt = std::stoll(s.substr(0, a));
  f.rank = std::stoll(s.substr(a + 1, b - a - 1));
  f.step = std::stoll(s.substr(b + 1, c == std::string::npos ? std::string::npos : c - b - 1));
  if (c != std::string::npos) f.kind = s.substr(c + 1);
  return f;
}

/// The whole model: 2 stages per pipeline rank, Linear + Tanh + Dropout in
/// double precision (dropout: every step draws from the pipeline's seeds).
std::vector<torch::nn::Sequential> make_stages(int64_t n) {
  torch::manual_seed(3);
  std::vector<torch::nn::Sequential> stages;
  for (int64_t s = 0; s < n; ++s) {
    torch::nn::Sequential seq(torch::nn::Linear(8, s + 1 == n ? 2 : 8), torch::nn::Tanh(),
                              torch::nn::Dropout(0.1));
    seq->to(torch::kDouble);
    stages.push_back(seq);
  }
  return stages;
}

std::string rank_file(const std::string& dir, int64_t rank) {
  return dir + "/final-rank" + std::to_string(rank) + ".pt";
}

int compare(const std::string& a, const std::string& b, int64_t world) {
  int bad = 0;
  for (int64_t r = 0; r < world; ++r) {
    std::vector<torch::Tensor> x, y;
    torch::load(x, rank_file(a, r));
    torch::load(y, rank_file(b, r));
    if (x.size() != y.size()) {
      std::printf("rank %lld: %zu tensors against %zu\n", static_cast<long long>(r), x.size(), y.size());
      ++bad;
      continue;
    }
    for (size_t k = 0; k < x.size(); ++k) {
      if (!torch::equal(x[k], y[k])) {
        std::printf("rank %lld: tensor %zu differs\n", static_cast<long long>(r), k);
        ++bad;
      }
    }
  }
  std::printf("%s: %d difference(s) over %lld ranks\n", bad ? "FAILED" : "equal", bad,
              static_cast<long long>(world));
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, out, compare_a, compare_b;
  std::vector<Fault> faults;
  int64_t steps = 120, every = 10, replicas = 1, world = 0;
  for (int k = 1; k < argc; ++k) {
    const std::string a = argv[k];
    auto next = [&] { return std::string(argv[++k]); };
    if (a == "--dir") dir = next();
    else if (a == "--out") out = next();
    else if (a == "--fault") faults.push_back(parse_fault(next()));
    else if (a == "--steps") steps = std::stoll(next());
    else if (a == "--every") every = std::stoll(next());
    else if (a == "--replicas") replicas = std::stoll(next());
    else if (a == "--compare") { compare_a = next(); compare_b = next(); }
    else if (a == "--world") world = std::stoll(next());
  }
  if (!compare_a.empty()) return compare(compare_a, compare_b, world);
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int64_t attempt = restart ? std::stoll(restart) : 0;
  at::set_num_threads(1);
  auto group = mpipe::distributed::init_from_env(
      mpipe::distributed::GroupOptions().replicas(replicas).timeout(std::chrono::seconds(3)));
  const int64_t rank = group.rank();
  const int64_t n = group.pipeline_size() * 2;
  const auto stages = make_stages(n);
  mpipe::ModelPipeline pipe(mpipe::ModelPipelineOptions().process_group(group));
  const auto range = group.stage_range(n);
  for (int64_t s = range.first; s < range.second; ++s) pipe->append(stages[static_cast<size_t>(s)], "cpu");
  torch::optim::Adam opt(pipe->parameters(), torch::optim::AdamOptions(1e-2));
  mpipe::JobCheckpoints checkpoints(dir, *pipe, opt);
  int64_t step = 0;
  if (auto resumed = checkpoints.resume()) {
    step = resumed->step;
    std::printf("attempt %lld: resumed from %s at step %lld\n", static_cast<long long>(attempt),
                resumed->directory.c_str(), static_cast<long long>(step));
  }
  auto fault_at = [&](int64_t s, const std::string& kind) {
    for (const auto& f : faults) {
      if (f.attempt == attempt && f.rank == rank && f.step == s && f.kind == kind) return true;
    }
    return false;
  };
  // Wall-clock ms, for the time from a kill to the first step after it.
  auto now_ms = [] {
    return static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                      std::chrono::system_clock::now().time_since_epoch())
                                      .count());
  };
  auto fail_here = [&](const char* what) {
    std::printf("attempt %lld: rank %lld %s at step %lld (clock %lld ms)\n",
                static_cast<long long>(attempt), static_cast<long long>(rank), what,
                static_cast<long long>(step), now_ms());
    std::fflush(stdout);
    if (std::string(what) == "stalls") {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    raise(SIGKILL);
  };
  double loss = 0;
  bool first_step = true;
  for (; step < steps; ++step) {
    if (fault_at(step, "kill")) fail_here("is killed");
    if (fault_at(step, "stall")) fail_here("stalls");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);  // the data: from the step
    const auto x = torch::randn({12, 8}, gen, torch::kDouble);
    const auto y = torch::randn({12, 2}, gen, torch::kDouble);
    opt.zero_grad();
    const auto l = pipe->train_step(x, y, [](const at::Tensor& o, const at::Tensor& t) {
      return torch::nn::functional::mse_loss(o, t);
    }, mpipe::TrainStepOptions(3));
    opt.step();
    if (l.defined()) loss = l.item<double>();
    if (attempt > 0 && first_step) {
      std::printf("attempt %lld: rank %lld ran its first step after the restart (clock %lld ms)\n",
                  static_cast<long long>(attempt), static_cast<long long>(rank), now_ms());
      first_step = false;
    }
    if ((step + 1) % every == 0) {
      if (fault_at(step + 1, "save")) fail_here("is killed while the checkpoint is written");
      checkpoints.save(step + 1);
    }
  }
  // What must equal the uninterrupted run: weights, optimizer state, loss.
  std::vector<torch::Tensor> state = pipe->parameters();
  for (const auto& p : pipe->parameters()) {
    const auto& s = mpipe_test::param_state<torch::optim::AdamParamState>(opt, p);
    state.push_back(s.exp_avg());
    state.push_back(s.exp_avg_sq());
  }
  state.push_back(torch::tensor(loss, torch::kDouble));
  torch::save(state, rank_file(out, rank));
  group.barrier();
  return 0;
}
