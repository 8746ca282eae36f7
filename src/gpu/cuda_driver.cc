// The real GPU driver: libcuda.so.1 (the checkpoint API) and libnvidia-ml.so.1 (NVML: versions,
// GPUs, per-process memory), both reached through dlopen so that one gpusnap binary builds without
// the CUDA toolkit and runs on hosts with no GPU (available() then says why not).
//
// The foreign ABI, and its quirks. The types below are copied by hand from cuda.h (CUDA 13.0,
// CUDA_VERSION 13000) and nvml.h (NVML_API_VERSION 13); static_asserts pin their sizes and offsets
// so that an edit that breaks the layout fails the build.
//  - Every args struct of the checkpoint API is fixed-size, mostly "reserved, must be zeroed". The
//    reserved fields change meaning between driver versions (CUcheckpointRestoreArgs carved
//    gpuPairs and gpuPairsCount out of its reserved space, hence "reserved[52 - sizeof(ptr)]"),
//    so a stray byte could mean something to a newer driver: we memset each whole struct to zero
//    before setting the fields we use.
//  - The calls take HOST pids (the driver's view). A pid inside a container's pid namespace must
//    be translated first (the NSpid line of /proc/PID/status); that is the caller's job.
//  - cuCheckpointProcessRestore needs cuInit to have been called in the CALLING process (or the
//    GPUs to be in persistence mode). We call cuInit(0) once, lazily, before restore (or early,
//    through prepare_restore, so that its ~0.2 s overlaps other work);
//    any other checkpoint call that answers CUDA_ERROR_NOT_INITIALIZED before our cuInit is run
//    once more after it.
//    cuInit only sees the GPUs that CUDA_VISIBLE_DEVICES in gpusnap's own environment allows.
//  - Never cancel a call in flight: lock, checkpoint and restore move the target's state while
//    they run, and interrupting them (a signal, killing the thread) can leave the target in an
//    unknown state. Bounded waits go through the lock's own timeoutMs instead.
//  - After any failure we ask the driver for the process's state and report it: CU_PROCESS_STATE_
//    FAILED is uncorrectable, and the only safe response is to kill the process.
//  - What the driver answered on the H200 (r580.159.04): a lock that times out returns
//    CUDA_ERROR_NOT_READY (not CUDA_ERROR_TIMEOUT) and leaves the process RUNNING; a pid that
//    exists but never initialised CUDA gets CUDA_ERROR_NOT_INITIALIZED (even after our own cuInit);
//    a pid that does not exist gets CUDA_ERROR_OPERATING_SYSTEM; restore pairs naming an unknown
//    GPU get CUDA_ERROR_INVALID_VALUE and leave the process CHECKPOINTED. There, lock, checkpoint
//    and even restore also worked from a caller that had not called cuInit, but the GPU was
//    already initialised by the workload; cuInit before restore stays, as documented.
//  - Symbols are resolved by their plain names. cuda.h maps some API names to versioned entry
//    points with macros (cuCtxCreate -> cuCtxCreate_v4, cuDeviceGetUuid -> cuDeviceGetUuid_v2);
//    none of the functions used here is so mapped in CUDA 13.0 (cudaTypedefs.h lists only a
//    _v12080 version of each checkpoint function, the one its plain name resolves to). NVML does
//    map names (nvml.h: nvmlInit -> nvmlInit_v2, nvmlDeviceGetCount -> _v2,
//    nvmlDeviceGetHandleByIndex -> _v2, nvmlDeviceGetPciInfo -> _v3,
//    nvmlDeviceGetComputeRunningProcesses -> _v3), and we ask dlsym for those versioned names,
//    because the unversioned symbols are the old ABI with the old struct layouts.
//  - nvml.h is not in the CUDA 13 toolkit on the build machine; the NVML layouts were checked
//    against nvml.h of NVML API 13 as vendored in NVIDIA's go-nvml (whose only change is to wrap
//    the nvmlDevice_t pointer in a one-member struct for cgo, which is the same ABI).
//  - GPU identity: NVML's UUID text "GPU-<32 hex>" is, byte for byte, the CUuuid that
//    cuDeviceGetUuid returns and the restore GPU pairs take (see uuid.h). NVML numbers GPUs in PCI
//    order, which need not be CUDA's ordinal order; GpuInfo::index is NVML's index.
#include <dlfcn.h>

#include <filesystem>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpu/driver.h"
#include "gpu/uuid.h"
#include "gpusnap/error.h"

