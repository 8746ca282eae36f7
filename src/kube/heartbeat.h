// The controller's sign of life for a liveness probe: a file whose modification time the
// worker loop sets on each turn. A probe that reads the file's age learns whether the loop
// still turns -- which a process that merely exists, or a port that answers from another
// thread, would not prove.
#pragma once

#include <filesystem>

namespace gpusnap::kube {

class Heartbeat {
 public:
  // `file` empty: beat() does nothing (no probe asked for one).
  explicit Heartbeat(std::filesystem::path file) : file_(std::move(file)) {}

  // Creates the file if it is missing and sets its modification time to now. A failure (the
  // directory gone, a read-only mount) is left for the probe to notice as a stale file: the
  // loop itself goes on. Never throws.
  void beat() const noexcept;

  const std::filesystem::path& file() const { return file_; }

 private:
  std::filesystem::path file_;
};

}  // namespace gpusnap::kube
