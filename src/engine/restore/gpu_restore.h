// The GPU state of a restore (engine/restore.cc), on top of engine/gpu_state.h: checked against
// this host and mapped onto its GPUs at open; CUDA initialised in gpusnap's own process, which
// the driver's restore needs (cuInit: ~0.2 s on an H200), started before CRIU and awaited after
// it (gpu-init); the driver's restore of every CUDA process of every copy once they are located
// (gpu-restore); the GPU map in each copy's resume context.
//
// Destroying it waits for the initialisation it started: that uses the driver.
#pragma once

#include <future>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/gpu_state.h"
#include "engine/restore/copies.h"
#include "gpu/driver.h"
#include "gpusnap/artifact.h"
#include "gpusnap/restore.h"

namespace gpusnap::engine {

class GpuRestore {
 public:
  explicit GpuRestore(gpu::Driver& driver) : driver_(driver) {}
  ~GpuRestore();
  GpuRestore(const GpuRestore&) = delete;
  GpuRestore& operator=(const GpuRestore&) = delete;

  // At open: refuses, before anything starts, an artifact whose GPU state this host cannot take,
  // and maps its GPUs (plan_gpu_restore). Returns the decisions worth telling the user.
  std::vector<std::string> open(const Manifest& manifest, const RestoreOptions& options);
  // Before CRIU: CUDA's initialisation starts, in the background.
  void start_init();
  // Phase gpu-init: waits for it; throws what it threw.
  void await_init();
  // Phase gpu-restore: the driver puts each CUDA process's GPU state back, onto the mapped GPUs,
  // and unlocks it; all processes of all copies in parallel.
  void restore(const Copies& copies, const Manifest& manifest);
  // Old GPU UUID -> new, for the tier's prefills; empty where every GPU is the one it was
  // taken on.
  std::map<std::string, std::string> gpu_map() const;
  // The same, as the resume context's gpu_map member.
  nlohmann::json context_map() const;

 private:
  gpu::Driver& driver_;
  GpuPlan plan_;
  std::future<void> ready_;
};

}  // namespace gpusnap::engine
