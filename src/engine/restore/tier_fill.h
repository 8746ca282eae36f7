// The memory tier of a restore (engine/restore.cc), on top of engine/tier_files.h: the tiers' fill
// done ahead (TierPrefills) started before CRIU, beside CRIU's and the driver's restore; the check
// of the tier files the prefills read, by the sums they computed as they read them (verify-tier);
// the tier's folders in each copy's resume context, mounted into a placeholder for the time of
// the resume; each prefill's report after the resume (tier-prefills).
//
// Destroying it stops any prefill still running.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "container/mount.h"
#include "engine/tier_files.h"
#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"
#include "gpusnap/restore.h"

namespace gpusnap::engine {

class TierFill {
 public:
  explicit TierFill(Reporter& reporter) : reporter_(reporter) {}
  TierFill(const TierFill&) = delete;
  TierFill& operator=(const TierFill&) = delete;

  // Before CRIU: starts the prefills of the copies' tiers from `artifact`, onto the GPUs of
  // `gpu_map` (old UUID -> new). Every file is there, or `arriving` (not null) still writes the
  // drain files into `artifact`, its staging directory: the prefills then fill as they arrive.
  // One that cannot start is a note: the copies then fill their tiers themselves, only slower.
  void start_prefills(const std::filesystem::path& artifact, const Manifest& manifest,
                      const std::map<std::string, std::string>& gpu_map,
                      const RestoreOptions& options, ArrivingArtifact* arriving = nullptr);
  bool started() const { return prefills_.has_value(); }
  // The tier files checked at verify-tier, which the artifact's check leaves out: those the
  // prefills read (TierPrefills::files_read) and, for an artifact still arriving, every drain
  // file (they arrive after that check starts). Empty where no prefill was asked for.
  const std::set<std::string>& checked_by_tier() const { return checked_by_tier_; }
  // Phase verify-tier: those files against the manifest, the prefilled ones by the prefills'
  // sums (waiting for them as long as a prefill may take to fill, its own timeout: the copies
  // wait for it anyway), the others read now. Returns the problems, as Artifact::verify names
  // them.
  std::vector<VerifyProblem> verify(const Artifact& artifact);

  // The resume context's tier_prefill_dir for copy `copy`: "" where no prefill runs for it.
  nlohmann::json prefill_dir(int copy) const;

  // Phase tier-prefills: each prefill's report, what it filled and whether its copy took the
  // memory; one line each.
  std::vector<std::string> finish();

 private:
  Reporter& reporter_;
  std::optional<TierPrefills> prefills_;
  std::set<std::string> checked_by_tier_;
};

// What the resume context names for the tier: the artifact's tier folder (every copy) and each
// copy's prefill folder ("" where none). For a copy in a placeholder, which sees the
// placeholder's mounts only, both are mounted into its handshake directory, read-only, for as
// long as this object lives; where one cannot be, a note says why.
class TierResumeFolders {
 public:
  TierResumeFolders(const TierFill& tier, const std::filesystem::path& artifact,
                    const Manifest& manifest, int copies, pid_t into, Reporter& reporter);
  TierResumeFolders(const TierResumeFolders&) = delete;
  TierResumeFolders& operator=(const TierResumeFolders&) = delete;

  nlohmann::json tier_dir;
  std::vector<nlohmann::json> prefill_dirs;  // one per copy

 private:
  std::optional<container::MountInside> tier_mount_, prefill_mount_;
};

}  // namespace gpusnap::engine
