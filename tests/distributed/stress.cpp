// The cross-process stress test: thousands of mixed pipeline calls on three
// pipelines that share one process group, each call checked against the
// plain model that every rank also holds, with a stage error injected every
// ~50 calls. Every rank draws the same calls from the same seed.
//
//   mpipe-launch -n 3 --timeout 600 -- ./mpipe_dist_stress --calls=2000 [--replicas=R]
//     [--seed=N]  (the calls' mix; 12345 unless given)
//     [--fault=die|stall --fault-at=K --fault-rank=R]
//
// With --fault, world rank R dies (exits) or stalls at call K of the mix,
// inside one of its stages' forward or before the call (drawn); every other
// rank must fail call K within the documented bound (docs/distributed.md,
// Failures: the group's timeout + 0.5 s per rank + 2 s) naming rank R and no
// other rank as the one that did not send, answer or could not be reached, and
// its next call at once. Each prints "stress fault: ..." and exits.
//
// ctest runs a short form (tests/CMakeLists.txt), under the debug hook that
// delays and reorders deliveries (MPIPE_DEBUG_CHAOS); scripts/stress.sh runs
// the long form. Each rank ends with "stress: N passed, F failed".
//
// Pipelines (S = ranks of a pipeline):
//  A: 2S stages of Linear + Tanh: forward, train_step under every schedule;
//  B: S + 1 multi-step SNN stages (SeqToANN(Linear, Tanh), LIF): time-step
//     calls in time chunks 1, 2 and T;
//  C: S single-step SNN stages (Linear, Tanh, LIF): time-step calls.

#include "../common.h"

#include <mpipe/distributed.h>
#include <mpipe/snn.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <string>
#include <thread>

namespace {

namespace nn = torch::nn;
namespace snn = mpipe::snn;
using mpipe::distributed::ProcessGroup;

/// A rank's fault (--fault): it exits, or sleeps past every bound and exits.
[[noreturn]] void fault_now(const std::string& kind, double stall_s) {
  std::fflush(stdout);
  if (kind == "stall") std::this_thread::sleep_for(std::chrono::duration<double>(stall_s));
  std::_Exit(0);  // 0: the launcher leaves the others to notice
}

/// Identity, or when armed the injected stage failure (or, with `fault`
/// set, this rank's fault).
struct TrapImpl : nn::Module {
  explicit TrapImpl(int64_t stage) : stage(stage) {}
  at::Tensor forward(const at::Tensor& x) {
    if (armed && !fault.empty()) fault_now(fault, stall_s);
    TORCH_CHECK(!armed, "injected failure in stage ", stage);
    return x;
  }
  int64_t stage;
  bool armed = false;
  std::string fault;  // "die" or "stall"
  double stall_s = 0;
};
TORCH_MODULE(Trap);

struct Model {
  std::vector<nn::Sequential> stages;
  std::vector<Trap> traps;
};

enum class Kind { Mlp, MultiStep, SingleStep };

Model build(Kind kind, int64_t n) {
  torch::manual_seed(static_cast<uint64_t>(kind) * 100 + 7);
  Model m;
  for (int64_t s = 0; s < n; ++s) {
    nn::Sequential seq;
    if (kind == Kind::Mlp) {
      seq->push_back(nn::Linear(6, s + 1 == n ? 3 : 6));
      seq->push_back(nn::Tanh());
    } else if (kind == Kind::MultiStep) {
      seq->push_back(snn::SeqToANN(nn::Linear(6, 6), nn::Tanh()));
      seq->push_back(snn::LIFNode(
          snn::LIFNodeOptions().v_threshold(0.3).step_mode(snn::StepMode::Multi)));
    } else {
      seq->push_back(nn::Linear(6, 6));
      seq->push_back(nn::Tanh());
      seq->push_back(snn::LIFNode(snn::LIFNodeOptions().v_threshold(0.3)));
    }
    Trap trap(s);
    seq->push_back(trap);
    seq->to(torch::kDouble);
    m.stages.push_back(seq);
    m.traps.push_back(trap);
  }
  return m;
}

struct Stress {
  ProcessGroup group;
  int64_t timeout_ms = 0;
  std::mt19937_64 draw{12345};  // the same on every rank (--seed)
  int64_t passed = 0, failed = 0, injected = 0;
  bool verbose = std::getenv("MPIPE_STRESS_VERBOSE") != nullptr;  // every call's line
  std::string first_failure;
  bool expecting_fault = false;  // --fault's call: the error is recorded, not a failure
  std::string fault_message;

