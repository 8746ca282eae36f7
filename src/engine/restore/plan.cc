// The restore's order (src/engine/restore/plan.h).
#include "engine/restore/plan.h"

namespace gpusnap::engine {

std::string_view phase_name(RestoreStep step) {
  switch (step) {
    case RestoreStep::kStartGpuInit: return "";
    case RestoreStep::kPlaceholder: return "placeholder";
    case RestoreStep::kAwaitArtifact: return "await-artifact";
    case RestoreStep::kStartTierPrefills: return "";
    case RestoreStep::kVerify: return "verify";
    case RestoreStep::kStartVerify: return "";
    case RestoreStep::kAwaitCriuImages: return "await-criu-images";
    case RestoreStep::kAwaitHostImages: return "await-host-images";
    case RestoreStep::kCriuRestore: return "criu-restore";
    case RestoreStep::kLocate: return "locate";
    case RestoreStep::kGpuInit: return "gpu-init";
    case RestoreStep::kAwaitVerify: return "verify";
    case RestoreStep::kGpuRestore: return "gpu-restore";
    case RestoreStep::kVerifyTier: return "verify-tier";
    case RestoreStep::kResume: return "resume";
    case RestoreStep::kTierPrefills: return "tier-prefills";
    case RestoreStep::kRelease: return "release";
  }
  return "";
}

RestoreFlags restore_flags(const Manifest& manifest, const RestoreOptions& options) {
  RestoreFlags f;
  f.gpu_state = manifest.gpu.has_value();
  f.handshake = !manifest.control_dir.empty();
  f.arriving = options.arriving != nullptr;
  f.verify = options.verify;
  f.into_container = options.into_container.has_value();
  return f;
}

std::vector<RestoreStep> plan_restore(const RestoreFlags& f) {
  using S = RestoreStep;
  std::vector<S> steps;
  auto add = [&](bool when, S step) {
    if (when) steps.push_back(step);
  };
  const bool gpu = f.gpu_state;
  // Every byte before CRIU (no GPU state), or CRIU's images first, the host images after locate
  // and the tier's drain files after gpu-restore.
  const bool await_first = f.arriving && !gpu;
  const bool await_late = f.arriving && gpu;
  const bool prefills = gpu && f.handshake;
  add(gpu, S::kStartGpuInit);
  add(f.into_container, S::kPlaceholder);
  add(await_first, S::kAwaitArtifact);
  add(prefills && !f.arriving, S::kStartTierPrefills);
  add(f.verify && !gpu, S::kVerify);
  add(f.verify && gpu && !f.arriving, S::kStartVerify);
  add(await_late, S::kAwaitCriuImages);
  // Arriving: once the tier's layouts are there (they come with CRIU's images); the prefills
  // then fill as the drain files arrive.
  add(prefills && f.arriving, S::kStartTierPrefills);
  add(true, S::kCriuRestore);
  add(true, S::kLocate);
  add(await_late, S::kAwaitHostImages);
  add(f.verify && await_late, S::kStartVerify);
  add(gpu, S::kGpuInit);
  add(f.verify && gpu, S::kAwaitVerify);
  add(gpu, S::kGpuRestore);
  add(await_late, S::kAwaitArtifact);
  add(f.verify && prefills, S::kVerifyTier);
  add(f.handshake, S::kResume);
  add(prefills, S::kTierPrefills);
  add(true, S::kRelease);
  return steps;
}

}  // namespace gpusnap::engine
