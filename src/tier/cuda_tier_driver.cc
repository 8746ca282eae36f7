// The memory tier's real driver: libcuda.so.1 reached with dlopen from inside the workload, so
// that the tier builds without the CUDA toolkit and loads into any CUDA workload.
//
// The foreign ABI, and its quirks. The types are copied by hand from cuda.h (CUDA 13.0,
// CUDA_VERSION 13000); static_asserts pin their sizes and offsets.
//  - Versioned names. cuda.h maps several API names to versioned entry points with macros, and
//    the plain symbols in libcuda are the OLD ABI kept for old binaries. The ones used here:
//    cuCtxPushCurrent -> cuCtxPushCurrent_v2, cuCtxPopCurrent -> cuCtxPopCurrent_v2,
//    cuStreamDestroy -> cuStreamDestroy_v2, cuMemcpyDtoHAsync -> cuMemcpyDtoHAsync_v2,
//    cuMemcpyHtoDAsync -> cuMemcpyHtoDAsync_v2, cuDevicePrimaryCtxRelease -> _v2 (unused),
//    cuDeviceGetUuid -> cuDeviceGetUuid_v2. We ask dlsym for those names. cuStreamGetCaptureInfo
//    is mapped to a newer version with graph-edge outputs; we ask for cuStreamGetCaptureInfo_v2
//    (CUDA 11.3 on, kept by later drivers for the binaries built against it), whose status and
//    id are all the tier reads, passing null for the outputs it does not want. The VMM calls
//    (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease,
//    cuMemAddressFree, cuMemGetAllocationGranularity), cuMemHostAlloc, cuMemFreeHost,
//    cuStreamCreate, cuStreamSynchronize, cuCtxSynchronize, cuCtxSetCurrent,
//    cuCtxGetLimit, cuCtxSetLimit and cuDevicePrimaryCtxRetain are not mapped. With
//    CUDA_API_PER_THREAD_DEFAULT_STREAM cuda.h would map the copies to _ptsz variants: those
//    differ only for the default stream, and the tier always passes a stream of its own.
//  - Contexts. PyTorch (through the CUDA runtime) works in each device's primary context. The
//    tier retains the same primary context (cuDevicePrimaryCtxRetain: a reference, not a new
//    context) and makes it current only in its own worker threads; on a workload's thread it
//    pushes and pops it around a call, so the runtime of that thread finds its context as it left
//    it. cuMemCreate, cuMemMap and cuMemSetAccess name the device in their arguments.
//  - Memory properties. CUmemAllocationProp must be zeroed whole: allocFlags carries compression
//    and RDMA requests whose zero is "none", and its reserved bytes change meaning between
//    versions. CU_MEM_ALLOCATION_TYPE_PINNED here means "not migratable" device memory, not pinned
//    host memory.
//  - cuMemMap needs the handle mapped whole at offset 0 with flags 0; a mapping is not usable until
//    cuMemSetAccess grants the device access, and the driver keeps the physical memory alive
//    while mapped even after cuMemRelease (the tier unmaps first anyway).
//  - Granularity: the RECOMMENDED granularity (2 MiB on the H200) is used for sizes and
//    alignment of both the reservation and the physical memory.
//  - Pinned buffers are allocated with CU_MEMHOSTALLOC_PORTABLE, so a worker may use one buffer
//    for pieces on any device.
//  - Stream capture: cuStreamGetCaptureInfo on a stream that is capturing in relaxed or global
//    mode answers ACTIVE and the capture's id; a stream joined to that capture (a fork inside
//    the captured work) answers the same id.
#include <dlfcn.h>
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "gpu/uuid.h"
#include "gpusnap/error.h"
#include "tier/tier_driver.h"

