// Who of a captured tree died during the capture, and how.
//
// Why: the driver's checkpoint takes a process's GPU memory away while its CPU threads run on. A
// framework whose threads touch device memory without a CUDA call (JAX/XLA with preallocation
// is one, docs/compatibility.md) dies of SIGSEGV once CRIU thaws it, or dies inside CRIU's
// freeze. CRIU's images of such a process are worthless: every copy restored from them dies the
// same way before its GPU state returns. So a capture watches its tree from before the first
// change to the commit, and commits nothing when a process is gone.
//
// How a death is told: a zombie still carries its wait status in /proc/PID/stat (field 52); a
// process already reaped by its parent does not, and then the kernel log, read from the capture's
// start, may name the fault ("python3[1234]: segfault at ... in libcuda.so..."). The kernel
// prints the faulting thread's id, so the watch knows every thread of the tree.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/proc.h"

namespace gpusnap::engine {

class DeathWatch {
 public:
  // Records each process's identity (its start time, so that a recycled pid is not taken for
  // the process) and threads, and the kernel log's end. Never throws for a process that exits
  // meanwhile: it then counts as dead at the first check.
  explicit DeathWatch(const std::vector<proc::Process>& tree);
  DeathWatch(const DeathWatch&) = delete;
  DeathWatch& operator=(const DeathWatch&) = delete;
  ~DeathWatch() = default;

  // One line per process of the tree that is dead (exited, a zombie, or its pid now another
  // process's), saying how where /proc or the kernel log knows: "process 12 (python3) was
  // killed by SIGSEGV (kernel: python3[14]: segfault at 0 ip ... in libcuda.so...)". Empty
  // while every process lives. Never throws.
  std::vector<std::string> deaths() noexcept;
  // Stops watching `pid`: gpusnap itself ended it (a process the driver marked FAILED).
  void forget(pid_t pid) noexcept;

 private:
  struct Watched {
    pid_t pid = 0;
    std::string comm;
    uint64_t start_time = 0;  // /proc/PID/stat field 22, in clock ticks since boot
    std::set<pid_t> threads;  // every thread id seen, for the kernel's fault lines
  };
  // The kernel log's new records since the last read (bounded), kept for the lines naming a
  // thread of a dead process.
  void read_kernel_log() noexcept;
  std::string kernel_says(const Watched& w) const;

  std::vector<Watched> watched_;
  common::UniqueFd kmsg_;  // /dev/kmsg positioned at the capture's start; closed where unreadable
  std::vector<std::string> kernel_lines_;
};

// The fields of /proc/PID/stat after the command name, split: [0] is field 3 (the state).
// Empty when the process does not exist.
std::vector<std::string> stat_fields(pid_t pid);

// "was killed by SIGSEGV", "was killed by SIGABRT (core dumped)", "exited with status 3", from
// a wait status.
std::string describe_wait_status(int status);

}  // namespace gpusnap::engine
