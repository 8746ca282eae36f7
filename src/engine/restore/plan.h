// The restore's order as a value: which steps run, in which order, for what the artifact holds
// and what was asked. Computed once the manifest is read (the `open` phase), before anything
// else starts; engine/restore.cc runs it step by step, and tests/engine/restore/ checks it for
// every combination of its flags.
//
// The order's reasons, each an invariant the tests hold it to:
// - Without GPU state CRIU's restore lets the copies run: every byte is there (await-artifact)
//   and checked (verify) before criu-restore.
// - With GPU state nothing of a copy serves before gpu-restore (its CUDA processes stay
//   checkpointed, the copy unreleased): the bytes are checked beside CRIU's restore and the
//   check must pass before gpu-restore; an artifact still arriving gives CRIU its images first
//   (await-criu-images), the driver its host images once the copies are located
//   (await-host-images), and the tier's drain files, which only the tier's fill reads, after
//   gpu-restore (await-artifact): the driver's restore runs while the bulk still arrives, and a
//   copy that resumes reads no tier byte before verify-tier checked it.
// - CUDA is initialised in gpusnap (gpu-init) beside CRIU's restore and awaited before
//   gpu-restore.
// - The tier's fill done ahead (the prefills) starts before CRIU, with GPU state and a workload
//   that resumes; for an artifact still arriving once CRIU's images (and with them the tier's
//   layouts) are there, the prefills then taking the drain files' bytes as they arrive. The
//   tier files the prefills read are checked by the sums they compute (verify-tier, after
//   gpu-restore, before the resume), not a second time beside CRIU's restore.
// - The resume (the handshake) comes after every check; release is last.
#pragma once

#include <string_view>
#include <vector>

#include "gpusnap/artifact.h"
#include "gpusnap/restore.h"

namespace gpusnap::engine {

enum class RestoreStep {
  kStartGpuInit,       // CUDA's initialisation in gpusnap starts, in the background
  kPlaceholder,        // "placeholder": the waiting container the copy goes into
  kAwaitArtifact,      // "await-artifact": every byte of an arriving artifact
  kStartTierPrefills,  // the tier's fill done ahead starts, in the background
  kVerify,             // "verify": every byte, checked now
  kStartVerify,        // the same check starts in the background...
  kAwaitCriuImages,    // "await-criu-images": CRIU's images of an arriving artifact
  kAwaitHostImages,    // "await-host-images": all of it but the tier's drain files
  kCriuRestore,        // "criu-restore"
  kLocate,             // "locate"
  kGpuInit,            // "gpu-init": CUDA's initialisation awaited
  kAwaitVerify,        // "verify": ...and its result awaited
  kGpuRestore,         // "gpu-restore"
  kVerifyTier,         // "verify-tier": the prefills' sums of the tier files they read
  kResume,             // "resume": the handshake, every copy at once
  kTierPrefills,       // "tier-prefills": each prefill's report
  kRelease,            // "release"
};

// The name of the timed phase a step runs as; "" for a step that only starts work in the
// background (its wait is a step of its own).
std::string_view phase_name(RestoreStep step);

// What the order depends on.
struct RestoreFlags {
  bool gpu_state = false;       // the artifact holds GPU state
  bool handshake = false;       // its workload speaks the handshake (it has a control directory)
  bool arriving = false;        // the artifact is still arriving (RestoreOptions::arriving)
  bool verify = true;           // RestoreOptions::verify
  bool into_container = false;  // RestoreOptions::into_container
};

RestoreFlags restore_flags(const Manifest& manifest, const RestoreOptions& options);

// The steps after `open`, in order. Two steps run only where their feature has work when they
// come: verify-tier where the prefills read tier files, tier-prefills where the prefills started
// (a prefill that cannot start only makes the copies fill their tiers themselves).
std::vector<RestoreStep> plan_restore(const RestoreFlags& flags);
inline std::vector<RestoreStep> plan_restore(const Manifest& manifest,
                                             const RestoreOptions& options) {
  return plan_restore(restore_flags(manifest, options));
}

}  // namespace gpusnap::engine