namespace gpusnap::gpu {
namespace {

// ---------------------------------------------------------------------------------------------
// cuda.h (CUDA 13.0)

using CUresult = int;  // enum cudaError_enum: an int-sized C enum
using cuuint64_t = std::uint64_t;

// The CUresult values this file acts on (cuda.h, enum cudaError_enum).
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
constexpr CUresult CUDA_ERROR_STUB_LIBRARY = 34;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_OPERATING_SYSTEM = 304;
constexpr CUresult CUDA_ERROR_ILLEGAL_STATE = 401;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
constexpr CUresult CUDA_ERROR_TIMEOUT = 909;

// typedef enum CUprocessState_enum { RUNNING = 0, LOCKED, CHECKPOINTED, FAILED } CUprocessState;
// Passed by pointer as an int: C gives this enum int size.
constexpr int CU_PROCESS_STATE_RUNNING = 0;
constexpr int CU_PROCESS_STATE_LOCKED = 1;
constexpr int CU_PROCESS_STATE_CHECKPOINTED = 2;
constexpr int CU_PROCESS_STATE_FAILED = 3;

// typedef struct CUuuid_st { char bytes[16]; } CUuuid;
struct CUuuid {
  char bytes[16];
};

// typedef struct CUcheckpointLockArgs_st {
//     unsigned int timeoutMs;  /* 0 indicates no timeout */
//     unsigned int reserved0;
//     cuuint64_t reserved1[7];
// } CUcheckpointLockArgs;
struct CUcheckpointLockArgs {
  unsigned int timeoutMs;
  unsigned int reserved0;
  cuuint64_t reserved1[7];
};
static_assert(sizeof(CUcheckpointLockArgs) == 64);
static_assert(offsetof(CUcheckpointLockArgs, reserved1) == 8);

// typedef struct CUcheckpointCheckpointArgs_st { cuuint64_t reserved[8]; }
// CUcheckpointCheckpointArgs;
struct CUcheckpointCheckpointArgs {
  cuuint64_t reserved[8];
};
static_assert(sizeof(CUcheckpointCheckpointArgs) == 64);

// typedef struct CUcheckpointGpuPair_st { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
struct CUcheckpointGpuPair {
  CUuuid oldUuid;
  CUuuid newUuid;
};
static_assert(sizeof(CUcheckpointGpuPair) == 32);

// typedef struct CUcheckpointRestoreArgs_st {
//     CUcheckpointGpuPair *gpuPairs;
//     unsigned int gpuPairsCount;
//     char reserved[52 - sizeof(CUcheckpointGpuPair *)];
//     cuuint64_t reserved1;
// } CUcheckpointRestoreArgs;
struct CUcheckpointRestoreArgs {
  CUcheckpointGpuPair* gpuPairs;
  unsigned int gpuPairsCount;
  // NOLINTNEXTLINE(bugprone-sizeof-expression): the ABI's size of a pointer
  char reserved[52 - sizeof(CUcheckpointGpuPair*)];
  cuuint64_t reserved1;
};
static_assert(sizeof(CUcheckpointRestoreArgs) == 64);
static_assert(offsetof(CUcheckpointRestoreArgs, gpuPairsCount) == 8);
static_assert(offsetof(CUcheckpointRestoreArgs, reserved1) == 56);

// typedef struct CUcheckpointUnlockArgs_st { cuuint64_t reserved[8]; } CUcheckpointUnlockArgs;
struct CUcheckpointUnlockArgs {
  cuuint64_t reserved[8];
};
static_assert(sizeof(CUcheckpointUnlockArgs) == 64);

using PFN_cuInit = CUresult (*)(unsigned int flags);
using PFN_cuDriverGetVersion = CUresult (*)(int* version);
using PFN_cuGetErrorName = CUresult (*)(CUresult error, const char** str);
using PFN_cuGetErrorString = CUresult (*)(CUresult error, const char** str);
using PFN_cuCheckpointProcessGetState = CUresult (*)(int pid, int* state);
using PFN_cuCheckpointProcessLock = CUresult (*)(int pid, CUcheckpointLockArgs* args);
using PFN_cuCheckpointProcessCheckpoint = CUresult (*)(int pid, CUcheckpointCheckpointArgs* args);
using PFN_cuCheckpointProcessRestore = CUresult (*)(int pid, CUcheckpointRestoreArgs* args);
using PFN_cuCheckpointProcessUnlock = CUresult (*)(int pid, CUcheckpointUnlockArgs* args);

// ---------------------------------------------------------------------------------------------
// nvml.h (NVML_API_VERSION 13)

using nvmlReturn_t = int;  // enum nvmlReturn_enum
constexpr nvmlReturn_t NVML_SUCCESS = 0;
constexpr nvmlReturn_t NVML_ERROR_INSUFFICIENT_SIZE = 7;

struct nvmlDevice_st;
using nvmlDevice_t = nvmlDevice_st*;  // typedef struct nvmlDevice_st* nvmlDevice_t;

constexpr unsigned int NVML_DEVICE_NAME_V2_BUFFER_SIZE = 96;
constexpr unsigned int NVML_DEVICE_UUID_BUFFER_SIZE = 80;
constexpr unsigned int NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE = 80;

// typedef struct nvmlPciInfo_st {
//     char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];  /* 16 */
//     unsigned int domain;
//     unsigned int bus;
//     unsigned int device;
//     unsigned int pciDeviceId;
//     unsigned int pciSubSystemId;
//     char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];  /* 32 */
// } nvmlPciInfo_t;   (filled by nvmlDeviceGetPciInfo_v3)
struct nvmlPciInfo_t {
  char busIdLegacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[32];
};
static_assert(sizeof(nvmlPciInfo_t) == 68);
static_assert(offsetof(nvmlPciInfo_t, busId) == 36);

// typedef struct nvmlMemory_st {
//     unsigned long long total; unsigned long long free; unsigned long long used;
// } nvmlMemory_t;   (filled by nvmlDeviceGetMemoryInfo)
struct nvmlMemory_t {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
static_assert(sizeof(nvmlMemory_t) == 24);

// typedef struct nvmlProcessInfo_v2_st {
//     unsigned int pid;
//     unsigned long long usedGpuMemory;
//     unsigned int gpuInstanceId;
//     unsigned int computeInstanceId;
// } nvmlProcessInfo_v2_t, nvmlProcessInfo_t;   (filled by nvmlDeviceGetComputeRunningProcesses_v3)
struct nvmlProcessInfo_t {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
static_assert(sizeof(nvmlProcessInfo_t) == 24);
static_assert(offsetof(nvmlProcessInfo_t, usedGpuMemory) == 8);
// usedGpuMemory when the driver cannot tell (NVML_VALUE_NOT_AVAILABLE, i.e. -1).
constexpr unsigned long long kNvmlValueNotAvailable = ~0ULL;

using PFN_nvmlInit_v2 = nvmlReturn_t (*)();
using PFN_nvmlShutdown = nvmlReturn_t (*)();
using PFN_nvmlErrorString = const char* (*)(nvmlReturn_t result);
using PFN_nvmlSystemGetDriverVersion = nvmlReturn_t (*)(char* version, unsigned int length);
using PFN_nvmlDeviceGetCount_v2 = nvmlReturn_t (*)(unsigned int* count);
using PFN_nvmlDeviceGetHandleByIndex_v2 = nvmlReturn_t (*)(unsigned int index, nvmlDevice_t* dev);
using PFN_nvmlDeviceGetName = nvmlReturn_t (*)(nvmlDevice_t dev, char* name, unsigned int length);
using PFN_nvmlDeviceGetUUID = nvmlReturn_t (*)(nvmlDevice_t dev, char* uuid, unsigned int length);
using PFN_nvmlDeviceGetPciInfo_v3 = nvmlReturn_t (*)(nvmlDevice_t dev, nvmlPciInfo_t* pci);
using PFN_nvmlDeviceGetCudaComputeCapability = nvmlReturn_t (*)(nvmlDevice_t dev, int* major,
                                                                int* minor);
using PFN_nvmlDeviceGetMemoryInfo = nvmlReturn_t (*)(nvmlDevice_t dev, nvmlMemory_t* memory);
using PFN_nvmlDeviceGetComputeRunningProcesses_v3 = nvmlReturn_t (*)(nvmlDevice_t dev,
                                                                     unsigned int* count,
                                                                     nvmlProcessInfo_t* infos);

// ---------------------------------------------------------------------------------------------

constexpr const char* kLibCuda = "libcuda.so.1";
constexpr const char* kLibNvml = "libnvidia-ml.so.1";

constexpr const char* kNoDriverHint =
    "run gpusnap on a host with the NVIDIA driver (r570 or newer; r580 to restore onto other "
    "GPUs); in a container, mount the driver's libraries (NVIDIA Container Toolkit)";

// One dlopen handle. Opened with RTLD_NODELETE: libcuda starts threads and registers exit
// handlers once used, so its code must stay mapped even after dlclose; dlclose still drops the
// reference, which keeps the handle's ownership honest.
class DynamicLibrary {
 public:
  DynamicLibrary() = default;
  DynamicLibrary(const DynamicLibrary&) = delete;
  DynamicLibrary& operator=(const DynamicLibrary&) = delete;
  DynamicLibrary(DynamicLibrary&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)) {}
  DynamicLibrary& operator=(DynamicLibrary&& other) noexcept {
    if (this != &other) {
      close();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  ~DynamicLibrary() { close(); }

  // Opens `name` through the normal search path. On failure returns an empty object and sets
  // *error to dlerror()'s text.
  static DynamicLibrary open(const char* name, std::string* error) {
    DynamicLibrary lib;
    lib.handle_ = ::dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (lib.handle_ == nullptr) {
      const char* text = ::dlerror();
      *error = text != nullptr ? text : "dlopen failed";
    }
    return lib;
  }

  explicit operator bool() const { return handle_ != nullptr; }

  // Resolves `symbol` into *fn. On failure leaves *fn null and sets *error (if still empty) to
  // dlerror()'s text: the first missing symbol is the one reported.
  template <typename Fn>
  void resolve(const char* symbol, Fn* fn, std::string* error) const {
    *fn = nullptr;
    ::dlerror();  // clear any stale error: dlsym reports through dlerror, not its result
    void* address = ::dlsym(handle_, symbol);
    const char* text = ::dlerror();
    if (text != nullptr || address == nullptr) {
      if (error->empty()) error->assign(text != nullptr ? text : std::string(symbol) + ": null");
      return;
    }
    // POSIX guarantees a data pointer from dlsym converts to the function pointer it names.
    *fn = reinterpret_cast<Fn>(address);
  }

 private:
  void close() {
    if (handle_ != nullptr) ::dlclose(handle_);
    handle_ = nullptr;
  }

  void* handle_ = nullptr;
};

struct CudaApi {
  PFN_cuInit cuInit;
  PFN_cuDriverGetVersion cuDriverGetVersion;
  PFN_cuGetErrorName cuGetErrorName;
  PFN_cuGetErrorString cuGetErrorString;
  PFN_cuCheckpointProcessGetState cuCheckpointProcessGetState;
  PFN_cuCheckpointProcessLock cuCheckpointProcessLock;
  PFN_cuCheckpointProcessCheckpoint cuCheckpointProcessCheckpoint;
  PFN_cuCheckpointProcessRestore cuCheckpointProcessRestore;
  PFN_cuCheckpointProcessUnlock cuCheckpointProcessUnlock;
};

struct NvmlApi {
  PFN_nvmlInit_v2 nvmlInit_v2;
  PFN_nvmlShutdown nvmlShutdown;
  PFN_nvmlErrorString nvmlErrorString;
  PFN_nvmlSystemGetDriverVersion nvmlSystemGetDriverVersion;
  PFN_nvmlDeviceGetCount_v2 nvmlDeviceGetCount_v2;
  PFN_nvmlDeviceGetHandleByIndex_v2 nvmlDeviceGetHandleByIndex_v2;
  PFN_nvmlDeviceGetName nvmlDeviceGetName;
  PFN_nvmlDeviceGetUUID nvmlDeviceGetUUID;
  PFN_nvmlDeviceGetPciInfo_v3 nvmlDeviceGetPciInfo_v3;
  PFN_nvmlDeviceGetCudaComputeCapability nvmlDeviceGetCudaComputeCapability;
  PFN_nvmlDeviceGetMemoryInfo nvmlDeviceGetMemoryInfo;
  PFN_nvmlDeviceGetComputeRunningProcesses_v3 nvmlDeviceGetComputeRunningProcesses_v3;
};

// The text up to the first NUL of a fixed-size C buffer the driver filled.
std::string from_buffer(const char* buffer, size_t size) {
  return std::string(buffer, ::strnlen(buffer, size));
}

class CudaDriver final : public Driver {
 public:
  CudaDriver() { load(); }

  ~CudaDriver() override {
    // NVML counts inits; balance ours. libcuda has no counterpart to cuInit.
    if (nvml_initialised_) nvml_.nvmlShutdown();
  }

  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  bool available() const override { return reason_.empty(); }
  std::string reason() const override { return reason_; }

  DriverFacts facts() override {
    require();
    ensure_nvml_init();
    // No cuInit here: everything below is NVML's but the CUDA version, which the driver
    // answers without it. cuInit costs ~0.2 s on an H200; restore runs it beside CRIU
    // (prepare_restore), and the checkpoint calls run it when the driver asks for it.

    DriverFacts facts;
    char version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = {};
    check_nvml(nvml_.nvmlSystemGetDriverVersion(version, sizeof(version)),
               "nvmlSystemGetDriverVersion()");
    facts.driver_version = from_buffer(version, sizeof(version));

    const CUresult r =
        call_initialised([&] { return cu_.cuDriverGetVersion(&facts.cuda_driver_version); });
    if (r != CUDA_SUCCESS) {
      throw Error(ErrorKind::kGpu, "cuDriverGetVersion() failed: " + cu_error_text(r));
    }

    const unsigned int count = device_count();
    for (unsigned int index = 0; index < count; ++index) {
      nvmlDevice_t device = device_handle(index);
      const std::string where = "(GPU " + std::to_string(index) + ")";
      GpuInfo gpu;
      gpu.index = static_cast<int>(index);

      char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {};
      check_nvml(nvml_.nvmlDeviceGetName(device, name, sizeof(name)), "nvmlDeviceGetName" + where);
      gpu.name = from_buffer(name, sizeof(name));

      gpu.uuid = device_uuid(device, where);

      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset, padding too
      nvmlPciInfo_t pci;
      std::memset(&pci, 0, sizeof(pci));
      check_nvml(nvml_.nvmlDeviceGetPciInfo_v3(device, &pci), "nvmlDeviceGetPciInfo_v3" + where);
      gpu.bus_id = from_buffer(pci.busId, sizeof(pci.busId));

      check_nvml(nvml_.nvmlDeviceGetCudaComputeCapability(device, &gpu.cc_major, &gpu.cc_minor),
                 "nvmlDeviceGetCudaComputeCapability" + where);

      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset, padding too
      nvmlMemory_t memory;
      std::memset(&memory, 0, sizeof(memory));
      check_nvml(nvml_.nvmlDeviceGetMemoryInfo(device, &memory), "nvmlDeviceGetMemoryInfo" + where);
      gpu.memory_total = memory.total;
      gpu.memory_free = memory.free;

      facts.gpus.push_back(std::move(gpu));
    }
    return facts;
  }

  std::vector<ProcessGpuUsage> usage() override {
    require();
    ensure_nvml_init();

    std::vector<ProcessGpuUsage> result;
    const unsigned int count = device_count();
    for (unsigned int index = 0; index < count; ++index) {
      nvmlDevice_t device = device_handle(index);
      const std::string where = "(GPU " + std::to_string(index) + ")";
      const std::string uuid = device_uuid(device, where);
      for (const nvmlProcessInfo_t& info : compute_processes(device, where)) {
        ProcessGpuUsage entry;
        // NVML reports the driver's (host) pids, whatever namespace gpusnap runs in.
        entry.host_pid = static_cast<pid_t>(info.pid);
        entry.gpu_uuid = uuid;
        // Unknown (not-available) counts as 0 rather than 16 EiB: callers add these up.
        entry.bytes = info.usedGpuMemory == kNvmlValueNotAvailable ? 0 : info.usedGpuMemory;
        result.push_back(std::move(entry));
      }
    }
    return result;
  }

  // A process with a CUDA context keeps the driver's device files open (/dev/nvidiactl and
  // /dev/nvidiaN); a process that only loaded libcuda does not. After the driver's checkpoint
  // they are closed, which is what lets CRIU dump the process.
  bool uses_gpu(pid_t pid) override {
    std::error_code ec;
    auto dir = "/proc/" + std::to_string(pid) + "/fd";
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      std::error_code link_ec;
      auto target = std::filesystem::read_symlink(entry.path(), link_ec).string();
      if (target.rfind("/dev/nvidia", 0) == 0 && target != "/dev/nvidia-uvm-tools") return true;
    }
    return false;
  }

  ProcessState state(pid_t pid) override {
    require();
    int raw = -1;
    const CUresult r = call_initialised([&] { return cu_.cuCheckpointProcessGetState(pid, &raw); });
    if (r != CUDA_SUCCESS) {
      throw Error(ErrorKind::kGpu,
                  call_name("cuCheckpointProcessGetState", pid) + " failed: " + cu_error_text(r),
                  hint_for(r, pid, false));
    }
    switch (raw) {
      case CU_PROCESS_STATE_RUNNING: return ProcessState::kRunning;
      case CU_PROCESS_STATE_LOCKED: return ProcessState::kLocked;
      case CU_PROCESS_STATE_CHECKPOINTED: return ProcessState::kCheckpointed;
      case CU_PROCESS_STATE_FAILED: return ProcessState::kFailed;
    }
    throw Error(ErrorKind::kGpu,
                call_name("cuCheckpointProcessGetState", pid) + " returned an unknown state " +
                    std::to_string(raw),
                "this driver is newer than gpusnap knows: upgrade gpusnap");
  }

  void lock(pid_t pid, std::chrono::milliseconds timeout) override {
    require();
    // The driver reads timeoutMs == 0 as "wait forever"; pass it through so a caller can ask
    // for that on purpose, but refuse a negative value, which can only be a bug.
    if (timeout.count() < 0) {
      throw Error(ErrorKind::kInternal, call_name("cuCheckpointProcessLock", pid) +
                                            ": negative timeout " +
                                            std::to_string(timeout.count()) + " ms");
    }
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset, padding too
    CUcheckpointLockArgs args;
    std::memset(&args, 0, sizeof(args));
    args.timeoutMs =
        timeout.count() > UINT_MAX ? UINT_MAX : static_cast<unsigned int>(timeout.count());

    const CUresult r = call_initialised([&] { return cu_.cuCheckpointProcessLock(pid, &args); });
    if (r == CUDA_SUCCESS) return;

    const std::string call = call_name("cuCheckpointProcessLock", pid);
    // r580 answers a lock timeout with NOT_READY (measured); TIMEOUT is the driver's general
    // timeout code, taken the same way in case another version uses it. Either way the work did
    // not drain in time, and the driver leaves the process RUNNING.
    if (r == CUDA_ERROR_TIMEOUT || r == CUDA_ERROR_NOT_READY) {
      std::string now = state_suffix(pid);
      if (now.empty() || now == running_suffix()) now = "; the process stays RUNNING";
      throw Error(ErrorKind::kTimeout,
                  call + " failed: the lock timed out after " + std::to_string(args.timeoutMs) +
                      " ms (" + cu_error_text(r) + ")" + now,
                  "the workload kept GPU work in flight past the lock timeout: quiesce it "
                  "first, or give the lock a longer timeout");
    }
    fail(call, pid, r);
  }

  void checkpoint(pid_t pid) override {
    require();
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset, padding too
    CUcheckpointCheckpointArgs args;
    std::memset(&args, 0, sizeof(args));
    const CUresult r =
        call_initialised([&] { return cu_.cuCheckpointProcessCheckpoint(pid, &args); });
    if (r != CUDA_SUCCESS) fail(call_name("cuCheckpointProcessCheckpoint", pid), pid, r);
  }

  void prepare_restore() override {
    require();
    ensure_cu_init("cuCheckpointProcessRestore");
  }

  void restore(pid_t pid, const std::vector<GpuPair>& pairs) override {
    require();
    std::string call = "cuCheckpointProcessRestore(pid " + std::to_string(pid);
    std::vector<CUcheckpointGpuPair> raw_pairs;
    raw_pairs.reserve(pairs.size());
    for (const GpuPair& pair : pairs) {
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset, padding too
      CUcheckpointGpuPair raw;
      std::memset(&raw, 0, sizeof(raw));
      to_cuuuid(pair.old_uuid, pid, &raw.oldUuid);
      to_cuuuid(pair.new_uuid, pid, &raw.newUuid);
      raw_pairs.push_back(raw);
      call += ", " + pair.old_uuid + " -> " + pair.new_uuid;
    }
    call += ")";

    // Restore is the one call the driver documents as needing cuInit in the caller.
    ensure_cu_init(call);

    if (!raw_pairs.empty()) {
      // Older drivers had reserved bytes where gpuPairs now is; they would reject the pairs or,
      // worse, restore onto the old GPUs. GPU pairs arrived with r580, which is CUDA 13.0.
      int version = 0;
      if (cu_.cuDriverGetVersion(&version) == CUDA_SUCCESS && version < 13000) {
        throw Error(ErrorKind::kIncompatible,
                    call +
                        ": restoring onto other GPUs needs a driver for CUDA 13.0 (r580) or "
                        "newer; this one is for CUDA " +
                        std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10),
                    "upgrade the NVIDIA driver, or restore onto the GPUs the checkpoint was "
                    "taken on");
      }
    }

    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset, padding too
    CUcheckpointRestoreArgs args;
    std::memset(&args, 0, sizeof(args));
    if (!raw_pairs.empty()) {
      args.gpuPairs = raw_pairs.data();
      args.gpuPairsCount = static_cast<unsigned int>(raw_pairs.size());
    }
    const CUresult r = cu_.cuCheckpointProcessRestore(pid, &args);
    if (r != CUDA_SUCCESS) fail(call, pid, r, !raw_pairs.empty());
  }

