// The check of the artifact before a copy runs (src/engine/restore/artifact_check.h).
#include "engine/restore/artifact_check.h"

#include "gpusnap/error.h"

namespace gpusnap::engine {

ArtifactCheck::~ArtifactCheck() {
  if (running_.valid()) running_.wait();
}

void ArtifactCheck::run(const Artifact& artifact, Reporter& reporter) {
  require_intact(artifact.verify(VerifyOptions{0, &reporter}), artifact.root());
}

void ArtifactCheck::start(const Artifact& artifact, std::set<std::string> deferred) {
  deferred_ = std::move(deferred);
  running_ = std::async(std::launch::async, [&artifact, this] {
    VerifyScope scope;
    scope.deferred = deferred_;
    return artifact.verify({}, scope);
  });
}

void ArtifactCheck::await(const Artifact& artifact) {
  require_intact(running_.get(), artifact.root());
}

void ArtifactCheck::require_intact(const std::vector<VerifyProblem>& problems,
                                   const std::filesystem::path& artifact) {
  if (problems.empty()) return;
  std::string what = problems[0].path + ": " + problems[0].problem;
  if (problems.size() > 1) what += " (and " + std::to_string(problems.size() - 1) + " more)";
  throw Error(ErrorKind::kBadArtifact, "artifact " + artifact.string() + " is corrupt: " + what,
              "copy it again or take a new checkpoint (--no-verify skips this check)");
}

}  // namespace gpusnap::engine
