// One capture of a process at a time. Two gpusnaps capturing one tree at once both freeze it
// and both run CRIU's dump: the loser failed with CRIU's "Unable to detach from PID: No such
// process", which names neither the cause nor the fix. The lock makes the second one refuse
// before it touches the workload.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <vector>

#include "common/fd.h"

namespace gpusnap::engine {

// Holds, for its lifetime, an open-file-description lock on byte PID of run_dir/captures.lock
// for every pid given: one file however many captures, released by the kernel when the last
// holder of the descriptor dies, whatever killed it. The capture's guardian (dump_guard.h) holds
// it too, so that a gpusnap killed while CRIU dumps keeps the process locked until the
// guardian has finished the dump and put everything back.
class CaptureLock {
 public:
  // Throws Error(kUsage) naming the pid when another capture holds one of `pids`.
  CaptureLock(const std::filesystem::path& run_dir, const std::vector<pid_t>& pids);
  CaptureLock(const CaptureLock&) = delete;
  CaptureLock& operator=(const CaptureLock&) = delete;
  ~CaptureLock() = default;  // the descriptor's close releases the locks

  // The descriptor whose open file description holds the locks, for the guardian to share.
  int fd() const { return fd_.get(); }

 private:
  common::UniqueFd fd_;
};

}  // namespace gpusnap::engine