  void unlock(pid_t pid) override {
    require();
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-member-init): zeroed by the memset, padding too
    CUcheckpointUnlockArgs args;
    std::memset(&args, 0, sizeof(args));
    const CUresult r = call_initialised([&] { return cu_.cuCheckpointProcessUnlock(pid, &args); });
    if (r != CUDA_SUCCESS) fail(call_name("cuCheckpointProcessUnlock", pid), pid, r);
  }

 private:
  // dlopen both libraries and resolve every symbol up front, so that available() is a complete
  // answer and no later call can fail for a missing symbol.
  void load() {
    std::string error;
    cuda_lib_ = DynamicLibrary::open(kLibCuda, &error);
    if (!cuda_lib_) {
      reason_ = std::string(kLibCuda) + " not found: no NVIDIA driver on this host (" + error + ")";
      unusable_ = "no NVIDIA driver on this host: " + reason_;
      return;
    }
    cuda_lib_.resolve("cuInit", &cu_.cuInit, &error);
    cuda_lib_.resolve("cuDriverGetVersion", &cu_.cuDriverGetVersion, &error);
    cuda_lib_.resolve("cuGetErrorName", &cu_.cuGetErrorName, &error);
    cuda_lib_.resolve("cuGetErrorString", &cu_.cuGetErrorString, &error);
    cuda_lib_.resolve("cuCheckpointProcessGetState", &cu_.cuCheckpointProcessGetState, &error);
    cuda_lib_.resolve("cuCheckpointProcessLock", &cu_.cuCheckpointProcessLock, &error);
    cuda_lib_.resolve("cuCheckpointProcessCheckpoint", &cu_.cuCheckpointProcessCheckpoint, &error);
    cuda_lib_.resolve("cuCheckpointProcessRestore", &cu_.cuCheckpointProcessRestore, &error);
    cuda_lib_.resolve("cuCheckpointProcessUnlock", &cu_.cuCheckpointProcessUnlock, &error);
    if (!error.empty()) {
      reason_ = std::string(kLibCuda) +
                " lacks the checkpoint API: the NVIDIA driver is too old (r570 or newer needed; " +
                error + ")";
      unusable_ = "NVIDIA driver unusable: " + reason_;
      return;
    }

    nvml_lib_ = DynamicLibrary::open(kLibNvml, &error);
    if (!nvml_lib_) {
      reason_ =
          std::string(kLibNvml) + " not found: the NVIDIA driver is incomplete (" + error + ")";
      unusable_ = "NVIDIA driver unusable: " + reason_;
      return;
    }
    nvml_lib_.resolve("nvmlInit_v2", &nvml_.nvmlInit_v2, &error);
    nvml_lib_.resolve("nvmlShutdown", &nvml_.nvmlShutdown, &error);
    nvml_lib_.resolve("nvmlErrorString", &nvml_.nvmlErrorString, &error);
    nvml_lib_.resolve("nvmlSystemGetDriverVersion", &nvml_.nvmlSystemGetDriverVersion, &error);
    nvml_lib_.resolve("nvmlDeviceGetCount_v2", &nvml_.nvmlDeviceGetCount_v2, &error);
    nvml_lib_.resolve("nvmlDeviceGetHandleByIndex_v2", &nvml_.nvmlDeviceGetHandleByIndex_v2,
                      &error);
    nvml_lib_.resolve("nvmlDeviceGetName", &nvml_.nvmlDeviceGetName, &error);
    nvml_lib_.resolve("nvmlDeviceGetUUID", &nvml_.nvmlDeviceGetUUID, &error);
    nvml_lib_.resolve("nvmlDeviceGetPciInfo_v3", &nvml_.nvmlDeviceGetPciInfo_v3, &error);
    nvml_lib_.resolve("nvmlDeviceGetCudaComputeCapability",
                      &nvml_.nvmlDeviceGetCudaComputeCapability, &error);
    nvml_lib_.resolve("nvmlDeviceGetMemoryInfo", &nvml_.nvmlDeviceGetMemoryInfo, &error);
    nvml_lib_.resolve("nvmlDeviceGetComputeRunningProcesses_v3",
                      &nvml_.nvmlDeviceGetComputeRunningProcesses_v3, &error);
    if (!error.empty()) {
      reason_ = std::string(kLibNvml) + " lacks a needed function: the NVIDIA driver is too old (" +
                error + ")";
      unusable_ = "NVIDIA driver unusable: " + reason_;
    }
  }

