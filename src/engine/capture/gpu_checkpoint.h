// The GPU state of a capture, for engine/checkpoint.cc, on top of engine/gpu_state.h: the
// driver's facts of the CUDA processes (gpu-facts), every process locked (gpu-lock) and then
// checkpointed (gpu-checkpoint), its GPU state put back with --leave-running (gpu-resume), and
// at settle the driver's word that each is where the capture left it.
//
// Rollback: destroying it before commit() or resume() returns every process to RUNNING
// (GpuCapture).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <vector>

#include "engine/gpu_state.h"
#include "engine/tier_files.h"
#include "gpu/driver.h"
#include "gpusnap/artifact.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/phases.h"

namespace gpusnap::engine {

class GpuCheckpoint {
 public:
  // `cuda`: the tree's CUDA processes (engine::cuda_processes); none: nothing to do.
  GpuCheckpoint(gpu::Driver& driver, std::vector<pid_t> cuda, const CheckpointOptions& options,
                Reporter& reporter)
      : driver_(driver), cuda_(std::move(cuda)), options_(options), reporter_(reporter) {}
  GpuCheckpoint(const GpuCheckpoint&) = delete;
  GpuCheckpoint& operator=(const GpuCheckpoint&) = delete;

  bool any() const { return !cuda_.empty(); }
  const std::vector<pid_t>& pids() const { return cuda_; }
  // Phase gpu-facts: the manifest's GPU section (driver, GPUs, each process's GPU bytes, the
  // memory its tier drained: `tier`). Throws kEnvironment when the driver cannot be loaded.
  void describe(Manifest& manifest, const TierContents& tier);
  // Phase gpu-lock: every CUDA process locked, all before any is checkpointed.
  void lock();
  // Phase gpu-checkpoint: the driver moves each process's GPU memory into its host memory.
  void checkpoint();
  // When the driver's checkpoint returned: from then on a process may notice its GPU memory
  // gone, and the settle moment counts from there.
  std::chrono::steady_clock::time_point checkpointed() const { return checkpointed_; }
  // Phase gpu-resume (--leave-running): the source's GPU state goes back, unlocked.
  void resume() { capture_->resume_all(); }
  // At settle: throws kGpu when the driver reports a process's GPU state elsewhere than the
  // capture left it (running with --leave-running, else checkpointed): nothing is committed.
  void require_settled() const;
  // The source is about to be stopped: nothing to undo.
  void commit();
  // The processes the rollback killed because the driver marked them FAILED.
  std::vector<pid_t> killed() const;

 private:
  gpu::Driver& driver_;
  std::vector<pid_t> cuda_;
  const CheckpointOptions& options_;
  Reporter& reporter_;
  std::optional<GpuCapture> capture_;
  std::chrono::steady_clock::time_point checkpointed_ = std::chrono::steady_clock::now();
};

}  // namespace gpusnap::engine
