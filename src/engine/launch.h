// Launching a workload so that it can be captured: its own session, no terminal, its output in
// a log file, io_uring refused (libraries then fall back to plain system calls), a
// handshake control directory in GPUSNAP_CONTROL_DIR, and libgpusnap-preload.so in LD_PRELOAD
// (engine/preload.h).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/subprocess.h"

namespace gpusnap::engine {

class LaunchedWorkload {
 public:
  // Starts argv with its state under run_dir/launched/<id>/ (control/, output.log).
  LaunchedWorkload(const std::vector<std::string>& argv, const std::filesystem::path& run_dir);
  // Kills the workload unless release() was called.
  ~LaunchedWorkload() = default;

  pid_t pid() const { return pid_; }
  const std::filesystem::path& control_dir() const { return control_dir_; }
  const std::filesystem::path& log() const { return log_; }
  // The last lines of its output, for error messages.
  std::string output_tail(size_t lines = 5) const;
  // The workload outlives this object (and gpusnap).
  void release() { process_->release(); }

 private:
  std::filesystem::path control_dir_;
  std::filesystem::path log_;
  std::optional<common::Subprocess> process_;
  pid_t pid_ = 0;
};

}  // namespace gpusnap::engine
