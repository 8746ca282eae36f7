// Writes an artifact under a hidden staging name beside its final path and renames it into
// place only when everything is written and synced. Until commit() the final path does not
// exist; a writer destroyed without commit removes its staging directory.
#pragma once

#include <filesystem>

#include "gpusnap/artifact.h"

namespace gpusnap {

class ArtifactWriter {
 public:
  // Refuses (kUsage) when `final_path` already exists or its parent directory does not.
  explicit ArtifactWriter(std::filesystem::path final_path);
  ArtifactWriter(const ArtifactWriter&) = delete;
  ArtifactWriter& operator=(const ArtifactWriter&) = delete;
  ~ArtifactWriter();

  const std::filesystem::path& staging() const { return staging_; }
  const std::filesystem::path& final_path() const { return final_; }
  std::filesystem::path criu_dir() const { return staging_ / kCriuImageDir; }

  // Checksums every staged file into the manifest (phase "checksum").
  void seal(Manifest& manifest, Phases& phases);
  // Writes the manifest, syncs the tree and renames it to the final path (phase "commit").
  void commit(const Manifest& manifest, Phases& phases);

  // Staging directories are named ".NAME.staging-PID-RANDOM". Removes those in `dir` whose
  // owner is gone (a gpusnap killed before it could clean up). Never throws.
  static void remove_stale_staging(const std::filesystem::path& dir) noexcept;

 private:
  std::filesystem::path final_;
  std::filesystem::path staging_;
  bool committed_ = false;
};

}  // namespace gpusnap
