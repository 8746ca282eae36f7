#include "engine/preflight.h"

#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "common/fs.h"
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

void refuse_unsafe_nccl(const std::vector<proc::Process>& tree, const std::vector<pid_t>& cuda) {
  // One CUDA process has no peers; NCCL within one process needs no cross-process transport.
  if (cuda.size() < 2) return;
  // The settings that keep NCCL on transports the checkpoint can carry: sockets between ranks.
  static const std::pair<const char*, const char*> kRequired[] = {{"NCCL_P2P_DISABLE", "1"},
                                                                  {"NCCL_SHM_DISABLE", "1"},
                                                                  {"NCCL_NVLS_ENABLE", "0"},
                                                                  {"NCCL_CUMEM_ENABLE", "0"}};
  for (pid_t pid : cuda) {
    std::string maps, environ;
    auto dir = "/proc/" + std::to_string(pid);
    if (!fs::try_read_file(dir + "/maps", &maps) || maps.find("libnccl") == std::string::npos) {
      continue;
    }
    fs::try_read_file(dir + "/environ", &environ);
    std::string missing;
    for (const auto& [key, value] : kRequired) {
      std::string want = std::string(key) + "=" + value;
      bool set = false;
      for (size_t start = 0; start < environ.size();) {
        auto end = environ.find('\0', start);
        if (end == std::string::npos) end = environ.size();
        set |= environ.compare(start, end - start, want) == 0;
        start = end + 1;
      }
      if (!set) missing += (missing.empty() ? "" : " ") + want;
    }
    if (!missing.empty()) {
      std::string comm;
      for (const auto& p : tree) {
        if (p.pid == pid) comm = p.comm;
      }
      throw Error(ErrorKind::kNotCapturable,
                  "process " + std::to_string(pid) + " (" + comm + ") uses NCCL across " +
                      std::to_string(cuda.size()) +
                      " CUDA processes with transports the driver cannot checkpoint "
                      "(peer-to-peer, shared memory, NVLink SHARP)",
                  "start the workload with " + missing);
    }
  }
}

void refuse_bad_root(pid_t root) {
  if (root == 1) {
    throw Error(ErrorKind::kUsage, "pid 1 is the host's init and cannot be captured",
                "give the pid of the workload's own root process");
  }
  if (is_kernel_thread(root)) {
    throw Error(ErrorKind::kUsage, "pid " + std::to_string(root) + " is a kernel thread",
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

bool is_kernel_thread(pid_t pid) {
  constexpr unsigned long kPfKthread = 0x00200000;  // include/linux/sched.h
  std::string stat;
  if (!fs::try_read_file("/proc/" + std::to_string(pid) + "/stat", &stat)) return false;
  // The fields after the command name (which may hold spaces and parentheses): state, ppid,
  // pgrp, session, tty_nr, tpgid, flags.
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 0; i < 7; ++i) fields >> field;
  return (std::strtoul(field.c_str(), nullptr, 10) & kPfKthread) != 0;
}

}  // namespace gpusnap::engine
