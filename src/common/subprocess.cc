#include "common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "common/fd.h"
#include "gpusnap/error.h"

extern char** environ;

namespace gpusnap {

std::string ExitStatus::describe() const {
  if (exited) return "exited with code " + std::to_string(code);
  return std::string("killed by signal ") + std::to_string(code) + " (" + ::strsignal(code) + ")";
}

namespace {

int thread_count() {
  std::string status;
  FILE* f = std::fopen("/proc/self/status", "re");
  if (f == nullptr) return -1;
  char line[256];
  int threads = -1;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::sscanf(line, "Threads: %d", &threads) == 1) break;
  }
  std::fclose(f);
  return threads;
}

ExitStatus decode(int raw) {
  if (WIFEXITED(raw)) return {true, WEXITSTATUS(raw)};
  return {false, WTERMSIG(raw)};
}

// Everything the child needs, prepared before fork: after fork only async-signal-safe calls.
struct ChildPlan {
  std::vector<std::string> env_storage;
  std::vector<char*> argv;
  std::vector<char*> envp;
  std::vector<std::pair<int, int>> moves;  // {fd in parent, fd in child}, stdio first
  std::vector<int> kept;                   // fd numbers in the child, sorted
};

[[noreturn]] void child_main(const SpawnOptions& o, ChildPlan& plan, pid_t parent) {
  if (o.kill_with_parent) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    // The parent died before prctl took effect? (In a new PID namespace the parent is
    // outside it and getppid() reads 0.)
    pid_t ppid = ::getppid();
    if (ppid != parent && ppid != 0) ::_exit(127);
  }
  if (o.new_session) ::setsid();
  // Move every source fd above the highest target first so dup2 order cannot clobber one.
  int high = 1000;
  for (auto& [src, dst] : plan.moves) {
    int moved = ::fcntl(src, F_DUPFD_CLOEXEC, high);
    if (moved < 0) ::_exit(126);
    src = moved;
    high = moved + 1;
  }
  for (auto [src, dst] : plan.moves) {
    if (::dup2(src, dst) < 0) ::_exit(126);  // dup2 clears FD_CLOEXEC on dst
  }
  // Close everything else, CLOEXEC or not: an in-process helper never execs, and a pipe end
  // left open in a child would keep its reader from ever seeing EOF. plan.kept is sorted.
  unsigned next = 3;
  for (int keep : plan.kept) {
    if (keep >= static_cast<int>(next)) {
      if (static_cast<unsigned>(keep) > next) ::close_range(next, static_cast<unsigned>(keep) - 1, 0);
      next = static_cast<unsigned>(keep) + 1;
    }
  }
  ::close_range(next, ~0U, 0);
  // Restore default signal handling: CRIU and workloads expect a clean slate.
  for (int sig = 1; sig < NSIG; ++sig) ::signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  if (o.function) {
    int code = 1;
    try {
      code = o.function();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gpusnap helper: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  ::execve(plan.argv[0], plan.argv.data(), plan.envp.data());
  if (std::strchr(plan.argv[0], '/') == nullptr) {
    ::execvpe(plan.argv[0], plan.argv.data(), plan.envp.data());
  }
  ::_exit(127);
}

}  // namespace

Subprocess::Subprocess(const SpawnOptions& o) {
  if (o.argv.empty() && !o.function) throw Error(ErrorKind::kInternal, "spawn: empty command");
  if (o.function && thread_count() != 1) {
    throw Error(ErrorKind::kInternal, "spawn of an in-process helper while other threads run");
  }
  ChildPlan plan;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    auto key = entry.substr(0, entry.find('=') + 1);
    bool replaced = false;
    for (const auto& add : o.env_add) replaced |= add.compare(0, key.size(), key) == 0;
    if (!replaced) plan.env_storage.push_back(entry);
  }
  for (const auto& add : o.env_add) plan.env_storage.push_back(add);
  for (const auto& a : o.argv) plan.argv.push_back(const_cast<char*>(a.c_str()));
  plan.argv.push_back(nullptr);
  for (auto& e : plan.env_storage) plan.envp.push_back(e.data());
  plan.envp.push_back(nullptr);

  UniqueFd devnull(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (!devnull) throw sys_error("open /dev/null", errno);
  int stdio[3] = {o.stdin_fd, o.stdout_fd, o.stderr_fd};
  for (int i = 0; i < 3; ++i) plan.moves.push_back({stdio[i] >= 0 ? stdio[i] : devnull.get(), i});
  for (auto [src, dst] : o.keep_fds) {
    plan.moves.push_back({src, dst});
    plan.kept.push_back(dst);
  }
  std::sort(plan.kept.begin(), plan.kept.end());
  pid_t parent = ::getpid();
  if (o.clone_flags != 0) {
    // clone with namespace flags but fork semantics (no new stack: the child gets a copy).
    pid_ = static_cast<pid_t>(::syscall(SYS_clone, o.clone_flags | SIGCHLD, nullptr, nullptr,
                                        nullptr, nullptr));
  } else {
    pid_ = ::fork();
  }
  if (pid_ < 0) throw sys_error("fork " + o.argv[0], errno);
  if (pid_ == 0) child_main(o, plan, parent);
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)), status_(std::move(other.status_)) {}

Subprocess::~Subprocess() {
  if (running()) {
    ::kill(pid_, SIGKILL);
    int raw;
    while (::waitpid(pid_, &raw, 0) < 0 && errno == EINTR) {
    }
  }
}

std::optional<ExitStatus> Subprocess::poll() {
  if (status_ || pid_ <= 0) return status_;
  int raw;
  pid_t r = ::waitpid(pid_, &raw, WNOHANG);
  if (r == pid_) status_ = decode(raw);
  return status_;
}

std::optional<ExitStatus> Subprocess::wait(std::optional<std::chrono::milliseconds> timeout) {
  if (status_ || pid_ <= 0) return status_;
  if (!timeout) {
    int raw;
    pid_t r;
    while ((r = ::waitpid(pid_, &raw, 0)) < 0 && errno == EINTR) {
    }
    if (r == pid_) status_ = decode(raw);
    return status_;
  }
  // pidfd lets us sleep until the exit instead of polling.
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)));
  auto deadline = std::chrono::steady_clock::now() + *timeout;
  while (!poll()) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    if (pidfd) {
      struct pollfd p{pidfd.get(), POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  return status_;
}

void Subprocess::kill(int signal) {
  if (running()) ::kill(pid_, signal);
}

pid_t Subprocess::release() {
  pid_t pid = pid_;
  pid_ = -1;
  return pid;
}

RunResult run_capture(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  Pipe out = Pipe::make();
  SpawnOptions o;
  o.argv = argv;
  o.stdout_fd = out.write.get();
  o.stderr_fd = out.write.get();
  Subprocess child(o);
  out.write.reset();
  RunResult result;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      child.kill(SIGKILL);
      child.wait();
      throw Error(ErrorKind::kTimeout, argv[0] + " did not finish within " +
                                           std::to_string(timeout.count()) + " ms");
    }
    struct pollfd p{out.read.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t n = ::read(out.read.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    result.output.append(buf, static_cast<size_t>(n));
  }
  result.status = *child.wait();
  return result;
}

}  // namespace gpusnap
