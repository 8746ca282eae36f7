// "Can this host restore it": the one check, from a snapshot's manifest alone, that every way
// to a restore runs once. store/reach.h runs it before the first chunk of a snapshot is fetched
// (or on a local artifact before the restore opens it); the restore runs it on open only for a
// caller that did not (RestoreOptions::host_checked).
#pragma once

#include <string>
#include <vector>

#include "engine/gpu_state.h"
#include "gpusnap/artifact.h"

namespace gpusnap::gpu {
class Driver;
}

namespace gpusnap::engine {

// Refuses a snapshot this host could not restore: another CPU architecture or page size, CPU
// instruction sets the source used that this host lacks, an older CRIU than `criu_version`
// (Error kIncompatible, check_host_compatible), and GPU state this host's GPUs cannot take for
// `replicas` copies under `gpu_map` (plan_gpu_restore's refusals). Returns the GPU plan.
GpuPlan check_restorable(const Manifest& manifest, const std::string& criu_version,
                         gpu::Driver& driver, const std::vector<std::string>& gpu_map,
                         int replicas);

}  // namespace gpusnap::engine
