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
// for every pid given: one file however many captures, released by the kernel when the holder
// dies, whatever killed it.
class CaptureLock {
 public:
  // Throws Error(kUsage) naming the pid when another capture holds one of `pids`.
  CaptureLock(const std::filesystem::path& run_dir, const std::vector<pid_t>& pids);
  CaptureLock(const CaptureLock&) = delete;
  CaptureLock& operator=(const CaptureLock&) = delete;

 private:
  UniqueFd fd_;
};

}  // namespace gpusnap::engine
