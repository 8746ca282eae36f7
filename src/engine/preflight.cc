#include "engine/preflight.h"

#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <sstream>

#include "common/fs.h"
#include "common/room.h"
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

// The value of `key` in a process's environment as it started (/proc/PID/environ, NUL-separated
// "KEY=VALUE" entries); nullopt when it is not set.
std::optional<std::string> environ_value(const std::string& environ, const std::string& key) {
  for (size_t start = 0; start < environ.size();) {
    auto end = environ.find('\0', start);
    if (end == std::string::npos) end = environ.size();
    if (environ.compare(start, key.size() + 1, key + "=") == 0) {
      return environ.substr(start + key.size() + 1, end - start - key.size() - 1);
    }
    start = end + 1;
  }
  return std::nullopt;
}

std::string comm_of(const std::vector<proc::Process>& tree, pid_t pid) {
  for (const auto& p : tree) {
    if (p.pid == pid) return p.comm;
  }
  return {};
}

// Libraries that show XLA's GPU runtime in a process's maps: jaxlib's own extension and the
// CUDA plugin JAX loads (older and newer layouts).
constexpr const char* kXlaLibraries[] = {"/jaxlib/", "/jax_plugins/", "xla_extension",
                                         "xla_cuda_plugin", "libxla"};

// The variable that turns XLA's preallocation off, and the value that does it.
constexpr const char* kXlaPreallocate = "XLA_PYTHON_CLIENT_PREALLOCATE";

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
      if (environ_value(environ, key) != value) {
        missing += (missing.empty() ? "" : " ") + std::string(key) + "=" + value;
      }
    }
    if (!missing.empty()) {
      std::string comm = comm_of(tree, pid);
      throw Error(ErrorKind::kNotCapturable,
                  "process " + std::to_string(pid) + " (" + comm + ") uses NCCL across " +
                      std::to_string(cuda.size()) +
                      " CUDA processes with transports the driver cannot checkpoint "
                      "(peer-to-peer, shared memory, NVLink SHARP)",
                  "start the workload with " + missing);
    }
  }
}

void refuse_xla_preallocation(const std::vector<proc::Process>& tree,
                              const std::vector<pid_t>& cuda) {
  for (pid_t pid : cuda) {
    std::string maps, environ;
    auto dir = "/proc/" + std::to_string(pid);
    if (!fs::try_read_file(dir + "/maps", &maps)) continue;
    const char* library = nullptr;
    for (const char* l : kXlaLibraries) {
      if (maps.find(l) != std::string::npos) library = l;
    }
    if (library == nullptr) continue;
    fs::try_read_file(dir + "/environ", &environ);
    auto preallocate = environ_value(environ, kXlaPreallocate);
    auto allocator = environ_value(environ, "XLA_PYTHON_CLIENT_ALLOCATOR");
    std::string why;
    if (preallocate != "false" && preallocate != "0") {
      why = std::string("with XLA's preallocation on (") + kXlaPreallocate + " is " +
            (preallocate ? "'" + *preallocate + "'" : std::string("unset")) + ")";
    } else if (allocator == "platform" || allocator == "cuda_async") {
      why = "with XLA_PYTHON_CLIENT_ALLOCATOR=" + *allocator;
    }
    if (why.empty()) continue;
    throw Error(ErrorKind::kNotCapturable,
                "process " + std::to_string(pid) + " (" + comm_of(tree, pid) +
                    ") runs JAX/XLA on the GPU " + why +
                    ": it dies of SIGSEGV inside libcuda once the driver's checkpoint takes its "
                    "GPU memory, and its artifact would not restore",
                "start it with XLA_PYTHON_CLIENT_PREALLOCATE=false and XLA's default allocator "
                "(`gpusnap run` sets that); see docs/compatibility.md");
  }
}

std::vector<std::string> capturable_environment() {
  std::vector<std::string> out;
  // JAX: preallocation makes the driver's checkpoint kill the process (docs/compatibility.md).
  if (std::getenv(kXlaPreallocate) == nullptr)
    out.push_back(std::string(kXlaPreallocate) + "=false");
  return out;
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

uint64_t memory_available(const std::string& meminfo) {
  std::istringstream lines(meminfo);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    uint64_t kib = 0;
    fields >> kib;
    return kib * 1024;
  }
  return 0;
}

void measure_host(CaptureRoom& room, const std::filesystem::path& store) {
  room.store = store;
  const fs::Room where = fs::room_of(store);
  room.store_in_ram = where.in_ram;
  room.store_free = where.free;
  std::string meminfo;
  room.memory_available =
      fs::try_read_file("/proc/meminfo", &meminfo) ? memory_available(meminfo) : 0;
}

void refuse_without_room(const CaptureRoom& room) {
  using fs::human_bytes;
  if (room.memory_available > 0 && room.memory_needed() > room.memory_available) {
    std::string parts;
    if (room.copied_gpu_bytes > 0) {
      parts += human_bytes(room.copied_gpu_bytes) +
               " of GPU memory the driver's checkpoint puts in "
               "the processes' own memory";
    }
    if (room.store_in_ram) {
      parts += std::string(parts.empty() ? "" : " + ") + human_bytes(room.store_needed()) +
               " of artifact in RAM (" + room.store.string() + ")";
    }
    throw Error(ErrorKind::kEnvironment,
                "the capture needs " + human_bytes(room.memory_needed()) + " of host memory (" +
                    parts + "), this host has " + human_bytes(room.memory_available) +
                    " available (MemAvailable)",
                room.copied_gpu_bytes > 0
                    ? "start the workload with libgpusnap-preload.so (gpusnap run or init), so "
                      "that the driver writes its GPU memory straight into the artifact; or free "
                      "memory, or write the artifact to disk"
                    : "free memory, or write the artifact to a store on disk");
  }
  if (room.store_needed() > room.store_free) {
    throw Error(ErrorKind::kEnvironment,
                "the artifact needs up to " + human_bytes(room.store_needed()) + " (" +
                    human_bytes(room.gpu_bytes) + " of GPU memory + " +
                    human_bytes(room.cpu_bytes) + " of CPU memory), " + room.store.string() +
                    " has " + human_bytes(room.store_free) + " free",
                "free space there, or write the artifact elsewhere (-o)");
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
