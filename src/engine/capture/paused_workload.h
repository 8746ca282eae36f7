// The workload of a capture that speaks the handshake (docs/handshake.md), for
// engine/checkpoint.cc: found by its control directory where it has said READY; asked to pause
// (phase pause), its memory tier draining into the folder the request names; asked to resume as
// the source after the dump with --leave-running (phase resume); left paused for the stop
// otherwise (commit()).
//
// Rollback: once it answered PAUSED, destroying it before resume() or commit() asks it to resume
// as the source (restored=false), so that no failure leaves it paused; a failure of that is a
// note. A container's workload reaches the tier's folder through a mount in its handshake
// directory, which outlives that resume: the resume fills back through it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "container/mount.h"
#include "engine/handshake.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/phases.h"

namespace gpusnap::engine {

class PausedWorkload {
 public:
  // Looks for the handshake of the workload `options.pid` (none with options.handshake off, no
  // control directory, or no READY in it). `in_container`: the workload names its directory in
  // its own root.
  PausedWorkload(const CheckpointOptions& options, bool in_container, Reporter& reporter);
  ~PausedWorkload();
  PausedWorkload(const PausedWorkload&) = delete;
  PausedWorkload& operator=(const PausedWorkload&) = delete;

  bool speaks_handshake() const { return handshake_.has_value(); }
  // Its handshake directory as gpusnap reaches it; empty without the handshake.
  std::filesystem::path dir() const;
  // Its control directory as the workload names it (the manifest's control_dir).
  const std::filesystem::path& control_dir() const { return control_dir_; }
  // Whether it answered PAUSED (and so was captured paused).
  bool paused() const { return paused_; }

  // Phase pause: asks it to pause, its memory tier draining into `tier_dir` (STAGING/tier), and
  // says what it gave back, where it says so. Throws kHandshake or kTimeout, the workload then
  // left as it was.
  void pause(const std::filesystem::path& tier_dir);
  // Whether the tier's folder is kept (it drained something): the resume fills back from it.
  void keep_tier(bool kept);
  // Phase resume (--leave-running): it resumes as the source of `artifact_id`.
  void resume(const std::string& artifact_id);
  // The source is about to be stopped: it is not asked to resume.
  void commit();

 private:
  void resume_as_source();
  // The tier's folder as the workload reaches it (see above).
  std::filesystem::path reachable(const std::filesystem::path& tier_dir);

  pid_t pid_;
  std::chrono::milliseconds timeout_;
  bool in_container_;
  Reporter& reporter_;
  std::filesystem::path control_dir_;
  std::optional<container::MountInside> tier_mount_;  // outlives the resume in the destructor
  std::optional<Handshake> handshake_;
  std::string artifact_id_;       // the resume context's: "" when no artifact was made
  std::string tier_path_;         // the folder as the workload reaches it
  nlohmann::json tier_dir_ = "";  // the resume context's: "" when the tier drained nothing
  bool paused_ = false;
  bool done_ = false;
};

}  // namespace gpusnap::engine
