#include "engine/preflight.h"

#include <unistd.h>

#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

struct Uncapturable {
  const char* target;  // prefix of the fd's link target
  const char* what;
  const char* fix;
};

// Kinds of open file that CRIU 4.x cannot dump, as /proc shows them.
constexpr Uncapturable kUncapturable[] = {
    {"anon_inode:[io_uring]", "an io_uring instance",
     "launch it with `gpusnap run` (which refuses io_uring so libraries fall back to plain "
     "system calls), or disable io_uring in the workload (e.g. UV_USE_IO_URING=0, or sysctl "
     "kernel.io_uring_disabled=2 before it starts)"},
    {"anon_inode:[perf_event]", "a perf event", "stop profiling the workload before the capture"},
    {"anon_inode:bpf-prog", "a BPF program", "detach the BPF program before the capture"},
};

}  // namespace

void refuse_uncapturable(const std::vector<proc::Process>& tree) {
  for (const auto& p : tree) {
    for (const auto& f : p.files) {
      for (const auto& u : kUncapturable) {
        if (f.target.rfind(u.target, 0) == 0) {
          throw Error(ErrorKind::kNotCapturable,
                      "process " + std::to_string(p.pid) + " (" + p.comm + ") holds " + u.what +
                          " (fd " + std::to_string(f.fd) + "), which CRIU cannot checkpoint",
                      u.fix);
        }
      }
    }
  }
}

bool uses_terminal(const std::vector<proc::Process>& tree) {
  for (const auto& p : tree) {
    for (const auto& f : p.files) {
      if (f.fd > 2) continue;
      if (f.target.rfind("/dev/pts/", 0) == 0 || f.target.rfind("/dev/tty", 0) == 0 ||
          f.target == "/dev/console") {
        return true;
      }
    }
  }
  return false;
}

void refuse_bad_root(pid_t root) {
  if (root == 1) {
    throw Error(ErrorKind::kUsage, "pid 1 is the host's init and cannot be captured",
                "give the pid of the workload's own root process");
  }
  for (pid_t p = ::getpid(); p > 1;) {
    if (p == root) {
      throw Error(ErrorKind::kUsage,
                  "pid " + std::to_string(root) + " is gpusnap itself or one of its parents",
                  "give the pid of the workload, not of the shell that runs gpusnap");
    }
    try {
      p = proc::read_process(p).ppid;
    } catch (const Error&) {
      break;
    }
  }
}

}  // namespace gpusnap::engine
