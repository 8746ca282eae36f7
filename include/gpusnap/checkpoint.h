// Checkpoint: capture a running process tree (and, with a GPU driver, its GPU state) into an
// artifact. Entry point: gpusnap::checkpoint(). The flow, phase by phase, is in docs/design.md.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "gpusnap/artifact.h"
#include "gpusnap/container.h"
#include "gpusnap/phases.h"

namespace gpusnap {

namespace gpu {
class Driver;
}

struct CheckpointOptions {
  pid_t pid = 0;  // root of the tree to capture
  // Or the workload of this running container, whose PID 1 is `gpusnap init -- CMD`: CMD's
  // tree is captured, with CRIU inside the container's namespaces (then pid is ignored).
  std::optional<ContainerRef> container;
  std::filesystem::path output;  // the artifact directory to create (must not exist)
  bool leave_running = false;    // keep the source running after the capture
  std::string criu_path;         // empty: locate CRIU (see criu::locate)
  uint64_t ghost_limit = 256ull << 20;
  // GPU: the driver seam; nullptr means "the real NVIDIA driver, if any".
  gpu::Driver* driver = nullptr;
  // The gpusnap binary, which also runs gpusnap's helper processes (the dump guardian, a
  // copy's namespace init). Empty: this program (/proc/self/exe).
  std::string helper_binary;
  std::chrono::milliseconds gpu_lock_timeout{10000};
  std::filesystem::path run_dir = "/run/gpusnap";  // gpusnap's journal of work in flight
  // The workload handshake (docs/handshake.md): used when the workload has a control
  // directory (this one, or its GPUSNAP_CONTROL_DIR) and has said READY.
  std::filesystem::path control_dir;
  bool handshake = true;
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(60)};
  // Store the GPU memory that the driver's checkpoint leaves in host memory as host images
  // (many threads, mapped back on restore without a copy) rather than through CRIU's pages.
  bool host_images = true;
  // Where the workload runs with libgpusnap-preload.so: have the driver's checkpoint write the
  // GPU memory straight into the artifact's file (nothing to copy afterwards, and the host holds
  // it once, not twice). Off: the copy after the driver's call (docs/gpu-memory.md, "Host images").
  bool direct_host_images = true;
  int io_threads = 0;                  // 0: one per core, at least 4
  uint64_t host_image_file_bytes = 0;  // largest host image file; 0: one file per region
  // The artifact holds the workload's memory: root-only unless this group may read it.
  std::optional<gid_t> artifact_group;
};

struct CheckpointResult {
  std::filesystem::path artifact;
  Manifest manifest;
  std::vector<PhaseTiming> phases;
  bool handshake = false;  // the workload was paused (and, if left running, resumed)
};

// Captures the tree. On any failure nothing is visible at `output` and the source is running
// as before. Throws Error.
CheckpointResult checkpoint(const CheckpointOptions& options, Reporter& reporter);

}  // namespace gpusnap
