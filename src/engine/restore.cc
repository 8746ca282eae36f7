// The restore flow, as named, timed phases. `open` reads the manifest; which phases follow, in
// which order, is computed from it and from what was asked (engine/restore/plan.h, which gives
// the reasons and is tested for every case), then run in this order:
//
//   without GPU state:  open, placeholder, await-artifact, verify, criu-restore, locate, resume,
//                       release
//   with GPU state:     open, placeholder, await-criu-images, criu-restore, locate,
//                       await-host-images, gpu-init, verify, gpu-restore, await-artifact,
//                       verify-tier, resume, tier-prefills, release
//
//   open          read the manifest; format, host and GPU compatibility checks, the GPU map
//   placeholder   (--into-container) the target is a waiting placeholder with the captured rootfs
//   await-artifact  (an artifact still arriving: a pull overlapping the restore) every byte; the
//                 artifact takes its final name
//   await-criu-images  (arriving) CRIU's images, while the GPU memory still arrives
//   await-host-images  (arriving) every file but the tier's drain files, which keep arriving
//                 (and filling the GPU through the tier's prefills) until await-artifact
//   verify        every byte against the manifest (skipped with --no-verify); with GPU state
//                 started before CRIU (after await-host-images, when arriving) and awaited
//                 here; the tier's files the prefills read, or that arrive later, are left to
//                 verify-tier
//   criu-restore  each copy's init, in its fresh namespaces, runs `criu restore`; all at once
//   locate        the restored roots' host pids
//   gpu-init      CUDA initialised in gpusnap, started after open, beside CRIU
//   gpu-restore   the driver puts each CUDA process's GPU state back, onto the mapped GPUs, and
//                 unlocks it; all processes of all copies in parallel
//   verify-tier   (verifying, where the tier's prefills started before CRIU read tier files,
//                 or the tier's drain files arrived after verify) those files: by the sums the
//                 prefills computed as they read them, or read now
//   resume        (the handshake) every copy resumes with its own context, all at once
//   tier-prefills (where the prefills started: not for an artifact still arriving) each
//                 prefill's report
//   release       the copies are handed over and outlive gpusnap
//
// Each feature is one object acting at these points (engine/restore/): the arriving artifact, the
// GPU state, the memory tier, the artifact's check, the copies. Until release, every copy's init
// dies with the copies' object (and with gpusnap), so a failure or a kill at any point leaves no
// process and no namespace behind; the other objects' destructors wait for or stop what they
// started in the background.
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "container/runc.h"
#include "criu/criu.h"
#include "criu/kernel_cache.h"
#include "engine/gpu_state.h"
#include "engine/restore/arrival.h"
#include "engine/restore/artifact_check.h"
#include "engine/restore/copies.h"
#include "engine/restore/gpu_restore.h"
#include "engine/restore/plan.h"
#include "engine/restore/tier_fill.h"
#include "gpu/driver.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"

namespace gpusnap {

namespace {

using engine::RestoreStep;

class Restore {
 public:
  Restore(RestoreOptions options, Reporter& reporter)
      : options_(std::move(options)), phases_(reporter) {}

