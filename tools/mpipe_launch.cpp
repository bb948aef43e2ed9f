// mpipe-launch: runs N copies of a program as the ranks of one job on this
// machine, the way torchrun does for LibTorch programs, without Python.
//
//   mpipe-launch -n N [--timeout S] [--master-port P] [--max-restarts R] -- ./app args...
//
// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
// (127.0.0.1) and MASTER_PORT (a free port unless given), its stdout and
// stderr prefixed "[rank k] " line by line. When a rank fails (non-zero exit
// or a signal) the others get SIGTERM, then SIGKILL after a grace period, and
// the launcher exits with that rank's status (the first seen failing; the
// lowest when several are seen at once); past --timeout seconds it ends them
// all and exits 124; on SIGINT or SIGTERM it ends them and exits 130. Exit 2:
// bad usage or a launch that could not start. With --max-restarts R, a job
// whose rank failed is started again, every rank, up to R times (each time
// on a new port, TORCHELASTIC_RESTART_COUNT telling the ranks which restart
// this is, as torchrun does); the program resumes from its checkpoints
// (mpipe::JobCheckpoints). --timeout bounds the whole job, restarts included.

#include <CLI/CLI.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

volatile sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

/// A socket bound to TCP port `port` on 127.0.0.1 (0: any) by this process
/// alone, then marked SO_REUSEADDR; -1 when the port is taken. `bound` gets
/// the port.
int hold(int port, int& bound) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  const int on = 1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) != 0) {
    close(fd);
    return -1;
  }
  bound = ntohs(addr.sin_port);
  return fd;
}

/// A TCP port on 127.0.0.1 for rank 0's store, held by this process until
/// it exits (`*held`: the socket). Note [Launch ports]: it is drawn at random
/// from the 10,000 ports below the kernel's ephemeral range
/// (ip_local_port_range), which connections never take on their own: several
/// launches side by side (ctest runs the fault drills so) would otherwise race
/// the ranks' own connections for it. Checking that a port is free and
/// releasing it left a window in which another launch drew the same port
/// (its rank 0 then failed: "Address already in use", about one whole-suite
/// run in two). So the port stays bound, without listening: a socket that is
/// bound first and marked SO_REUSEADDR after keeps every other bind off the
/// port but the store's, which marks its own socket SO_REUSEADDR too (c10d's
/// listening sockets do), and a port that is bound but not listening may be
/// shared by such sockets.
int free_port(int* held) {
  int low = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &low) != 1) low = 32768;
    std::fclose(f);
  }
  int bound = -1;
  if (low > 11024) {
    std::srand(static_cast<unsigned>(getpid()) ^ static_cast<unsigned>(time(nullptr)));
    for (int tries = 0; tries < 100; ++tries) {
      *held = hold(low - 1 - std::rand() % 10000, bound);
      if (*held >= 0) return bound;
    }
  }
  *held = hold(0, bound);
  return *held >= 0 ? bound : -1;
}

struct Rank {
  pid_t pid = -1;
  int out = -1;         // read end of the rank's stdout + stderr
  std::string pending;  // a line not yet ended
  bool running = false;
  int status = 0;       // exit code, or 128 + signal
};

