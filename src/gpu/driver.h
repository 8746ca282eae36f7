// The GPU driver seam. Everything gpusnap asks of the NVIDIA driver goes through this interface:
// the real implementation (cuda_driver.cc) reaches libcuda.so.1 and libnvidia-ml.so.1 with
// dlopen, so the same binary runs on a machine without a GPU; tests inject a fake that records
// every call and can fail any of them.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace gpusnap::gpu {

// The driver's per-process checkpoint states (CUprocessState).
enum class ProcessState { kRunning, kLocked, kCheckpointed, kFailed };
const char* state_name(ProcessState state);

struct GpuInfo {
  int index = -1;      // the driver's ordinal on this host
  std::string uuid;    // "GPU-xxxxxxxx-...", the stable identity used in GPU maps
  std::string name;    // model name, e.g. "NVIDIA H200"
  std::string bus_id;  // PCI bus id
  int cc_major = 0;    // compute capability
  int cc_minor = 0;
  uint64_t memory_total = 0;  // bytes
  uint64_t memory_free = 0;   // bytes, at the time of the query
};

struct DriverFacts {
  std::string driver_version;   // e.g. "580.159.04" (NVML)
  int cuda_driver_version = 0;  // e.g. 13000 (cuDriverGetVersion)
  std::vector<GpuInfo> gpus;
};

// Per-process GPU usage as the driver reports it.
struct ProcessGpuUsage {
  pid_t host_pid = 0;
  std::string gpu_uuid;
  uint64_t bytes = 0;
};

// One pairing for a restore onto other GPUs: the GPU the state was taken on, and where it goes.
struct GpuPair {
  std::string old_uuid;
  std::string new_uuid;
};

class Driver {
 public:
  virtual ~Driver() = default;

  // Whether the NVIDIA driver could be loaded; when false, reason() says why in one line.
  virtual bool available() const = 0;
  virtual std::string reason() const = 0;

  // Driver version and every GPU on this host. Throws Error(kGpu) on driver failure.
  virtual DriverFacts facts() = 0;
  // GPU memory held by each process on each GPU (NVML's compute processes).
  virtual std::vector<ProcessGpuUsage> usage() = 0;

  // Whether the process holds CUDA state the driver must checkpoint (a CUDA context). Cheap,
  // and usable on a host without the driver (it then answers false).
  virtual bool uses_gpu(pid_t pid) = 0;

  // The checkpoint API, by HOST pid. Each throws Error(kGpu) naming the call, the pid and the
  // driver's error string. lock() with a timeout leaves the process RUNNING when it expires.
  virtual ProcessState state(pid_t pid) = 0;
  virtual void lock(pid_t pid, std::chrono::milliseconds timeout) = 0;
  virtual void checkpoint(pid_t pid) = 0;
  // Readies this process for restore() (the real driver needs CUDA initialised in the
  // caller, ~0.2 s), so that a caller can do it beside other work; restore() does it anyway.
  virtual void prepare_restore() {}
  virtual void restore(pid_t pid, const std::vector<GpuPair>& pairs) = 0;
  virtual void unlock(pid_t pid) = 0;
};

// The real driver, loaded with dlopen. Never throws: a host without the driver gets an object
// whose available() is false.
std::unique_ptr<Driver> open_nvidia_driver();

// The driver an operation uses: `given` when the caller passed one (a test's fake, an agent's
// own), else the real driver, opened into `owned`, which the operation keeps for its lifetime.
Driver& given_or_nvidia(Driver* given, std::unique_ptr<Driver>& owned);

}  // namespace gpusnap::gpu