  int64_t pick(int64_t lo, int64_t hi) {  // uniform in [lo, hi]
    return lo + static_cast<int64_t>(draw() % static_cast<uint64_t>(hi - lo + 1));
  }
  at::Tensor tensor(std::vector<int64_t> shape, double scale = 1.0) {
    at::Tensor t = torch::empty(shape, torch::kDouble);
    auto* p = t.data_ptr<double>();
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t k = 0; k < t.numel(); ++k) p[k] = u(draw) * scale;
    return t;
  }
  void fail(const std::string& what) {
    ++failed;
    if (first_failure.empty()) first_failure = what;
    std::printf("stress: rank %lld: FAILED %s\n", static_cast<long long>(group.rank()),
                what.c_str());
    std::fflush(stdout);
  }
  bool close(const at::Tensor& got, const at::Tensor& want) {
    return got.defined() && got.sizes() == want.sizes() &&
           torch::allclose(got, want, 1e-10, 1e-12);
  }
};

struct Pipe {
  Kind kind;
  Model mine, reference;
  mpipe::ModelPipeline pipe{nullptr};
  std::vector<int64_t> numbers;  // this rank's stages
  bool holds_last = false;       // gets the outputs and the loss

  /// `vee`: the stages in the V (ProcessGroup::v_stages), else contiguous.
  Pipe(Kind kind, const ProcessGroup& group, bool threads, bool vee = false) : kind(kind) {
    const int64_t s = group.pipeline_size();
    const int64_t n = kind == Kind::Mlp ? 2 * s : kind == Kind::MultiStep ? s + 1 : s;
    mine = build(kind, n);
    reference = build(kind, n);
    auto options = mpipe::ModelPipelineOptions().process_group(group).worker_threads(threads);
    if (kind == Kind::MultiStep) options.step_mode(snn::StepMode::Multi);
    if (vee) {
      numbers = group.v_stages(n);
      options.stage_numbers(numbers);
    } else {
      const auto range = group.stage_range(n);
      for (int64_t k = range.first; k < range.second; ++k) numbers.push_back(k);
    }
    holds_last = numbers.back() == n - 1;
    pipe = mpipe::ModelPipeline(options);
    for (int64_t k : numbers) pipe->append(mine.stages[static_cast<size_t>(k)], "cpu");
  }
  void reset() {
    mpipe::reset_states(*pipe);
    for (auto& s : reference.stages) mpipe::reset_states(*s);
  }
  at::Tensor plain(at::Tensor x) {
    for (auto& s : reference.stages) x = s->forward(x);
    return x;
  }
  /// The reference's outputs for T steps of `x` ([N, 6]) or of `seq` ([T, N, 6]).
  at::Tensor plain_steps(const at::Tensor& seq) {
    for (auto& s : reference.stages) mpipe::reset_states(*s);
    if (kind == Kind::MultiStep) return plain(seq);
    std::vector<at::Tensor> outs;
    for (int64_t t = 0; t < seq.size(0); ++t) outs.push_back(plain(seq[t]));
    return torch::stack(outs);
  }
  /// Every local stage's gradients against the reference's; zeroes both.
  std::string compare_grads() {
    std::string bad;
    for (size_t k = 0; k < pipe->size(); ++k) {
      const auto got = mine.stages[static_cast<size_t>(numbers[k])]->parameters();
      const auto want = reference.stages[static_cast<size_t>(numbers[k])]->parameters();
      for (size_t p = 0; p < got.size(); ++p) {
        const at::Tensor g = got[p].grad(), w = want[p].grad();
        const bool same = (!g.defined() && !w.defined()) ||
                          (g.defined() && w.defined() && torch::allclose(g, w, 1e-10, 1e-12));
        if (!same && bad.empty()) {
          bad = c10::str("stage ", numbers[k], " parameter ", p);
        }
      }
    }
    for (auto& p : pipe->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& s : reference.stages) {
      for (auto& p : s->parameters()) p.mutable_grad() = at::Tensor();
    }
    return bad;
  }
};

at::Tensor step_sum(const at::Tensor& steps) {  // summed step by step, as the pipeline does
  at::Tensor sum = steps[0];
  for (int64_t t = 1; t < steps.size(0); ++t) sum = sum + steps[t];
  return sum;
}

using mpipe_test::bystander_named;
using mpipe_test::mse;

