// What gpusnap can see before it freezes anything and knows CRIU cannot capture. Refusing here
// costs the workload nothing; failing inside CRIU's dump costs a freeze and a thaw.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/proc.h"

namespace gpusnap::engine {

// Throws Error(kNotCapturable) naming the process, the resource and the fix.
void refuse_uncapturable(const std::vector<proc::Process>& tree);
// Whether any process of the tree has a terminal on its standard descriptors (a shell job).
bool uses_terminal(const std::vector<proc::Process>& tree);
// Refuses CUDA processes that talk to each other through NCCL transports the driver cannot
// checkpoint (peer-to-peer, shared memory, NVLink SHARP, cuMem handles), naming the settings.
void refuse_unsafe_nccl(const std::vector<proc::Process>& tree, const std::vector<pid_t>& cuda);
// Refuses a CUDA process with JAX/XLA loaded (its libraries in /proc/PID/maps) whose environment
// keeps XLA's preallocation on, or picks an allocator under which the driver's checkpoint kills
// it too, naming the setting that works. Only the environment the process started with is seen.
void refuse_xla_preallocation(const std::vector<proc::Process>& tree,
                              const std::vector<pid_t>& cuda);
// "KEY=VALUE" settings that keep frameworks capturable, for the workloads gpusnap starts (`run`,
// `init`): each only where gpusnap's own environment does not set the variable, so a user's
// choice stands.
std::vector<std::string> capturable_environment();
// Refuses a root that is gpusnap itself, one of its ancestors, the host's init or a kernel
// thread.
void refuse_bad_root(pid_t root);
// Whether pid is a kernel thread (PF_KTHREAD): nothing CRIU can dump.
bool is_kernel_thread(pid_t pid);

// The host memory and store space a capture needs, worked out before anything is frozen, against
// what there is. Without a check the capture of a workload larger than the host allows runs into
// the OOM killer or a full store half-way, after the workload was locked and copied.
struct CaptureRoom {
  uint64_t gpu_bytes = 0;  // GPU memory of the CUDA processes, from NVML
  // Of that, the GPU memory of processes whose driver's checkpoint fills anonymous memory (no
  // libgpusnap-preload.so, or it cannot write straight into the artifact): it is held twice,
  // once in the process and once in the artifact.
  uint64_t copied_gpu_bytes = 0;
  uint64_t cpu_bytes = 0;         // resident memory of the tree: CRIU's pages, at most
  bool store_in_ram = false;      // the artifact's file system is a tmpfs or ramfs
  uint64_t memory_available = 0;  // MemAvailable
  uint64_t store_free = 0;        // free space of the artifact's file system, for gpusnap
  std::filesystem::path store;    // where the artifact goes

  uint64_t store_needed() const { return gpu_bytes + cpu_bytes; }
  // What a store in RAM holds is host memory that cannot be reclaimed.
  uint64_t memory_needed() const { return copied_gpu_bytes + (store_in_ram ? store_needed() : 0); }
};

// MemAvailable from the text of /proc/meminfo, in bytes; 0 when absent.
uint64_t memory_available(const std::string& meminfo);
// Fills in store_in_ram, store_free and memory_available for an artifact written in `store`.
void measure_host(CaptureRoom& room, const std::filesystem::path& store);
// Throws Error(kEnvironment) naming the numbers when the capture does not fit.
void refuse_without_room(const CaptureRoom& room);

}  // namespace gpusnap::engine