  void require() const {
    if (!available()) throw Error(ErrorKind::kEnvironment, unusable_, kNoDriverHint);
  }

  // cuInit(0) once per gpusnap process. A failure is not remembered: the next call tries again
  // (a GPU can come back, e.g. after persistence mode is turned on).
  void ensure_cu_init(const std::string& needed_by) {
    std::lock_guard<std::mutex> guard(init_mutex_);
    if (cu_initialised_) return;
    const CUresult r = cu_.cuInit(0);
    if (r != CUDA_SUCCESS) {
      std::string hint =
          "check that the GPUs are visible to gpusnap itself (nvidia-smi works, "
          "CUDA_VISIBLE_DEVICES is unset or names them, /dev/nvidia* are accessible)";
      if (r == CUDA_ERROR_STUB_LIBRARY) hint = stub_hint();
      throw Error(ErrorKind::kGpu,
                  "cuInit(0) failed: " + cu_error_text(r) + " (needed by " + needed_by + ")", hint);
    }
    cu_initialised_ = true;
  }

  void ensure_nvml_init() {
    std::lock_guard<std::mutex> guard(init_mutex_);
    if (nvml_initialised_) return;
    const nvmlReturn_t r = nvml_.nvmlInit_v2();
    if (r != NVML_SUCCESS) {
      throw Error(ErrorKind::kGpu, "nvmlInit_v2() failed: " + nvml_error_text(r),
                  "check that the NVIDIA kernel module is loaded and matches the user-space "
                  "driver (nvidia-smi shows the same error)");
    }
    nvml_initialised_ = true;
  }

