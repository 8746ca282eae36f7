// The memory tier of a restore (src/engine/restore/tier_fill.h).
#include "engine/restore/tier_fill.h"

#include <chrono>

#include "gpusnap/error.h"

namespace gpusnap::engine {

void TierFill::start_prefills(const std::filesystem::path& artifact, const Manifest& manifest,
                              const std::map<std::string, std::string>& gpu_map,
                              const RestoreOptions& options, ArrivingArtifact* arriving) {
  if (arriving != nullptr && options.verify) checked_by_tier_ = drain_files(manifest);
  try {
    prefills_.emplace(artifact, gpu_map, options.replicas, options.run_dir,
                      options.verify ? manifest.chunk_bytes : 0, arriving != nullptr);
    if (arriving != nullptr) arriving->watch(prefills_->arrival_feed());
  } catch (const Error& e) {
    // Only slower without it: each copy then fills its tier itself.
    reporter_.note(std::string("tier prefill not started: ") + e.what());
    return;
  }
  checked_by_tier_.merge(prefills_->files_read(manifest));
}

std::vector<VerifyProblem> TierFill::verify(const Artifact& artifact) {
  if (!prefills_) {
    VerifyScope scope;
    scope.only = checked_by_tier_;
    return artifact.verify({}, scope);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  return verify_prefilled(artifact, *prefills_, checked_by_tier_, deadline);
}

nlohmann::json TierFill::prefill_dir(int copy) const {
  return prefills_ ? prefills_->context_dir(copy) : nlohmann::json(std::string());
}

std::vector<std::string> TierFill::finish() { return prefills_->finish(); }

namespace {

// What a folder that cannot be mounted into a placeholder becomes. The tier's keeps the host's
// path, which the copy reaches when the placeholder mounts the artifact's volume at the same
// path, and otherwise refuses to fill (gpusnap then kills the copy: never a copy with wrong
// memory); the prefill's is left out, and the copy fills by itself.
enum class Unmounted { kKeepHostPath, kLeaveOut };

// Mounts the host folder `dir` (when not "") at NAME in the placeholder's handshake directory
// and points `dir` there; where that cannot be done, a note, and `otherwise`.
void mount_for_placeholder(pid_t into, const Manifest& manifest, const char* name,
                           nlohmann::json& dir, std::optional<container::MountInside>& mount,
                           Unmounted otherwise, Reporter& reporter) {
  const auto& host = dir.get_ref<const std::string&>();
  if (host.empty()) return;
  try {
    mount.emplace(into, host, std::filesystem::path(manifest.control_dir) / name, true);
    dir = mount->path().string();
  } catch (const Error& e) {
    reporter.note(std::string("memory tier: ") + e.what());
    if (otherwise == Unmounted::kLeaveOut) dir = std::string();
  }
}

}  // namespace

TierResumeFolders::TierResumeFolders(const TierFill& tier, const std::filesystem::path& artifact,
                                     const Manifest& manifest, int copies, pid_t into,
                                     Reporter& reporter)
    : tier_dir(artifact_tier_dir(artifact, manifest)) {
  // Each copy's memory tier fills from the artifact itself, or takes over what its prefill
  // filled.
  for (int i = 0; i < copies; ++i) prefill_dirs.push_back(tier.prefill_dir(i));
  if (into == 0) return;
  mount_for_placeholder(into, manifest, kTierMountName, tier_dir, tier_mount_,
                        Unmounted::kKeepHostPath, reporter);
  mount_for_placeholder(into, manifest, kPrefillMountName, prefill_dirs[0], prefill_mount_,
                        Unmounted::kLeaveOut, reporter);
}

}  // namespace gpusnap::engine
