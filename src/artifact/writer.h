// Writes an artifact under a hidden staging name beside its final path and renames it into
// place only when everything is written and synced. Until commit() the final path does not
// exist; a writer destroyed without commit removes its staging directory.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/fd.h"
#include "gpusnap/artifact.h"

namespace gpusnap::artifact {

struct WriterOptions {
  std::optional<gid_t> group;  // may read the committed artifact (default: root only)
  // Where the writer records its staging directory until it is committed or removed, so that
  // `gpusnap recover` finds the staging directory of a gpusnap that was killed (empty: none).
  std::filesystem::path run_dir;
};

// A staging directory an earlier writer of the same final path left (a pull killed or failed),
// with the flock its finder holds on it: the writer takes over that same open file, since a
// second open of the directory would conflict with the first one's lock.
struct StagingDir {
  std::filesystem::path dir;
  common::UniqueFd lock;
};

class ArtifactWriter {
 public:
  // Refuses (kUsage) when `final_path` already exists or its parent directory does not. The
  // artifact holds the workload's memory: it is root-only (0700 directories, 0600 files) from
  // the staging directory's first instant, whatever the umask; `group`, when given, may read
  // the committed artifact (WriterOptions::group).
  explicit ArtifactWriter(const std::filesystem::path& final_path, WriterOptions options = {});
  // The same, resuming `earlier`: renamed to this writer's own staging name (its PID is the one
  // a record names) and written into again. When it is gone meanwhile, a new one is made.
  ArtifactWriter(const std::filesystem::path& final_path, WriterOptions options,
                 StagingDir earlier);
  ArtifactWriter(const ArtifactWriter&) = delete;
  ArtifactWriter& operator=(const ArtifactWriter&) = delete;
  ~ArtifactWriter();

  const std::filesystem::path& staging() const { return staging_; }
  // Whether the staging directory is an earlier writer's, with what it wrote.
  bool resumed() const { return resumed_; }
  const std::filesystem::path& final_path() const { return final_; }
  std::filesystem::path criu_dir() const { return staging_ / kCriuImageDir; }

  // Checksums every staged file into the manifest (phase "checksum"); the files of `known`
  // were hashed by their writer and are not read again.
  void seal(Manifest& manifest, Phases& phases, const std::vector<FileRecord>& known = {});
  // Writes the manifest, syncs the tree and renames it to the final path (phase "commit").
  void commit(const Manifest& manifest, Phases& phases);

  // Leaves the staging directory where it is when the writer is destroyed uncommitted (what
  // was written is worth keeping: a pull resumes from it). Its lock is released all the same.
  void keep_staging() { keep_ = true; }
  // Whether `entry` (a file name) is the staging directory of a writer of `final_name`, or of
  // any writer.
  static bool is_staging_of(const std::string& entry, const std::string& final_name);
  static bool is_staging(const std::string& entry);
  // A new staging name for `final_path` (of this process), beside it.
  static std::filesystem::path staging_path(const std::filesystem::path& final_path);

  // Staging directories are named ".NAME.staging-PID-RANDOM". Removes those in `dir` whose
  // owner is gone (a gpusnap killed before it could clean up): those nobody holds the flock
  // of. Never throws.
  static void remove_stale_staging(const std::filesystem::path& dir) noexcept;
  // Removes the staging directories of writers that recorded them in `run_dir` and died, and
  // their records. Returns what was removed, one line each. Never throws.
  static std::vector<std::string> remove_abandoned_staging(
      const std::filesystem::path& run_dir) noexcept;

 private:
  // Opens and flocks staging_ into staging_lock_. False when the directory was removed before
  // the lock was taken; throws (having removed the directory) when it cannot be locked.
  bool lock_staging();
  // Renames `earlier` to staging_ and holds its lock. False when it is no longer there.
  bool take_over(StagingDir earlier);
  // Removes one staging directory whose owner is dead and whose lock nobody holds.
  static void remove_stale_staging_entry(const std::filesystem::path& staged, pid_t owner) noexcept;

  std::filesystem::path final_;
  std::filesystem::path staging_;
  // The staging directory, opened and flock(LOCK_EX)ed for the writer's lifetime: the proof
  // that its owner lives, valid across PID namespaces (containers sharing the volume), where
  // the PID in the name says nothing. Released when the writer is destroyed or its process
  // dies. The CRIU dump guardian (engine/dump_guard.h) may outlive it, CRIU still writing into
  // the directory without holding the lock. That is acceptable: such a dump is abandoned, the
  // guardian removes the directory itself once CRIU is done, and a sweep that removes it first
  // costs nothing but a failed dump, after which CRIU resumes the tree as on any failure.
  common::UniqueFd staging_lock_;
  WriterOptions options_;
  std::filesystem::path record_;  // this writer's entry under run_dir (empty: none)
  bool committed_ = false;
  bool keep_ = false;
  bool resumed_ = false;
};

}  // namespace gpusnap::artifact