  // Runs a checkpoint-API call; if the driver answers NOT_INITIALIZED before this process has
  // called cuInit, calls cuInit and runs it once more (nothing happened the first time). After
  // our cuInit, NOT_INITIALIZED is about the target: it never initialised CUDA.
  template <typename Call>
  CUresult call_initialised(Call&& call) {
    CUresult r = call();
    if (r == CUDA_ERROR_NOT_INITIALIZED && !cu_initialised()) {
      ensure_cu_init("the checkpoint API");
      r = call();
    }
    return r;
  }

  bool cu_initialised() {
    std::lock_guard<std::mutex> guard(init_mutex_);
    return cu_initialised_;
  }

  // "CUDA_ERROR_ILLEGAL_STATE: operation not permitted in current state" (the driver's words).
  std::string cu_error_text(CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (cu_.cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) name = nullptr;
    if (cu_.cuGetErrorString(r, &text) != CUDA_SUCCESS || text == nullptr) text = nullptr;
    std::string out = name != nullptr ? name : "CUresult " + std::to_string(r);
    out += ": ";
    out += text != nullptr ? text : "unknown error";
    return out;
  }

  std::string nvml_error_text(nvmlReturn_t r) const {
    const char* text = nvml_.nvmlErrorString(r);
    return std::string(text != nullptr ? text : "unknown error") + " (NVML error " +
           std::to_string(r) + ")";
  }