/// One call on `p`, checked; `describe` says what it was. Returns false on
/// an unexpected exception (the group may be broken: stop).
bool one_call(Stress& st, Pipe& p, int64_t index, bool inject) {
  const ProcessGroup& g = st.group;
  const bool first = g.is_first(), last = p.holds_last;
  std::string what;
  int64_t trapped = -1;
  if (inject) {  // every rank arms the same stage; its holder fails
    trapped = st.pick(0, static_cast<int64_t>(p.mine.traps.size()) - 1);
    p.mine.traps[static_cast<size_t>(trapped)]->armed = true;
    ++st.injected;
  }
  try {
    if (p.kind == Kind::Mlp) {
      const int64_t rows = st.pick(1, 9);
      const at::Tensor x = st.tensor({rows, 6});
      if (st.pick(0, 1) == 0) {
        const int64_t split = st.pick(1, rows);
        what = c10::str("call ", index, ": forward rows ", rows, " split ", split);
        torch::NoGradGuard no_grad;
        const at::Tensor out = p.pipe->forward(first ? x : at::Tensor(), split);
        if (!inject && last && !st.close(out, p.plain(x))) st.fail(what + ": outputs differ");
      } else {
        const at::Tensor y = st.tensor({rows, 3});
        const int64_t mb = st.pick(1, rows);
        const int64_t which = st.pick(0, 7);
        auto options = mpipe::TrainStepOptions(mb);
        const mpipe::Schedule schedules[] = {mpipe::Schedule::GPipe, mpipe::Schedule::OneFOneB,
                                             mpipe::Schedule::ZeroBubbleH1,
                                             mpipe::Schedule::Auto,
                                             mpipe::Schedule::Interleaved1F1B,
                                             mpipe::Schedule::Tailored,
                                             mpipe::Schedule::ZeroBubbleV,
                                             mpipe::Schedule::DualPipeV};
        options.schedule(schedules[which]);
        if (which == 4) options.virtual_stages(2);
        if (which == 5) options.stage_costs({{1, 2, 1, static_cast<double>(st.pick(0, 3))}});
        what = c10::str("call ", index, ": train_step rows ", rows, " micro-batches ", mb, " ",
                        mpipe::to_string(schedules[which]));
        const at::Tensor loss = p.pipe->train_step(first ? x : at::Tensor(),
                                                   last ? y : at::Tensor(), mse, options);
        if (!inject) {
          const at::Tensor want = mse(p.plain(x), y);
          want.backward();
          if (last && !st.close(loss, want.detach())) st.fail(what + ": losses differ");
          const std::string bad = p.compare_grads();
          if (!bad.empty()) st.fail(what + ": gradients differ at " + bad);
        }
      }
    } else {
      const int64_t T = st.pick(1, 6), rows = st.pick(1, 5);
      const at::Tensor x = st.tensor({rows, 6}, 3.0);
      int64_t chunk = 0;
      if (p.kind == Kind::MultiStep) {
        const int64_t c = st.pick(0, 2);
        chunk = c == 0 ? 1 : c == 1 ? 2 : T;
      }
      const int64_t call = st.pick(0, 2);
      auto chunk_arg = p.kind == Kind::MultiStep ? std::optional<int64_t>(chunk)
                                                  : std::optional<int64_t>();
      // Micro-batches over time: the pipeline's choice, rows, or a count.
      std::optional<mpipe::Split> split;
      const int64_t split_kind = st.pick(0, 2);
      if (split_kind == 1) split = mpipe::Split(st.pick(1, rows));
      if (split_kind == 2) split = mpipe::chunks(st.pick(1, 3));
      const std::string split_name =
          split ? c10::str(" split ", split->by_count() ? "chunks" : "split_size", " ", split->value())
                : std::string();
      const char* kind_name = p.kind == Kind::MultiStep ? "multi-step" : "single-step";
      if (call == 0) {
        const bool reduce = st.pick(0, 1) == 1;
        what = c10::str("call ", index, ": constant_forward ", kind_name, " T ", T, " chunk ",
                        chunk, split_name, reduce ? " reduced" : "");
        torch::NoGradGuard no_grad;
        const at::Tensor out = p.pipe->constant_forward(first ? x : at::Tensor(), T, reduce,
                                                        chunk_arg, split);
        p.reset();
        if (!inject && last) {
          const at::Tensor steps = p.plain_steps(x.unsqueeze(0).expand({T, rows, 6}));
          const at::Tensor want = reduce ? step_sum(steps) : steps.reshape({T * rows, 6});
          if (!st.close(out, want)) st.fail(what + ": outputs differ");
        }
      } else if (call == 1) {
        const at::Tensor seq = st.tensor({T, rows, 6}, 3.0);
        what = c10::str("call ", index, ": sequence_forward ", kind_name, " T ", T, " chunk ",
                        chunk, split_name);
        torch::NoGradGuard no_grad;
        const at::Tensor out = p.pipe->sequence_forward(first ? seq : at::Tensor(), false,
                                                        chunk_arg, split);
        p.reset();
        if (!inject && last && !st.close(out, p.plain_steps(seq))) {
          st.fail(what + ": outputs differ");
        }
      } else {
        const at::Tensor y = st.tensor({rows, 6});
        what = c10::str("call ", index, ": constant_train_step ", kind_name, " T ", T, " chunk ",
                        chunk, split_name);
        const at::Tensor loss = p.pipe->constant_train_step(first ? x : at::Tensor(), T,
                                                            last ? y : at::Tensor(), mse,
                                                            chunk_arg, split);
        if (!inject) {
          const at::Tensor want = mse(step_sum(p.plain_steps(x.unsqueeze(0).expand({T, rows, 6}))), y);
          want.backward();
          if (last && !st.close(loss, want.detach())) st.fail(what + ": losses differ");
          const std::string bad = p.compare_grads();
          if (!bad.empty()) st.fail(what + ": gradients differ at " + bad);
        }
      }
    }
    if (st.verbose) std::printf("stress: rank %lld: %s%s\n", static_cast<long long>(g.rank()),
                                what.c_str(), inject ? " (injected)" : "");
    if (inject) st.fail(what + ": the injected failure in stage " + std::to_string(trapped) +
                        " was not reported");
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (st.expecting_fault) {
      st.fault_message = msg;
      return false;
    }
    if (!inject) {
      st.fail(what + ": " + msg);
      return false;
    }
    // Every rank hears of it, naming the stage.
    if (msg.find("injected failure in stage " + std::to_string(trapped)) == std::string::npos) {
      st.fail(what + ": the injected failure's message does not name stage " +
              std::to_string(trapped) + ": " + msg);
      if (msg.find("timed out") != std::string::npos ||
          msg.find("nothing arrived") != std::string::npos ||
          msg.find("failed in an earlier call") != std::string::npos) {
        return false;
      }
    }
    p.mine.traps[static_cast<size_t>(trapped)]->armed = false;
    p.reset();
    p.compare_grads();  // a failed step's partial gradients are not compared
    return true;
  }
  if (inject) p.mine.traps[static_cast<size_t>(trapped)]->armed = false;
  ++st.passed;
  return true;
}

