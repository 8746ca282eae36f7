// The memory tier's driver seam: every CUDA driver call the tier makes (src/tier/memory_tier.h).
// The real implementation (cuda_tier_driver.cc) reaches libcuda.so.1 with dlopen inside the
// workload; the fake (fake_tier_driver.h) backs device memory with host memory so that the tier's
// bookkeeping, its drain and fill order and every failure path run on a machine without a GPU.
//
// Every call that can fail throws gpusnap::Error (kind kGpu) naming the call and the driver's
// error, except create(), whose out-of-memory answer is an expected outcome the allocator acts on.
// Calls that free something are noexcept: they run on rollback paths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace gpusnap::tier {

using DevicePtr = std::uint64_t;  // CUdeviceptr
using Handle = std::uint64_t;     // CUmemGenericAllocationHandle
using Stream = void*;             // CUstream, which is also what cudaStream_t points at

class TierDriver {
 public:
  virtual ~TierDriver() = default;

  // The size physical memory and address reservations are rounded to on `device` (2 MiB on
  // the H200).
  virtual std::size_t granularity(int device) = 0;
  // Address space only (cuMemAddressReserve); nothing is backed.
  virtual DevicePtr reserve(std::size_t size, std::size_t alignment) = 0;
  virtual void address_free(DevicePtr va, std::size_t size) noexcept = 0;
  // Physical memory on `device` (cuMemCreate). False when the device is out of memory.
  virtual bool create(int device, std::size_t size, Handle* handle) = 0;
  virtual void release(Handle handle) = 0;
  // Maps `handle` whole at `va` (cuMemMap), then makes it readable and writable from `device`
  // (cuMemSetAccess): both are needed before any access.
  virtual void map(DevicePtr va, std::size_t size, Handle handle) = 0;
  virtual void set_access(DevicePtr va, std::size_t size, int device) = 0;
  virtual void unmap(DevicePtr va, std::size_t size) = 0;

  // Makes `device`'s primary context (the one PyTorch and the CUDA runtime use) current in the
  // calling thread. Only for the tier's own threads, which start without one: changing the
  // current context of a workload's thread would change what its CUDA runtime calls use.
  virtual void use_device(int device) = 0;
  // Makes `device`'s primary context current in the calling thread until leave_device(), which
  // puts back what was current before (cuCtxPushCurrent, cuCtxPopCurrent): a drain, a fill or
  // an allocation runs in a workload's thread (the handshake's, a request loop's), which may
  // have no context current, and the driver's memory calls need one.
  virtual void enter_device(int device) = 0;
  virtual void leave_device() noexcept = 0;
  // Waits for all work on `device` (its primary context: cuCtxSynchronize), from any thread,
  // leaving the calling thread's current context as it was.
  virtual void synchronize(int device) = 0;
  // The per-thread stack size of `device`'s primary context (CU_LIMIT_STACK_SIZE: cuCtxGetLimit),
  // and setting it (cuCtxSetLimit, which waits for the device's work first), from any thread,
  // leaving its current context as it was. The driver backs that stack with local memory for
  // every thread the GPU can hold at once (264 MiB for 1 KiB on the H200) and grows it, never
  // shrinks it, when a kernel needs more: the size read is the one in use.
  virtual std::size_t stack_limit(int device) = 0;
  virtual void set_stack_limit(int device, std::size_t bytes) = 0;

  // Page-locked host memory usable from every context (cuMemHostAlloc, PORTABLE).
  virtual void* host_alloc(std::size_t size) = 0;
  virtual void host_free(void* p) noexcept = 0;
  // Page-locks memory the caller mapped, read-only and usable from every context
  // (cuMemHostRegister: PORTABLE | READ_ONLY), so that copies to the device read it in place:
  // a fill reads its files' page cache that way (tier/in_place.h). False where the driver
  // refuses (no read-only registration on this device, or these pages cannot be locked); the
  // caller then copies through its pinned buffers. host_unregister() takes `p` as registered.
  virtual bool host_register(const void* p, std::size_t size) = 0;
  virtual void host_unregister(const void* p) noexcept = 0;
  virtual Stream stream_create() = 0;
  virtual void stream_destroy(Stream stream) noexcept = 0;
  virtual void copy_to_host(void* dst, DevicePtr src, std::size_t size, Stream stream) = 0;
  virtual void copy_to_device(DevicePtr dst, const void* src, std::size_t size, Stream stream) = 0;
  virtual void stream_synchronize(Stream stream) = 0;
  // The id of the CUDA graph capture `stream` takes part in (cuStreamGetCaptureInfo: unique for
  // the process's life, shared by every stream joined to that capture); none when not capturing.
  // Needs a context current in the calling thread (the default stream means that context's).
  virtual std::optional<std::uint64_t> capture_id(Stream stream) = 0;

  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of `device`, as NVML and the handshake's gpu_map
  // write it.
  virtual std::string device_uuid(int device) = 0;
  // How many devices this process sees (cuDeviceGetCount).
  virtual int device_count() = 0;

  // Handing physical memory to another process (tier/prefill.h): memory made by one process
  // that another maps at its own addresses, through a POSIX file descriptor.
  // create() of memory that can be exported (requested handle type: a file descriptor).
  virtual bool create_shareable(int device, std::size_t size, Handle* handle) = 0;
  // A new descriptor for `handle` (cuMemExportToShareableHandle); the caller closes it.
  virtual int export_fd(Handle handle) = 0;
  // A handle of this process for the memory behind `fd` (cuMemImportFromShareableHandle); the
  // caller still closes `fd`, and releases the handle like any other.
  virtual Handle import_fd(int fd) = 0;
  // The device, in this process's numbering, whose memory `handle` is.
  virtual int handle_device(Handle handle) = 0;
};

// `device`'s primary context current in the calling thread for the scope's life
// (TierDriver::enter_device, leave_device).
class EnteredDevice {
 public:
  EnteredDevice(TierDriver& driver, int device) : driver_(driver) { driver_.enter_device(device); }
  ~EnteredDevice() { driver_.leave_device(); }
  EnteredDevice(const EnteredDevice&) = delete;
  EnteredDevice& operator=(const EnteredDevice&) = delete;

 private:
  TierDriver& driver_;
};

// The real driver, by dlopen of libcuda.so.1. Throws Error(kEnvironment) when the library or
// one of its symbols is missing.
std::unique_ptr<TierDriver> open_cuda_tier_driver();

}  // namespace gpusnap::tier