namespace gpusnap::tier {
namespace {

using CUresult = int;
using CUdevice = int;
struct CUctx_st;
using CUcontext = CUctx_st*;
struct CUstream_st;
using CUstream = CUstream_st*;
using CUdeviceptr = unsigned long long;                   // NOLINT(google-runtime-int): the ABI's
using CUmemGenericAllocationHandle = unsigned long long;  // NOLINT(google-runtime-int): the ABI's
using cuuint64_t = std::uint64_t;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;

constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 0x1;
constexpr int CU_MEM_HANDLE_TYPE_NONE = 0x0;
constexpr int CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 0x1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3;
constexpr int CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1;
constexpr unsigned int CU_MEMHOSTALLOC_PORTABLE = 0x01;
constexpr unsigned int CU_MEMHOSTREGISTER_PORTABLE = 0x01;
constexpr unsigned int CU_MEMHOSTREGISTER_READ_ONLY = 0x08;
constexpr unsigned int CU_STREAM_NON_BLOCKING = 0x1;
constexpr int CU_STREAM_CAPTURE_STATUS_NONE = 0;
constexpr int CU_LIMIT_STACK_SIZE = 0x00;  // CUlimit

// typedef struct CUmemLocation_st { CUmemLocationType type; int id; } CUmemLocation;
struct CUmemLocation {
  int type;
  int id;
};
static_assert(sizeof(CUmemLocation) == 8);

// typedef struct CUmemAllocationProp_st {
//     CUmemAllocationType type;
//     CUmemAllocationHandleType requestedHandleTypes;
//     CUmemLocation location;
//     void *win32HandleMetaData;
//     struct { unsigned char compressionType; unsigned char gpuDirectRDMACapable;
//              unsigned short usage; unsigned char reserved[4]; } allocFlags;
// } CUmemAllocationProp;
struct CUmemAllocationProp {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
static_assert(sizeof(CUmemAllocationProp) == 32);
static_assert(offsetof(CUmemAllocationProp, location) == 8);
static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16);
static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24);

// typedef struct CUmemAccessDesc_st { CUmemLocation location; CUmemAccess_flags flags; }
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;
};
static_assert(sizeof(CUmemAccessDesc) == 12);

struct CUuuid {
  unsigned char bytes[16];
};

// NOLINTBEGIN(google-runtime-int): the driver's own parameter types
struct Api {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetUuid_v2)(CUuuid*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxPushCurrent_v2)(CUcontext);
  CUresult (*cuCtxPopCurrent_v2)(CUcontext*);
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuCtxGetLimit)(size_t*, int);
  CUresult (*cuCtxSetLimit)(int, size_t);
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, int);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned int);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuMemHostRegister_v2)(void*, size_t, unsigned int);
  CUresult (*cuMemHostUnregister)(void*);
  CUresult (*cuStreamCreate)(CUstream*, unsigned int);
  CUresult (*cuStreamDestroy_v2)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamGetCaptureInfo_v2)(CUstream, int*, cuuint64_t*, void**, const void**, size_t*);
  CUresult (*cuMemcpyDtoHAsync_v2)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemcpyHtoDAsync_v2)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle, int,
                                           unsigned long long);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*, int);
  CUresult (*cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp*,
                                                     CUmemGenericAllocationHandle);
};
// NOLINTEND(google-runtime-int)