struct Fault {
  std::string kind;  // "die" or "stall"; empty: none
  int64_t at = -1, rank = -1;
};

/// Call `index` on `p` with --fault's rank dying or stalling in it (or before
/// it); on the others, the checks of the header's comment. Never returns.
[[noreturn]] void fault_call(Stress& st, Pipe& p, int64_t index, const Fault& f, double timeout_s) {
  const int64_t me = st.group.rank(), n = st.group.world_size();
  const double bound = timeout_s + 0.5 * static_cast<double>(n) + 2;
  const double stall_s = bound + 3;  // outlasts the others' bound and their next call
  // Every rank draws the same numbers: where, and which of the faulty rank's stages.
  const bool before = st.pick(0, 1) == 0;
  const auto which = static_cast<size_t>(st.pick(0, 1000)) % p.numbers.size();
  const std::string where = before ? "before the call" : c10::str("in stage ", p.numbers[which]);
  if (me == f.rank) {
    std::printf("stress fault: rank %lld: %s at call %lld, %s\n", static_cast<long long>(me),
                f.kind == "die" ? "dies" : "stalls", static_cast<long long>(index), where.c_str());
    if (before) fault_now(f.kind, stall_s);
    auto& trap = p.mine.traps[static_cast<size_t>(p.numbers[which])];
    trap->armed = true;
    trap->fault = f.kind;
    trap->stall_s = stall_s;
    st.expecting_fault = true;
    one_call(st, p, index, false);  // the trap fires inside it
    fault_now(f.kind, stall_s);
  }
  auto timed = [&](Pipe& q, int64_t k) {
    st.expecting_fault = true;
    st.fault_message.clear();
    const auto start = std::chrono::steady_clock::now();
    const bool ok = one_call(st, q, k, false);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::make_pair(ok ? std::string() : st.fault_message, took);
  };
  const auto first = timed(p, index);
  // The call after it fails at once (the group is broken).
  const auto next = timed(p, index + 1);
  const std::string named = "rank " + std::to_string(f.rank);
  std::string bad;
  if (first.first.empty()) {
    bad = "call " + std::to_string(index) + " did not fail";
  } else if (first.first.find(named) == std::string::npos) {
    bad = "the message does not name " + named;
  } else if (const int64_t r = bystander_named(first.first, f.rank, n); r >= 0) {
    bad = c10::str("the message names rank ", r, ", not the faulty one");
  } else if (first.second > bound) {
    bad = c10::str("it failed after ", first.second, " s, past the bound of ", bound, " s");
  } else if (next.first.empty()) {
    bad = "the next call did not fail";
  } else if (next.second > 1.0) {
    bad = c10::str("the next call failed only after ", next.second, " s");
  }
  std::printf("stress fault: rank %lld: %s (rank %lld %s at call %lld, %s): failed after %.2f s "
              "(bound %.1f s), the next call after %.2f s: %s\n",
              static_cast<long long>(me), bad.empty() ? "OK" : ("FAILED: " + bad).c_str(),
              static_cast<long long>(f.rank), f.kind == "die" ? "died" : "stalled",
              static_cast<long long>(index), where.c_str(), first.second, bound, next.second,
              first.first.c_str());
  std::fflush(stdout);
  std::_Exit(bad.empty() ? 0 : 1);  // the group is broken: no teardown
}

}  // namespace

