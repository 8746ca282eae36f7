// The GPU state of a capture (src/engine/capture/gpu_checkpoint.h).
#include "engine/capture/gpu_checkpoint.h"

#include <string>

#include "gpusnap/error.h"

namespace gpusnap::engine {

void GpuCheckpoint::describe(Manifest& manifest, const TierContents& tier) {
  if (!driver_.available()) {
    throw Error(ErrorKind::kEnvironment,
                "process " + std::to_string(cuda_.front()) +
                    " uses the GPU, but the NVIDIA driver cannot be loaded: " + driver_.reason(),
                "run gpusnap where libcuda.so.1 and libnvidia-ml.so.1 can be loaded");
  }
  manifest.gpu = describe_gpu_state(driver_, cuda_);
  add_tier_memory(manifest.gpu, options_.pid, tier);
  for (const auto& p : manifest.gpu->processes) {
    for (auto& rec : manifest.processes) {
      if (rec.pid == p.pid) rec.gpu_bytes = p.bytes;
    }
  }
}

void GpuCheckpoint::lock() {
  capture_.emplace(driver_, cuda_, options_.gpu_lock_timeout, options_.run_dir, reporter_);
  capture_->lock_all();
}

void GpuCheckpoint::checkpoint() {
  capture_->checkpoint_all();
  checkpointed_ = std::chrono::steady_clock::now();
}

void GpuCheckpoint::require_settled() const {
  auto expected =
      options_.leave_running ? gpu::ProcessState::kRunning : gpu::ProcessState::kCheckpointed;
  for (pid_t pid : cuda_) {
    auto state = driver_.state(pid);
    if (state == expected) continue;
    throw Error(ErrorKind::kGpu,
                "the driver reports process " + std::to_string(pid) + "'s GPU state " +
                    gpu::state_name(state) + " after the dump, not " + gpu::state_name(expected) +
                    ": it cannot be carried, so nothing was committed",
                "gpusnap left the workload as it was, not stopped; see the driver's messages "
                "in the kernel log (dmesg)");
  }
}

void GpuCheckpoint::commit() {
  if (capture_) capture_->commit();
}

std::vector<pid_t> GpuCheckpoint::killed() const {
  return capture_ ? capture_->killed() : std::vector<pid_t>();
}

}  // namespace gpusnap::engine