CUmemAllocationProp device_memory(int device) {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset, padding too
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

class CudaTierDriver final : public TierDriver {
 public:
  // The workload has loaded libcuda already (PyTorch did): dlopen finds that copy.
  CudaTierDriver() : handle_(::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE)) {
    if (handle_ == nullptr) {
      const char* text = ::dlerror();
      throw Error(ErrorKind::kEnvironment,
                  std::string("memory tier: cannot load the NVIDIA driver: ") +
                      (text != nullptr ? text : "dlopen failed"),
                  "run the workload on a host with the NVIDIA driver");
    }
    try {
      resolve_all();
      // Idempotent; the workload has initialised CUDA already in the usual case.
      check(api_.cuInit(0), "cuInit");
    } catch (...) {
      ::dlclose(handle_);  // a destructor does not run for a constructor that throws
      throw;
    }
  }
  ~CudaTierDriver() override { ::dlclose(handle_); }
  CudaTierDriver(const CudaTierDriver&) = delete;
  CudaTierDriver& operator=(const CudaTierDriver&) = delete;

  // Pinned buffers are our own memory on 2 MiB pages, populated and then registered with the
  // driver (cuMemHostRegister): pinning is the fixed cost of every drain and fill, and on the
  // H200 this pinned 256 MiB in 0.10 s where cuMemHostAlloc took 0.25 s (docs/benchmarks.md),
  // so it is the only way: cuMemHostAlloc serves only a buffer the driver will not register.
  void* register_huge(std::size_t size) {
    constexpr std::size_t kHuge = std::size_t{2} << 20;
    const std::size_t len = (size + kHuge - 1) / kHuge * kHuge;
    void* room =
        ::mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (room == MAP_FAILED) {
      throw Error(ErrorKind::kEnvironment,
                  "memory tier: cannot map " + std::to_string(len) + " bytes of host memory");
    }
    const auto base = reinterpret_cast<std::uintptr_t>(room);
    // An address the kernel gave, rounded up.
    // NOLINTNEXTLINE(performance-no-int-to-ptr)
    auto* p = reinterpret_cast<void*>((base + kHuge - 1) / kHuge * kHuge);
    (void)::madvise(p, len, MADV_HUGEPAGE);
    (void)::madvise(p, len, MADV_POPULATE_WRITE);
    const CUresult r = api_.cuMemHostRegister_v2(p, len, CU_MEMHOSTREGISTER_PORTABLE);
    if (r != CUDA_SUCCESS) {
      ::munmap(room, len + kHuge);
      void* fallback = nullptr;
      check(api_.cuMemHostAlloc(&fallback, size, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
      return fallback;
    }
    std::lock_guard lock(registered_mutex_);
    registered_[p] = {room, len + kHuge};
    return p;
  }

  void resolve_all() {
    resolve("cuInit", &api_.cuInit);
    resolve("cuGetErrorName", &api_.cuGetErrorName);
    resolve("cuDeviceGet", &api_.cuDeviceGet);
    resolve("cuDeviceGetUuid_v2", &api_.cuDeviceGetUuid_v2);
    resolve("cuDevicePrimaryCtxRetain", &api_.cuDevicePrimaryCtxRetain);
    resolve("cuCtxSetCurrent", &api_.cuCtxSetCurrent);
    resolve("cuCtxPushCurrent_v2", &api_.cuCtxPushCurrent_v2);
    resolve("cuCtxPopCurrent_v2", &api_.cuCtxPopCurrent_v2);
    resolve("cuCtxSynchronize", &api_.cuCtxSynchronize);
    resolve("cuCtxGetLimit", &api_.cuCtxGetLimit);
    resolve("cuCtxSetLimit", &api_.cuCtxSetLimit);
    resolve("cuMemGetAllocationGranularity", &api_.cuMemGetAllocationGranularity);
    resolve("cuMemAddressReserve", &api_.cuMemAddressReserve);
    resolve("cuMemAddressFree", &api_.cuMemAddressFree);
    resolve("cuMemCreate", &api_.cuMemCreate);
    resolve("cuMemRelease", &api_.cuMemRelease);
    resolve("cuMemMap", &api_.cuMemMap);
    resolve("cuMemSetAccess", &api_.cuMemSetAccess);
    resolve("cuMemUnmap", &api_.cuMemUnmap);
    resolve("cuMemHostAlloc", &api_.cuMemHostAlloc);
    resolve("cuMemFreeHost", &api_.cuMemFreeHost);
    resolve("cuMemHostRegister_v2", &api_.cuMemHostRegister_v2);
    resolve("cuMemHostUnregister", &api_.cuMemHostUnregister);
    resolve("cuStreamCreate", &api_.cuStreamCreate);
    resolve("cuStreamDestroy_v2", &api_.cuStreamDestroy_v2);
    resolve("cuStreamSynchronize", &api_.cuStreamSynchronize);
    resolve("cuStreamGetCaptureInfo_v2", &api_.cuStreamGetCaptureInfo_v2);
    resolve("cuMemcpyDtoHAsync_v2", &api_.cuMemcpyDtoHAsync_v2);
    resolve("cuMemcpyHtoDAsync_v2", &api_.cuMemcpyHtoDAsync_v2);
    resolve("cuDeviceGetCount", &api_.cuDeviceGetCount);
    resolve("cuMemExportToShareableHandle", &api_.cuMemExportToShareableHandle);
    resolve("cuMemImportFromShareableHandle", &api_.cuMemImportFromShareableHandle);
    resolve("cuMemGetAllocationPropertiesFromHandle", &api_.cuMemGetAllocationPropertiesFromHandle);
  }

  std::size_t granularity(int device) override {
    const CUmemAllocationProp prop = device_memory(device);
    size_t g = 0;
    check(api_.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
          "cuMemGetAllocationGranularity");
    return g;
  }

  DevicePtr reserve(std::size_t size, std::size_t alignment) override {
    CUdeviceptr va = 0;
    check(api_.cuMemAddressReserve(&va, size, alignment, 0, 0), "cuMemAddressReserve");
    return va;
  }

  void address_free(DevicePtr va, std::size_t size) noexcept override {
    (void)api_.cuMemAddressFree(va, size);
  }

  bool create(int device, std::size_t size, Handle* handle) override {
    const CUmemAllocationProp prop = device_memory(device);
    CUmemGenericAllocationHandle h = 0;
    const CUresult r = api_.cuMemCreate(&h, size, &prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
    check(r, "cuMemCreate");
    *handle = h;
    return true;
  }

  void release(Handle handle) override { check(api_.cuMemRelease(handle), "cuMemRelease"); }

  void map(DevicePtr va, std::size_t size, Handle handle) override {
    check(api_.cuMemMap(va, size, 0, handle, 0), "cuMemMap");
  }

  void set_access(DevicePtr va, std::size_t size, int device) override {
    CUmemAccessDesc access{{CU_MEM_LOCATION_TYPE_DEVICE, device},
                           CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    check(api_.cuMemSetAccess(va, size, &access, 1), "cuMemSetAccess");
  }

  void unmap(DevicePtr va, std::size_t size) override {
    check(api_.cuMemUnmap(va, size), "cuMemUnmap");
  }

  void use_device(int device) override {
    check(api_.cuCtxSetCurrent(primary(device)), "cuCtxSetCurrent");
  }

  void enter_device(int device) override {
    check(api_.cuCtxPushCurrent_v2(primary(device)), "cuCtxPushCurrent");
  }

  void leave_device() noexcept override {
    CUcontext popped = nullptr;
    (void)api_.cuCtxPopCurrent_v2(&popped);
  }

  void synchronize(int device) override {
    check(api_.cuCtxPushCurrent_v2(primary(device)), "cuCtxPushCurrent");
    const CUresult r = api_.cuCtxSynchronize();
    CUcontext popped = nullptr;
    (void)api_.cuCtxPopCurrent_v2(&popped);
    check(r, "cuCtxSynchronize");
  }

  std::size_t stack_limit(int device) override {
    check(api_.cuCtxPushCurrent_v2(primary(device)), "cuCtxPushCurrent");
    std::size_t bytes = 0;
    const CUresult r = api_.cuCtxGetLimit(&bytes, CU_LIMIT_STACK_SIZE);
    CUcontext popped = nullptr;
    (void)api_.cuCtxPopCurrent_v2(&popped);
    check(r, "cuCtxGetLimit(CU_LIMIT_STACK_SIZE)");
    return bytes;
  }

  void set_stack_limit(int device, std::size_t bytes) override {
    check(api_.cuCtxPushCurrent_v2(primary(device)), "cuCtxPushCurrent");
    const CUresult r = api_.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, bytes);
    CUcontext popped = nullptr;
    (void)api_.cuCtxPopCurrent_v2(&popped);
    check(r, "cuCtxSetLimit(CU_LIMIT_STACK_SIZE)");
  }

  void* host_alloc(std::size_t size) override { return register_huge(size); }

  void host_free(void* p) noexcept override {
    {
      std::lock_guard lock(registered_mutex_);
      if (auto it = registered_.find(p); it != registered_.end()) {
        (void)api_.cuMemHostUnregister(p);
        ::munmap(it->second.first, it->second.second);
        registered_.erase(it);
        return;
      }
    }
    (void)api_.cuMemFreeHost(p);
  }

  bool host_register(const void* p, std::size_t size) override {
    // The driver's signature takes a mutable pointer; read-only registration never writes.
    return api_.cuMemHostRegister_v2(const_cast<void*>(p), size,
                                     CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY) ==
           CUDA_SUCCESS;
  }

  void host_unregister(const void* p) noexcept override {
    (void)api_.cuMemHostUnregister(const_cast<void*>(p));
  }

  Stream stream_create() override {
    CUstream s = nullptr;
    // Non-blocking: the tier's copies must not wait for, nor hold up, the legacy default stream.
    check(api_.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    return s;
  }

  void stream_destroy(Stream stream) noexcept override {
    (void)api_.cuStreamDestroy_v2(static_cast<CUstream>(stream));
  }

  void copy_to_host(void* dst, DevicePtr src, std::size_t size, Stream stream) override {
    check(api_.cuMemcpyDtoHAsync_v2(dst, src, size, static_cast<CUstream>(stream)),
          "cuMemcpyDtoHAsync");
  }

  void copy_to_device(DevicePtr dst, const void* src, std::size_t size, Stream stream) override {
    check(api_.cuMemcpyHtoDAsync_v2(dst, src, size, static_cast<CUstream>(stream)),
          "cuMemcpyHtoDAsync");
  }

  void stream_synchronize(Stream stream) override {
    check(api_.cuStreamSynchronize(static_cast<CUstream>(stream)), "cuStreamSynchronize");
  }

  std::optional<std::uint64_t> capture_id(Stream stream) override {
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    cuuint64_t id = 0;
    check(api_.cuStreamGetCaptureInfo_v2(static_cast<CUstream>(stream), &status, &id, nullptr,
                                         nullptr, nullptr),
          "cuStreamGetCaptureInfo");
    if (status == CU_STREAM_CAPTURE_STATUS_NONE) return std::nullopt;
    return id;
  }

  int device_count() override {
    int n = 0;
    check(api_.cuDeviceGetCount(&n), "cuDeviceGetCount");
    return n;
  }

  bool create_shareable(int device, std::size_t size, Handle* handle) override {
    CUmemAllocationProp prop = device_memory(device);
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h = 0;
    const CUresult r = api_.cuMemCreate(&h, size, &prop, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
    check(r, "cuMemCreate");
    *handle = h;
    return true;
  }

  int export_fd(Handle handle) override {
    int fd = -1;
    check(
        api_.cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle");
    return fd;
  }

  Handle import_fd(int fd) override {
    CUmemGenericAllocationHandle h = 0;
    // The descriptor travels in the pointer-sized argument, as cuda.h documents for POSIX.
    // NOLINTNEXTLINE(performance-no-int-to-ptr)
    void* os_handle = reinterpret_cast<void*>(static_cast<std::intptr_t>(fd));
    check(api_.cuMemImportFromShareableHandle(&h, os_handle,
                                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle");
    return h;
  }

  int handle_device(Handle handle) override {
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset
    CUmemAllocationProp prop;
    std::memset(&prop, 0, sizeof(prop));
    check(api_.cuMemGetAllocationPropertiesFromHandle(&prop, handle),
          "cuMemGetAllocationPropertiesFromHandle");
    return prop.location.id;
  }

  std::string device_uuid(int device) override {
    CUuuid uuid{};
    check(api_.cuDeviceGetUuid_v2(&uuid, cu_device(device)), "cuDeviceGetUuid");
    gpu::GpuUuidBytes bytes{};
    std::memcpy(bytes.data(), uuid.bytes, bytes.size());
    return gpu::format_gpu_uuid(bytes);
  }

 private:
  template <typename Fn>
  void resolve(const char* name, Fn* fn) {
    ::dlerror();
    void* address = ::dlsym(handle_, name);
    if (address == nullptr) {
      const char* text = ::dlerror();
      throw Error(ErrorKind::kEnvironment,
                  std::string("memory tier: the NVIDIA driver lacks ") + name + ": " +
                      (text != nullptr ? text : "no such symbol"),
                  "upgrade the NVIDIA driver (r570 or newer)");
    }
    *fn = reinterpret_cast<Fn>(address);
  }

  void check(CUresult r, const char* call) const {
    if (r == CUDA_SUCCESS) return;
    const char* name = nullptr;
    if (api_.cuGetErrorName == nullptr || api_.cuGetErrorName(r, &name) != CUDA_SUCCESS ||
        name == nullptr) {
      name = "an unknown CUDA error";
    }
    throw Error(ErrorKind::kGpu, std::string("memory tier: ") + call + " failed: " + name + " (" +
                                     std::to_string(r) + ")");
  }

  CUdevice cu_device(int ordinal) {
    CUdevice d = 0;
    check(api_.cuDeviceGet(&d, ordinal), "cuDeviceGet");
    return d;
  }

  // The device's primary context, retained once and kept for the life of the process (releasing
  // it could destroy the context PyTorch uses).
  CUcontext primary(int device) {
    std::lock_guard lock(mu_);
    auto it = contexts_.find(device);
    if (it != contexts_.end()) return it->second;
    CUcontext ctx = nullptr;
    check(api_.cuDevicePrimaryCtxRetain(&ctx, cu_device(device)), "cuDevicePrimaryCtxRetain");
    contexts_.emplace(device, ctx);
    return ctx;
  }

  void* handle_ = nullptr;
  Api api_{};
  std::mutex registered_mutex_;
  std::map<void*, std::pair<void*, std::size_t>> registered_;  // buffer -> (mapping, length)
  std::mutex mu_;
  std::map<int, CUcontext> contexts_;
};

}  // namespace

std::unique_ptr<TierDriver> open_cuda_tier_driver() { return std::make_unique<CudaTierDriver>(); }

}  // namespace gpusnap::tier