  void check_nvml(nvmlReturn_t r, const std::string& call) const {
    if (r != NVML_SUCCESS) throw Error(ErrorKind::kGpu, call + " failed: " + nvml_error_text(r));
  }

  static std::string call_name(const char* function, pid_t pid) {
    return std::string(function) + "(pid " + std::to_string(pid) + ")";
  }

  static std::string running_suffix() { return "; the process is now RUNNING"; }

  // "; the process is now LOCKED", or "" when even the state query fails: checked after every
  // failed call, because the state decides what the caller may do next.
  std::string state_suffix(pid_t pid) {
    int raw = -1;
    if (cu_.cuCheckpointProcessGetState(pid, &raw) != CUDA_SUCCESS) return "";
    switch (raw) {
      case CU_PROCESS_STATE_RUNNING: return running_suffix();
      case CU_PROCESS_STATE_LOCKED: return "; the process is now LOCKED";
      case CU_PROCESS_STATE_CHECKPOINTED: return "; the process is now CHECKPOINTED";
      case CU_PROCESS_STATE_FAILED: return "; the process is now FAILED";
    }
    return "; the process is now in unknown state " + std::to_string(raw);
  }

  [[noreturn]] void fail(const std::string& call, pid_t pid, CUresult r, bool with_pairs = false) {
    const std::string now = state_suffix(pid);
    std::string hint = hint_for(r, pid, with_pairs);
    if (now == "; the process is now FAILED") {
      hint = "the driver marked the process FAILED, which cannot be undone: kill it (and "
             "restore it from an artifact)";
    }
    throw Error(ErrorKind::kGpu, call + " failed: " + cu_error_text(r) + now, hint);
  }