void flush_lines(int rank, Rank& r, bool all) {
  size_t start = 0;
  for (size_t nl; (nl = r.pending.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::printf("[rank %d] %.*s\n", rank, static_cast<int>(nl - start), r.pending.data() + start);
  }
  r.pending.erase(0, start);
  if (all && !r.pending.empty()) {
    std::printf("[rank %d] %s\n", rank, r.pending.c_str());
    r.pending.clear();
  }
  std::fflush(stdout);
}

/// Reads what the rank wrote so far (without blocking) and prints its
/// complete lines; at the end of its output, the rest too.
void drain(int rank, Rank& r) {
  if (r.out < 0) return;
  char buf[4096];
  for (;;) {
    const ssize_t got = read(r.out, buf, sizeof(buf));
    if (got > 0) {
      r.pending.append(buf, static_cast<size_t>(got));
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if (got == 0 || errno != EAGAIN) {
      close(r.out);
      r.out = -1;
      flush_lines(rank, r, true);
      return;
    }
    break;
  }
  flush_lines(rank, r, false);
}

void signal_all(std::vector<Rank>& ranks, int sig) {
  for (auto& r : ranks) {
    if (r.running) kill(-r.pid, sig);  // the rank's process group
  }
}

/// Runs one attempt of the job: n ranks of `program`, until all have exited
/// (see the file's comment); returns the launcher's exit status for it, or -1
/// when a rank could not be started.
int run_job(int n, int port, double timeout, std::chrono::steady_clock::time_point start,
            int attempt, char** program) {
  std::vector<Rank> ranks(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) {
    int fds[2];
    if (pipe(fds) != 0) {
      std::perror("mpipe-launch: pipe");
      signal_all(ranks, SIGKILL);
      return -1;  // the launch could not start
    }
    const pid_t pid = fork();
    if (pid == 0) {
      setpgid(0, 0);
      dup2(fds[1], STDOUT_FILENO);
      dup2(fds[1], STDERR_FILENO);
      close(fds[0]);
      close(fds[1]);
      setenv("RANK", std::to_string(k).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(k).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(attempt).c_str(), 1);
      // As torchrun: one intra-op thread per rank unless the user chose, so
      // N ranks do not oversubscribe the cores.
      if (n > 1) setenv("OMP_NUM_THREADS", "1", /*overwrite=*/0);
      execvp(program[0], program);
      std::fprintf(stderr, "mpipe-launch: cannot run %s: %s\n", program[0],
                   std::strerror(errno));
      _exit(127);
    }
    close(fds[1]);
    if (pid < 0) {
      std::perror("mpipe-launch: fork");
      signal_all(ranks, SIGKILL);
      return -1;  // the launch could not start
    }
    setpgid(pid, pid);  // also here: no race with the child's own call
    fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    ranks[static_cast<size_t>(k)] = Rank{pid, fds[0], {}, true, 0};
  }

  using Clock = std::chrono::steady_clock;
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  int failed = -1;        // the first rank that failed
  bool ending = false;    // SIGTERM sent to all
  double ending_at = 0;   // when
  int result = 0;
  const double grace = 3;
  for (;;) {
    std::vector<pollfd> fds;
    for (auto& r : ranks) {
      if (r.out >= 0) fds.push_back(pollfd{r.out, POLLIN, 0});
    }
    if (!fds.empty()) poll(fds.data(), fds.size(), 100);
    else usleep(100 * 1000);
    for (int k = 0; k < n; ++k) drain(k, ranks[static_cast<size_t>(k)]);
    int running = 0;
    for (int k = 0; k < n; ++k) {
      Rank& r = ranks[static_cast<size_t>(k)];
      if (!r.running) continue;
      int st = 0;
      if (waitpid(r.pid, &st, WNOHANG) == r.pid) {
        r.running = false;
        r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (r.status != 0 && failed < 0 && !ending) {
          failed = k;
          std::fprintf(stderr, "mpipe-launch: rank %d %s %d; ending the other ranks\n", k,
                       WIFEXITED(st) ? "exited with status" : "was killed by signal",
                       WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
        }
      } else {
        ++running;
      }
    }
    if (running == 0) break;
    if (!ending && (failed >= 0 || g_interrupted || (timeout > 0 && elapsed() > timeout))) {
      if (failed < 0 && !g_interrupted) {
        std::fprintf(stderr, "mpipe-launch: timeout after %g s; ending %d running rank(s)\n",
                     timeout, running);
        result = 124;
      }
      if (g_interrupted) result = 130;
      ending = true;
      ending_at = elapsed();
      signal_all(ranks, SIGTERM);
    }
    if (ending && elapsed() - ending_at > grace) signal_all(ranks, SIGKILL);
  }
  // What the ranks wrote between the last read and their exit.
  for (int k = 0; k < n; ++k) {
    Rank& r = ranks[static_cast<size_t>(k)];
    drain(k, r);
    if (r.out >= 0) {  // a process the rank left behind holds the pipe open
      close(r.out);
      r.out = -1;
      flush_lines(k, r, true);
    }
  }
  if (result != 0) return result;
  if (failed >= 0) return ranks[static_cast<size_t>(failed)].status;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Everything after "--" is the program and its arguments.
  int split = 1;
  while (split < argc && std::strcmp(argv[split], "--") != 0) ++split;
  if (split >= argc - 1) {
    std::fprintf(stderr, "mpipe-launch: usage: mpipe-launch -n N [--timeout S] "
                         "[--master-port P] [--max-restarts R] -- PROGRAM [ARGS...]\n");
    return 2;
  }
  int n = 0, port = 0, max_restarts = 0;
  double timeout = 0;
  CLI::App app{"mpipe-launch: run N ranks of a program on this machine"};
  app.add_option("-n,--nproc", n, "number of ranks")->required()->check(CLI::Range(1, 1024));
  app.add_option("--timeout", timeout, "seconds before every rank is ended (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--master-port", port, "MASTER_PORT (default: a free port)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--max-restarts", max_restarts,
                 "start every rank again after a rank failed, up to this many times (default 0)")
      ->check(CLI::Range(0, 1000));
  try {
    app.parse(split, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  int held = -1;  // the port's socket, open until this process exits
  if (port == 0) port = free_port(&held);
  if (port <= 0) {
    std::fprintf(stderr, "mpipe-launch: no free port on 127.0.0.1: %s\n", std::strerror(errno));
    return 2;
  }
  signal(SIGINT, on_signal);
  signal(SIGTERM, on_signal);
  signal(SIGPIPE, SIG_IGN);

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {  // a new port: the last job's store may still hold the old one
      if (held >= 0) close(held);
      held = -1;
      port = free_port(&held);
      if (port <= 0) {
        std::fprintf(stderr, "mpipe-launch: no free port on 127.0.0.1: %s\n", std::strerror(errno));
        return 2;
      }
    }
    const int result = run_job(n, port, timeout, start, attempt, argv + split + 1);
    if (result < 0) return 2;
    if (result == 0 || result == 124 || result == 130 || attempt >= max_restarts) return result;
    std::fprintf(stderr, "mpipe-launch: restarting all %d ranks (restart %d of %d)\n", n,
                 attempt + 1, max_restarts);
  }
}