int main(int argc, char** argv) {
  int64_t calls = 200, replicas = 1;
  uint64_t seed = 12345;
  Fault fault;
  double timeout_s = 60;
  for (int k = 1; k < argc; ++k) {
    const std::string a = argv[k];
    if (a.rfind("--calls=", 0) == 0) calls = std::stoll(a.substr(8));
    else if (a.rfind("--replicas=", 0) == 0) replicas = std::stoll(a.substr(11));
    else if (a.rfind("--timeout=", 0) == 0) timeout_s = std::stod(a.substr(10));
    else if (a.rfind("--seed=", 0) == 0) seed = std::stoull(a.substr(7));
    else if (a.rfind("--fault=", 0) == 0) fault.kind = a.substr(8);
    else if (a.rfind("--fault-at=", 0) == 0) fault.at = std::stoll(a.substr(11));
    else if (a.rfind("--fault-rank=", 0) == 0) fault.rank = std::stoll(a.substr(13));
    else {
      std::fprintf(stderr,
                   "usage: mpipe_dist_stress [--calls=N] [--replicas=R] [--timeout=S] [--seed=N] "
                   "[--fault=die|stall --fault-at=K --fault-rank=R]\n");
      return 2;
    }
  }
  if (!fault.kind.empty() && ((fault.kind != "die" && fault.kind != "stall") || fault.at < 0 ||
                               fault.rank < 0 || replicas != 1)) {
    std::fprintf(stderr, "--fault=die|stall needs --fault-at=K, --fault-rank=R and one replica\n");
    return 2;
  }
  if (!mpipe::distributed::available()) {
    std::printf("mpipe was built without c10d: nothing to test\n");
    return 77;
  }
  Stress st;
  st.draw.seed(seed);
  st.group = mpipe::distributed::init_from_env(
      mpipe::distributed::GroupOptions()
          .replicas(replicas)
          .backend(mpipe::distributed::Backend::Gloo)
          .timeout(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))));
  const auto start = std::chrono::steady_clock::now();
  {
    // Both worker modes: threaded pipelines for A, B and D, inline for C; D
    // is A's model in the V.
    Pipe a(Kind::Mlp, st.group, true), b(Kind::MultiStep, st.group, true),
        c(Kind::SingleStep, st.group, false), d(Kind::Mlp, st.group, true, /*vee=*/true);
    Pipe* pipes[] = {&a, &b, &c, &d};
    int64_t next_injection = st.pick(30, 70);
    for (int64_t k = 0; k < calls; ++k) {
      Pipe& p = *pipes[st.pick(0, 3)];
      const bool inject = k == next_injection;
      if (inject) next_injection = k + st.pick(30, 70);
      if (k == fault.at) fault_call(st, p, k, fault, timeout_s);
      if (!one_call(st, p, k, inject)) break;
    }
  }
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("stress: rank %lld: %lld calls (%lld with an injected failure) in %.1f s, "
              "%.2f ms per call\n",
              static_cast<long long>(st.group.rank()), static_cast<long long>(calls),
              static_cast<long long>(st.injected), took, 1000.0 * took / std::max<int64_t>(calls, 1));
  std::printf("stress: %lld passed, %lld failed\n", static_cast<long long>(st.passed),
              static_cast<long long>(st.failed));
  std::fflush(stdout);
  if (st.failed == 0) {
    try {
      st.group.barrier();
    } catch (const std::exception& e) {
      std::printf("the closing barrier failed: %s\n", e.what());
      return 1;
    }
    st.group = {};
    return 0;
  }
  std::_Exit(1);  // the group may be broken: no teardown
}