  RestoreResult run() {
    check_options();
    const auto criu = criu::locate(options_.criu_path);
    criu::keep_kernel_cache(criu);  // CRIU starts 0.06-0.08 s sooner with it
    gpu::Driver& driver = gpu::given_or_nvidia(options_.driver, owned_driver_);
    note(engine::recover_abandoned(driver, options_.run_dir));
    // Declared in the order they are undone in reverse: the copies end first.
    engine::Arrival arrival(options_.arriving);
    engine::GpuRestore gpu(driver);
    std::optional<Artifact> artifact;
    std::vector<std::string> gpu_notes;
    phases_.run("open", [&] {
      artifact.emplace(Artifact::open(arrival.open_path(options_.artifact)));
      // A snapshot reached through store/reach.h was checked there, before its first chunk.
      if (!options_.host_checked) {
        check_host_compatible(artifact->manifest(), HostFacts::probe(criu.version));
      }
      gpu_notes = gpu.open(artifact->manifest(), options_);
    });
    note(gpu_notes);
    engine::TierFill tier(phases_.reporter());
    engine::ArtifactCheck check;
    engine::Copies copies;
    pid_t into = 0;
    RestoreResult result;
    for (const RestoreStep step : engine::plan_restore(artifact->manifest(), options_)) {
      const auto phase = [&](auto&& fn) { return phases_.run(engine::phase_name(step), fn); };
      switch (step) {
        case RestoreStep::kStartGpuInit: gpu.start_init(); break;
        case RestoreStep::kPlaceholder:
          phase([&] { into = placeholder(artifact->manifest()); });
          break;
        case RestoreStep::kAwaitArtifact:
          phase([&] { artifact.emplace(Artifact::open(options_.artifact = arrival.await_all())); });
          break;
        case RestoreStep::kStartTierPrefills:
          tier.start_prefills(arrival.open_path(options_.artifact), artifact->manifest(),
                              gpu.gpu_map(), options_, arrival.still_arriving());
          break;
        case RestoreStep::kVerify:
          phase([&] { engine::ArtifactCheck::run(*artifact, phases_.reporter()); });
          break;
        case RestoreStep::kStartVerify: check.start(*artifact, tier.checked_by_tier()); break;
        case RestoreStep::kAwaitCriuImages: phase([&] { arrival.await_criu_images(); }); break;
        case RestoreStep::kAwaitHostImages: phase([&] { arrival.await_host_images(); }); break;
        case RestoreStep::kCriuRestore:
          phase([&] {
            copies.restore(artifact->manifest(), artifact->criu_dir(), criu, options_, into);
          });
          break;
        case RestoreStep::kLocate: phase([&] { copies.locate(); }); break;
        case RestoreStep::kGpuInit: phase([&] { gpu.await_init(); }); break;
        case RestoreStep::kAwaitVerify: phase([&] { check.await(*artifact); }); break;
        case RestoreStep::kGpuRestore:
          phase([&] { gpu.restore(copies, artifact->manifest()); });
          break;
        case RestoreStep::kVerifyTier:
          if (tier.checked_by_tier().empty()) break;
          phase([&] { check.require_intact(tier.verify(*artifact), artifact->root()); });
          break;
        case RestoreStep::kResume:
          phase([&] { resume(copies, artifact->manifest(), gpu, tier, into); });
          result.handshake = true;
          break;
        case RestoreStep::kTierPrefills:
          if (tier.started()) note(phase([&] { return tier.finish(); }));
          break;
        case RestoreStep::kRelease: result.copies = phase([&] { return copies.release(); }); break;
      }
    }
    result.manifest = artifact->manifest();
    result.phases = phases_.timings();
    return result;
  }

 private:
  void check_options() {
    // CRIU resolves relative paths from its own working directory, not ours.
    options_.run_dir = std::filesystem::absolute(options_.run_dir);
    if (options_.replicas < 1) {
      throw Error(ErrorKind::kUsage, "--replicas must be at least 1");
    }
    if (options_.into_container && (options_.replicas != 1 || !options_.publish.empty())) {
      throw Error(ErrorKind::kUsage,
                  "--into-container restores one copy into the placeholder's own namespaces",
                  "drop --replicas and --publish; reach the copy as the container is reached");
    }
  }

  // The placeholder container's PID 1, which the copy goes into.
  pid_t placeholder(const Manifest& manifest) {
    return container::placeholder_target(*options_.into_container, manifest).state.pid;
  }

  // Every copy is asked to resume with its own context, all at once; each must say RESUMED.
  // `into`: the placeholder's PID 1 for a copy restored into one, else 0.
  void resume(engine::Copies& copies, const Manifest& manifest, const engine::GpuRestore& gpu,
              const engine::TierFill& tier, pid_t into) {
    const int n = static_cast<int>(copies.size());
    const engine::TierResumeFolders folders(tier, options_.artifact, manifest, n, into,
                                            phases_.reporter());
    std::vector<nlohmann::json> contexts;
    for (int i = 0; i < n; ++i) {
      contexts.push_back({{"restored", true},
                          {"copy", i},
                          {"copies", n},
                          {"artifact_id", manifest.id},
                          {"gpu_map", gpu.context_map()},
                          {"settings", options_.settings},
                          {"tier_dir", folders.tier_dir},
                          {"tier_prefill_dir", folders.prefill_dirs[i]}});
    }
    copies.resume(manifest, contexts, options_.handshake_timeout);
  }

  void note(const std::vector<std::string>& lines) {
    for (const auto& line : lines) phases_.reporter().note(line);
  }

  RestoreOptions options_;
  Phases phases_;
  std::unique_ptr<gpu::Driver> owned_driver_;  // outlives the features, which use it
};

}  // namespace

RestoreResult restore(const RestoreOptions& options, Reporter& reporter) {
  return Restore(options, reporter).run();
}

}  // namespace gpusnap
