// Launching a workload so that it can be captured: its own session, no terminal, its output in
// a log file, io_uring refused (libraries then fall back to plain system calls), a
// handshake control directory in GPUSNAP_CONTROL_DIR, libgpusnap-preload.so in LD_PRELOAD
// (engine/preload.h) and, when asked, the memory tier for Python (engine/python_site.h).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/subprocess.h"

namespace gpusnap::engine {

struct LaunchOptions {
  // gpusnap's Python site folder first on PYTHONPATH and GPUSNAP_MEMORY_TIER=1: a Python
  // workload gets the memory tier when it imports torch (`run --memory-tier`).
  bool memory_tier = false;
};

class LaunchedWorkload {
 public:
  // Starts argv with its state under run_dir/launched/<id>/ (control/, output.log). Throws
  // Error(kUsage), having made nothing, when a library or folder it is to get is missing.
  LaunchedWorkload(const std::vector<std::string>& argv, const std::filesystem::path& run_dir,
                   const LaunchOptions& options = {});
  // Kills the workload unless release() was called.
  ~LaunchedWorkload() = default;

  pid_t pid() const { return pid_; }
  const std::filesystem::path& control_dir() const { return control_dir_; }
  const std::filesystem::path& log() const { return log_; }
  // The Python site folder first on its PYTHONPATH; empty without LaunchOptions::memory_tier.
  const std::filesystem::path& python_site() const { return python_site_; }
  // The last lines of its output, for error messages.
  std::string output_tail(size_t lines = 5) const;
  // The workload outlives this object (and gpusnap).
  void release() { process_->release(); }

 private:
  std::filesystem::path control_dir_;
  std::filesystem::path log_;
  std::filesystem::path python_site_;
  std::optional<common::Subprocess> process_;
  pid_t pid_ = 0;
};

}  // namespace gpusnap::engine
