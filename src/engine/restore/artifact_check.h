// The check of every byte of the artifact against its manifest before a copy runs (skipped with
// --no-verify), for engine/restore.cc. A snapshot without GPU state is checked before CRIU's
// restore, which lets the copies run (verify); one with GPU state beside it, and the check must
// pass before gpu-restore (start(), then verify: await()). The tier files the prefills read are
// left to their sums (engine/restore/tier_fill.h): not read a second time beside CRIU's restore
// (0.13 s of a 16 GiB restore on the H200).
//
// Destroying it waits for a check still running: it reads the artifact.
#pragma once

#include <filesystem>
#include <future>
#include <set>
#include <string>
#include <vector>

#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"

namespace gpusnap::engine {

class ArtifactCheck {
 public:
  ArtifactCheck() = default;
  ~ArtifactCheck();
  ArtifactCheck(const ArtifactCheck&) = delete;
  ArtifactCheck& operator=(const ArtifactCheck&) = delete;

  // Phase verify, in the foreground: every file, with progress to `reporter`.
  static void run(const Artifact& artifact, Reporter& reporter);
  // The check starts in the background, leaving out `deferred` (paths in the artifact).
  // `artifact` must outlive it.
  void start(const Artifact& artifact, std::set<std::string> deferred);
  // Phase verify, of a check start()ed: waits for it.
  void await(const Artifact& artifact);
  // Throws Error(kBadArtifact) naming the first problem and how many more, if any.
  static void require_intact(const std::vector<VerifyProblem>& problems,
                             const std::filesystem::path& artifact);

 private:
  std::set<std::string> deferred_;
  std::future<std::vector<VerifyProblem>> running_;
};

}  // namespace gpusnap::engine
