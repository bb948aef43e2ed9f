// Test entry point: prints what the run can reach. Tests that need one GPU end
// in _CUDA and those that need two end in _MultiCUDA; they skip themselves
// (GTEST_SKIP) when the devices are missing, see tests/common.h.
//
// Note [One process per shard]: ctest runs this program in a few shards, not
// once per test (tests/CMakeLists.txt): starting a process costs 0.8 s of
// LibTorch's static initialisation on the 2-core build machine, more than
// most tests take. With MPIPE_TEST_RESULTS=DIR, each test's outcome is
// written to DIR/<test name, '/' as '~'>.result: a first line PASSED, SKIPPED
// or FAILED, then the failure messages. ctest's entry for the test prints
// that file and passes, skips or fails by its first line, so every test
// still has an entry of its own; a shard that crashes leaves its remaining
// tests without a file, and their entries fail. `ctest -R Name` runs the
// shards too (the entries' fixture); to run one test alone:
// `build/tests/mpipe_tests --gtest_filter=Name`.
#include <gtest/gtest.h>

#include <torch/cuda.h>
#include <mpipe/version.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <csignal>
#include <execinfo.h>
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

namespace {

class ResultFiles : public ::testing::EmptyTestEventListener {
 public:
  explicit ResultFiles(std::string dir) : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    std::string name = std::string(info.test_suite_name()) + "." + info.name();
    for (char& c : name) {
      if (c == '/') c = '~';
    }
    const ::testing::TestResult& r = *info.result();
    std::ofstream out(dir_ + "/" + name + ".result");
    out << (r.Failed() ? "FAILED" : r.Skipped() ? "SKIPPED" : "PASSED") << " (" << r.elapsed_time()
        << " ms, shard " << (std::getenv("GTEST_SHARD_INDEX") ? std::getenv("GTEST_SHARD_INDEX") : "-")
        << ")\n";
    for (int k = 0; k < r.total_part_count(); ++k) {
      const ::testing::TestPartResult& part = r.GetTestPartResult(k);
      if (part.failed() || part.skipped()) {
        out << (part.file_name() ? part.file_name() : "?") << ":" << part.line_number() << ": "
            << part.message() << "\n";
      }
    }
  }

 private:
  std::string dir_;
};

/// On a crash, the stack to stderr before the process dies (the GPU machine
/// has no debugger): the unwound frames, then the faulting instruction and
/// the code addresses among the top 64 words of the stack (where unwinding
/// stops, as after a call through a null pointer); then the default action.
void print_stack(int sig, siginfo_t* info, void* context) {
  void* frames[128];
  int n = backtrace(frames, 64);
  const char what[] = "mpipe_tests: fatal signal; stack, then the faulting pc and stack words:\n";
  (void)!write(2, what, sizeof(what) - 1);
  const auto* uc = static_cast<const ucontext_t*>(context);
  frames[n++] = reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]);
  frames[n++] = info->si_addr;
  auto* const* sp = reinterpret_cast<void* const*>(uc->uc_mcontext.gregs[REG_RSP]);
  for (int k = 0; k < 62; ++k) frames[n++] = sp[k];
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  struct sigaction on_crash {};
  on_crash.sa_sigaction = print_stack;
  on_crash.sa_flags = SA_SIGINFO;
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT}) sigaction(sig, &on_crash, nullptr);
  if (!::testing::GTEST_FLAG(list_tests)) {
    std::printf("mpipe %s tests; CUDA devices visible: %lld\n", MPIPE_VERSION_STRING,
                static_cast<long long>(torch::cuda::device_count()));
    if (const char* dir = std::getenv("MPIPE_TEST_RESULTS")) {
      ::testing::UnitTest::GetInstance()->listeners().Append(new ResultFiles(dir));
    }
  }
  return RUN_ALL_TESTS();
}