  static std::string stub_hint() {
    return "libcuda.so.1 is the CUDA toolkit's stub, not the driver: take the toolkit's stubs "
           "directory out of LD_LIBRARY_PATH";
  }

  static std::string hint_for(CUresult r, pid_t pid, bool with_pairs) {
    const std::string p = std::to_string(pid);
    switch (r) {
      case CUDA_ERROR_ILLEGAL_STATE:
        return "the call does not fit the process's state: the sequence is lock (RUNNING) -> "
               "checkpoint (LOCKED) -> restore (CHECKPOINTED) -> unlock (LOCKED)";
      case CUDA_ERROR_NOT_INITIALIZED:
        return "process " + p +
               " has not initialised CUDA: it is not a CUDA process (or not "
               "yet), or " +
               p +
               " is a namespace pid; the driver takes HOST pids (NSpid in "
               "/proc/PID/status translates a container's)";
      case CUDA_ERROR_OPERATING_SYSTEM:
        return "the driver found no process " + p + ": it has exited, or " + p +
               " is a namespace pid; the driver takes HOST pids (NSpid in /proc/PID/status "
               "translates a container's)";
      case CUDA_ERROR_INVALID_VALUE:
        if (with_pairs) {
          return "check the GPU pairs: each old UUID must be a GPU the process was checkpointed "
                 "on, each new UUID a GPU of the same model on this host, and every "
                 "checkpointed GPU must be listed";
        }
        return "the driver rejected an argument: is " + p + " a CUDA process, by its HOST pid?";
      case CUDA_ERROR_NOT_SUPPORTED:
        return "the process uses something the checkpoint API cannot capture (managed/UVM "
               "memory, CUDA IPC, MIG, MPS, NCCL P2P/SHM transports), or the driver is older "
               "than r570";
      case CUDA_ERROR_OUT_OF_MEMORY:
        return "the target GPU lacks free memory for the process's state: check free memory "
               "before restoring";
      case CUDA_ERROR_NO_DEVICE:
        return "gpusnap itself sees no GPU: unset CUDA_VISIBLE_DEVICES for gpusnap";
      case CUDA_ERROR_STUB_LIBRARY: return stub_hint();
    }
    return {};
  }

