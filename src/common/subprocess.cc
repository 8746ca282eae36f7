#include "common/subprocess.h"

#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <sys/mount.h>
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

namespace gpusnap::common {

std::string ExitStatus::describe() const {
  if (exited) return "exited with code " + std::to_string(code);
  // sigdescr_np, not strsignal: it returns a constant string and is safe beside other threads.
  const char* what = ::sigdescr_np(code);
  return std::string("killed by signal ") + std::to_string(code) + " (" +
         (what != nullptr ? what : "unknown signal") + ")";
}

namespace {

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
  std::vector<sock_filter> filter;         // seccomp program (deny_io_uring)
};

// A seccomp program: io_uring_setup fails with ENOSYS; everything else is allowed. On another
// architecture than the one gpusnap was built for, everything is allowed (the syscall number
// would mean something else).
std::vector<sock_filter> io_uring_filter() {
  return {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
}

[[noreturn]] void child_main(const SpawnOptions& o, ChildPlan& plan, pid_t parent) {
  if (o.kill_with_parent) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    // The parent died before prctl took effect? (In a new PID namespace the parent is
    // outside it and getppid() reads 0.)
    pid_t ppid = ::getppid();
    if (ppid != parent && ppid != 0) ::_exit(127);
  }
  if (o.new_session) ::setsid();
  if (!o.bind_mounts.empty()) {
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) ::_exit(124);
    for (const auto& [source, target] : o.bind_mounts) {
      if (::mount(source.c_str(), target.c_str(), nullptr, MS_BIND, nullptr) != 0) ::_exit(124);
    }
  }
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
  // Close everything else, CLOEXEC or not: a descriptor opened without O_CLOEXEC (by a library,
  // or by a thread racing this fork) would otherwise reach the program, and a pipe end left open
  // in a child would keep its reader from ever seeing EOF. plan.kept is sorted.
  unsigned next = 3;
  for (int keep : plan.kept) {
    if (keep >= static_cast<int>(next)) {
      if (static_cast<unsigned>(keep) > next)
        ::close_range(next, static_cast<unsigned>(keep) - 1, 0);
      next = static_cast<unsigned>(keep) + 1;
    }
  }
  ::close_range(next, ~0U, 0);
  // Restore default signal handling: CRIU and workloads expect a clean slate.
  for (int sig = 1; sig < NSIG; ++sig) ::signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::pthread_sigmask(SIG_SETMASK, &none, nullptr);
  if (o.deny_io_uring) {
    // Once set, no_new_privs and the filter hold for every descendant. Failure is fatal: the
    // caller asked for a capturable process.
    struct sock_fprog prog {
      static_cast<unsigned short>(plan.filter.size()), plan.filter.data()
    };
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
      ::_exit(125);
    }
  }
  ::execve(plan.argv[0], plan.argv.data(), plan.envp.data());
  if (std::strchr(plan.argv[0], '/') == nullptr) {
    ::execvpe(plan.argv[0], plan.argv.data(), plan.envp.data());
  }
  ::_exit(127);
}

}  // namespace

Subprocess::Subprocess(const SpawnOptions& o) {
  if (o.argv.empty()) throw Error(ErrorKind::kInternal, "spawn: empty command");
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
  if (o.deny_io_uring) plan.filter = io_uring_filter();
  if (!o.bind_mounts.empty() && (o.clone_flags & CLONE_NEWNS) == 0) {
    throw Error(ErrorKind::kInternal, "spawn: bind mounts need a mount namespace of its own");
  }
  pid_t parent = ::getpid();
  if (o.clone_flags != 0) {
    // clone with namespace flags but fork semantics (no new stack: the child gets a copy).
    pid_ = static_cast<pid_t>(
        ::syscall(SYS_clone, o.clone_flags | SIGCHLD, nullptr, nullptr, nullptr, nullptr));
  } else {
    pid_ = ::fork();
  }
  if (pid_ < 0) throw sys_error("fork " + o.argv[0], errno);
  if (pid_ == 0) child_main(o, plan, parent);
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)), status_(other.status_) {}

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
    // Rounded up: truncating to whole milliseconds would return up to 1 ms before the timeout.
    auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    if (pidfd) {
      struct pollfd p {
        pidfd.get(), POLLIN, 0
      };
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

void reap_in_background(Subprocess child) {
  if (!child.running()) return;
  std::thread([c = std::move(child)]() mutable { (void)c.wait(); }).detach();
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
  auto remaining = [&] {
    return std::chrono::ceil<std::chrono::milliseconds>(deadline -
                                                        std::chrono::steady_clock::now());
  };
  auto timed_out = [&]() -> Error {
    child.kill(SIGKILL);
    child.wait();
    return Error(ErrorKind::kTimeout,
                 argv[0] + " did not finish within " + std::to_string(timeout.count()) + " ms");
  };
  // EOF on the pipe alone does not mean the command finished (it may close its output and run
  // on), and the command finishing does not bring EOF (a grandchild it left behind may hold the
  // pipe open): watch both, the exit through a pidfd (without one, by polling every 10 ms).
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, child.pid(), 0)));
  char buf[4096];
  auto read_some = [&]() -> bool {  // false on EOF or error
    for (;;) {
      ssize_t n = ::read(out.read.get(), buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      result.output.append(buf, static_cast<size_t>(n));
      return true;
    }
  };
  auto readable_now = [&] {
    struct pollfd p {
      out.read.get(), POLLIN, 0
    };
    int r;
    while ((r = ::poll(&p, 1, 0)) < 0 && errno == EINTR) {
    }
    return r > 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
  };
  for (;;) {
    auto left = remaining();
    if (left.count() <= 0) throw timed_out();
    struct pollfd p[2] = {{out.read.get(), POLLIN, 0}, {pidfd.get(), POLLIN, 0}};
    int wait_ms = static_cast<int>(std::min<int64_t>(left.count(), pidfd ? 1000 : 10));
    if (::poll(p, pidfd ? 2 : 1, wait_ms) < 0 && errno != EINTR) {
      throw sys_error("poll output of " + argv[0], errno);
    }
    if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0 && !read_some()) {
      // EOF: everything that holds the pipe is gone, but the command may still run.
      out.read.reset();
      break;
    }
    if (child.poll()) {
      // Exited: what it wrote is already in the pipe. Take what is readable without blocking
      // and stop; at most one pipe's capacity more, so a grandchild that keeps writing cannot
      // hold us here (the child's own output, written before it exited, comes first).
      int capacity = ::fcntl(out.read.get(), F_GETPIPE_SZ);
      size_t limit = result.output.size() + static_cast<size_t>(capacity > 0 ? capacity : 65536);
      while (result.output.size() < limit && readable_now() && read_some()) {
      }
      result.status = *child.poll();
      return result;
    }
  }
  auto left = remaining();
  std::optional<ExitStatus> status;
  if (left.count() > 0) status = child.wait(left);
  if (!status) throw timed_out();
  result.status = *status;
  return result;
}

}  // namespace gpusnap::common