  unsigned int device_count() const {
    unsigned int count = 0;
    check_nvml(nvml_.nvmlDeviceGetCount_v2(&count), "nvmlDeviceGetCount_v2()");
    return count;
  }

  nvmlDevice_t device_handle(unsigned int index) const {
    nvmlDevice_t device = nullptr;
    check_nvml(nvml_.nvmlDeviceGetHandleByIndex_v2(index, &device),
               "nvmlDeviceGetHandleByIndex_v2(" + std::to_string(index) + ")");
    return device;
  }

  std::string device_uuid(nvmlDevice_t device, const std::string& where) const {
    char uuid[NVML_DEVICE_UUID_BUFFER_SIZE] = {};
    check_nvml(nvml_.nvmlDeviceGetUUID(device, uuid, sizeof(uuid)), "nvmlDeviceGetUUID" + where);
    return from_buffer(uuid, sizeof(uuid));
  }

  // The list can grow between the sizing call and the filling call (a process starts), so ask
  // again with room to spare until it fits.
  std::vector<nvmlProcessInfo_t> compute_processes(nvmlDevice_t device,
                                                   const std::string& where) const {
    std::vector<nvmlProcessInfo_t> infos;
    for (int attempt = 0;; ++attempt) {
      unsigned int count = static_cast<unsigned int>(infos.size());
      const nvmlReturn_t r = nvml_.nvmlDeviceGetComputeRunningProcesses_v3(
          device, &count, infos.empty() ? nullptr : infos.data());
      if (r == NVML_SUCCESS) {
        infos.resize(count);
        return infos;
      }
      if (r != NVML_ERROR_INSUFFICIENT_SIZE || attempt == 4) {
        check_nvml(r, "nvmlDeviceGetComputeRunningProcesses_v3" + where);
      }
      infos.assign(static_cast<size_t>(count) + 8, nvmlProcessInfo_t{});
    }
  }

  static void to_cuuuid(const std::string& text, pid_t pid, CUuuid* out) {
    const auto bytes = parse_gpu_uuid(text);
    if (!bytes) {
      throw Error(ErrorKind::kUsage,
                  "cuCheckpointProcessRestore(pid " + std::to_string(pid) +
                      "): malformed GPU UUID '" + text + "' in a GPU pair",
                  "GPU UUIDs look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (nvidia-smi -L)");
    }
    std::memcpy(out->bytes, bytes->data(), sizeof(out->bytes));
  }

  // The handles are destroyed after ~CudaDriver's body, which still calls nvmlShutdown through
  // the tables below.
  DynamicLibrary cuda_lib_;
  DynamicLibrary nvml_lib_;
  CudaApi cu_{};
  NvmlApi nvml_{};
  std::string reason_;    // empty when usable; else the one-line reason
  std::string unusable_;  // the message every call throws when not usable

  std::mutex init_mutex_;  // guards the two flags below
  bool cu_initialised_ = false;
  bool nvml_initialised_ = false;
};

}  // namespace

std::unique_ptr<Driver> open_nvidia_driver() { return std::make_unique<CudaDriver>(); }

Driver& given_or_nvidia(Driver* given, std::unique_ptr<Driver>& owned) {
  if (given != nullptr) return *given;
  owned = open_nvidia_driver();
  return *owned;
}

}  // namespace gpusnap::gpu
