#include "gpu/fake_driver.h"

#include <stdexcept>
#include <utility>

#include "gpu/uuid.h"
#include "gpusnap/error.h"

namespace gpusnap::gpu {
namespace {

// Messages copy the real driver's shape ("<function>(pid N) failed: <CUDA error>: <text>; the
// process is now <STATE>"), so tests of gpusnap's reporting read the same against either.
std::string call_text(const char* function, pid_t pid) {
  return std::string(function) + "(pid " + std::to_string(pid) + ")";
}

bool holds_gpu_state(ProcessState state) {
  return state == ProcessState::kRunning || state == ProcessState::kLocked;
}

}  // namespace

FakeDriver::FakeDriver() = default;

GpuInfo FakeDriver::make_gpu(std::string uuid, std::string name, uint64_t memory_total) {
  GpuInfo gpu;
  gpu.uuid = std::move(uuid);
  gpu.name = std::move(name);
  gpu.bus_id = "00000000:00:00.0";
  gpu.cc_major = 9;
  gpu.cc_minor = 0;
  gpu.memory_total = memory_total;
  gpu.memory_free = memory_total;
  return gpu;
}

// --- Set-up
// ---------------------------------------------------------------------------------------

void FakeDriver::set_unavailable(std::string reason) {
  std::lock_guard<std::mutex> guard(mutex_);
  unavailable_reason_ = std::move(reason);
}

void FakeDriver::set_versions(std::string driver_version, int cuda_driver_version) {
  std::lock_guard<std::mutex> guard(mutex_);
  driver_version_ = std::move(driver_version);
  cuda_driver_version_ = cuda_driver_version;
}

void FakeDriver::add_gpu(GpuInfo gpu) {
  std::lock_guard<std::mutex> guard(mutex_);
  gpu.index = static_cast<int>(gpus_.size());
  gpus_.push_back(std::move(gpu));
}

void FakeDriver::set_free_memory(const std::string& gpu_uuid, uint64_t bytes) {
  std::lock_guard<std::mutex> guard(mutex_);
  GpuInfo* gpu = find_gpu(gpu_uuid);
  if (gpu == nullptr) throw std::invalid_argument("FakeDriver: no GPU " + gpu_uuid);
  gpu->memory_free = bytes;
}

void FakeDriver::add_process(pid_t pid, ProcessState state) {
  std::lock_guard<std::mutex> guard(mutex_);
  processes_[pid].state = state;
}

void FakeDriver::remove_process(pid_t pid) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = processes_.find(pid);
  if (it == processes_.end()) return;
  if (holds_gpu_state(it->second.state)) {
    for (const auto& [uuid, bytes] : it->second.usage) {
      if (GpuInfo* gpu = find_gpu(uuid)) gpu->memory_free += bytes;
    }
  }
  processes_.erase(it);
}

void FakeDriver::set_usage(pid_t pid, const std::string& gpu_uuid, uint64_t bytes) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = processes_.find(pid);
  if (it == processes_.end()) {
    throw std::invalid_argument("FakeDriver: no process " + std::to_string(pid));
  }
  uint64_t& held = it->second.usage[gpu_uuid];
  // The memory comes out of the GPU's free memory while the process holds it there.
  GpuInfo* gpu = find_gpu(gpu_uuid);
  if (gpu != nullptr && holds_gpu_state(it->second.state)) {
    const uint64_t available = gpu->memory_free + held;
    gpu->memory_free = available > bytes ? available - bytes : 0;
  }
  held = bytes;
}

// --- Failure injection
// ----------------------------------------------------------------------------

void FakeDriver::inject(Fault fault) {
  std::lock_guard<std::mutex> guard(mutex_);
  faults_.push_back(PendingFault{std::move(fault), 0});
}

void FakeDriver::fail_next(std::string call, pid_t pid, std::optional<ProcessState> after,
                           int nth) {
  Fault fault;
  fault.call = std::move(call);
  fault.pid = pid;
  fault.nth = nth;
  fault.after = after;
  inject(std::move(fault));
}

void FakeDriver::time_out_next_lock(pid_t pid) {
  Fault fault;
  fault.call = "lock";
  fault.pid = pid;
  fault.error = "CUDA_ERROR_TIMEOUT";
  fault.timeout = true;
  inject(std::move(fault));
}

// --- Inspection
// -----------------------------------------------------------------------------------

std::vector<std::string> FakeDriver::calls() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return calls_;
}

std::vector<std::string> FakeDriver::transitions() const {
  std::lock_guard<std::mutex> guard(mutex_);
  std::vector<std::string> out;
  for (const std::string& call : calls_) {
    if (call.starts_with("lock ") || call.starts_with("checkpoint ") ||
        call.starts_with("restore ") || call.starts_with("unlock ")) {
      out.push_back(call);
    }
  }
  return out;
}

void FakeDriver::clear_calls() {
  std::lock_guard<std::mutex> guard(mutex_);
  calls_.clear();
}

ProcessState FakeDriver::peek_state(pid_t pid) const {
  std::lock_guard<std::mutex> guard(mutex_);
  return processes_.at(pid).state;
}

std::optional<std::chrono::milliseconds> FakeDriver::last_lock_timeout() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return last_lock_timeout_;
}

// --- Driver
// ---------------------------------------------------------------------------------------

bool FakeDriver::available() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return unavailable_reason_.empty();
}

std::string FakeDriver::reason() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return unavailable_reason_;
}

DriverFacts FakeDriver::facts() {
  std::lock_guard<std::mutex> guard(mutex_);
  require_available();
  record("facts");
  maybe_fault("facts", 0, "nvmlSystemGetDriverVersion()");
  DriverFacts facts;
  facts.driver_version = driver_version_;
  facts.cuda_driver_version = cuda_driver_version_;
  facts.gpus = gpus_;
  return facts;
}

std::vector<ProcessGpuUsage> FakeDriver::usage() {
  std::lock_guard<std::mutex> guard(mutex_);
  require_available();
  record("usage");
  maybe_fault("usage", 0, "nvmlDeviceGetComputeRunningProcesses_v3(GPU 0)");
  // After a checkpoint the driver has released the process's GPU memory: NVML lists it no more.
  std::vector<ProcessGpuUsage> out;
  for (const auto& [pid, process] : processes_) {
    if (!holds_gpu_state(process.state)) continue;
    for (const auto& [uuid, bytes] : process.usage) out.push_back({pid, uuid, bytes});
  }
  return out;
}

bool FakeDriver::uses_gpu(pid_t pid) {
  std::lock_guard lock(mutex_);
  return unavailable_reason_.empty() && processes_.count(pid) > 0;
}

ProcessState FakeDriver::state(pid_t pid) {
  std::lock_guard<std::mutex> guard(mutex_);
  require_available();
  const std::string text = call_text("cuCheckpointProcessGetState", pid);
  record("state " + std::to_string(pid));
  maybe_fault("state", pid, text);
  return process_or_throw(pid, text).state;
}

void FakeDriver::lock(pid_t pid, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> guard(mutex_);
  last_lock_timeout_ = timeout;
  transition(pid, "cuCheckpointProcessLock", "lock", ProcessState::kRunning).state =
      ProcessState::kLocked;
}

void FakeDriver::checkpoint(pid_t pid) {
  std::lock_guard<std::mutex> guard(mutex_);
  Process& process =
      transition(pid, "cuCheckpointProcessCheckpoint", "checkpoint", ProcessState::kLocked);
  // The GPU contents move into the process's host memory; the GPU gets its memory back.
  for (const auto& [uuid, bytes] : process.usage) {
    if (GpuInfo* gpu = find_gpu(uuid)) gpu->memory_free += bytes;
  }
  process.state = ProcessState::kCheckpointed;
}

void FakeDriver::restore(pid_t pid, const std::vector<GpuPair>& pairs) {
  std::lock_guard<std::mutex> guard(mutex_);
  require_available();
  std::string recorded = "restore " + std::to_string(pid);
  std::string text = "cuCheckpointProcessRestore(pid " + std::to_string(pid);
  for (const GpuPair& pair : pairs) {
    recorded += " " + pair.old_uuid + "->" + pair.new_uuid;
    text += ", " + pair.old_uuid + " -> " + pair.new_uuid;
  }
  text += ")";
  record(recorded);

  // The real driver converts the UUID text before it calls into libcuda: same check, same error.
  for (const GpuPair& pair : pairs) {
    for (const std::string* uuid : {&pair.old_uuid, &pair.new_uuid}) {
      if (!parse_gpu_uuid(*uuid)) {
        throw Error(ErrorKind::kUsage,
                    "cuCheckpointProcessRestore(pid " + std::to_string(pid) +
                        "): malformed GPU UUID '" + *uuid + "' in a GPU pair",
                    "GPU UUIDs look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (nvidia-smi -L)");
      }
    }
  }

  maybe_fault("restore", pid, text);
  Process& process = process_or_throw(pid, text);
  require_state(process, ProcessState::kCheckpointed, "restore", pid, text);

  // Where each GPU's contents go: the pairs, or the same GPU.
  std::map<std::string, std::string> target_of;
  for (const GpuPair& pair : pairs) {
    if (find_gpu(pair.new_uuid) == nullptr) {
      fail(text, pid, "CUDA_ERROR_INVALID_VALUE", "no GPU " + pair.new_uuid + " on this host");
    }
    target_of[pair.old_uuid] = pair.new_uuid;
  }
  std::map<std::string, uint64_t> needed;  // target uuid -> bytes
  for (const auto& [uuid, bytes] : process.usage) {
    if (!pairs.empty() && !target_of.contains(uuid)) {
      fail(text, pid, "CUDA_ERROR_INVALID_VALUE",
           "the GPU pairs must list every checkpointed GPU; " + uuid + " is missing");
    }
    needed[pairs.empty() ? uuid : target_of[uuid]] += bytes;
  }
  for (const auto& [uuid, bytes] : needed) {
    const GpuInfo* gpu = find_gpu(uuid);
    if (gpu != nullptr && gpu->memory_free < bytes) {
      // The driver's hazard: a restore that runs out of GPU memory is not undone.
      process.state = ProcessState::kFailed;
      fail(text, pid, "CUDA_ERROR_OUT_OF_MEMORY",
           "out of memory on " + uuid + " (" + std::to_string(bytes) + " bytes needed, " +
               std::to_string(gpu->memory_free) + " free)");
    }
  }

  std::map<std::string, uint64_t> moved;
  for (const auto& [uuid, bytes] : needed) {
    if (GpuInfo* gpu = find_gpu(uuid)) gpu->memory_free -= bytes;
    moved[uuid] = bytes;
  }
  process.usage = std::move(moved);
  process.state = ProcessState::kLocked;
}

void FakeDriver::unlock(pid_t pid) {
  std::lock_guard<std::mutex> guard(mutex_);
  transition(pid, "cuCheckpointProcessUnlock", "unlock", ProcessState::kLocked).state =
      ProcessState::kRunning;
}

FakeDriver::Process& FakeDriver::transition(pid_t pid, const char* api, const char* call,
                                            ProcessState needed) {
  require_available();
  const std::string text = call_text(api, pid);
  record(std::string(call) + " " + std::to_string(pid));
  maybe_fault(call, pid, text);
  Process& process = process_or_throw(pid, text);
  require_state(process, needed, call, pid, text);
  return process;
}

// --- Helpers (mutex_ held)
// ------------------------------------------------------------------------

void FakeDriver::require_available() const {
  if (!unavailable_reason_.empty()) {
    throw Error(ErrorKind::kEnvironment, "no NVIDIA driver on this host: " + unavailable_reason_,
                "run gpusnap on a host with the NVIDIA driver");
  }
}

void FakeDriver::record(std::string call) { calls_.push_back(std::move(call)); }

void FakeDriver::maybe_fault(const std::string& call, pid_t pid, const std::string& text) {
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    if (it->fault.call != call || (it->fault.pid != 0 && it->fault.pid != pid)) continue;
    if (++it->seen < it->fault.nth) continue;
    const Fault fault = it->fault;
    faults_.erase(it);

    auto process = processes_.find(pid);
    if (fault.timeout) {
      // The driver leaves a process whose lock timed out RUNNING.
      throw Error(ErrorKind::kTimeout,
                  text + " failed: the lock timed out (" + fault.error +
                      ": injected by the fake driver); the process stays RUNNING",
                  "the workload kept GPU work in flight past the lock timeout");
    }
    if (process != processes_.end() && fault.after) process->second.state = *fault.after;
    if (call == "facts" || call == "usage") {
      throw Error(ErrorKind::kGpu,
                  text + " failed: " + fault.error + ": injected by the fake driver");
    }
    fail(text, pid, fault.error, "injected by the fake driver");
  }
}

FakeDriver::Process& FakeDriver::process_or_throw(pid_t pid, const std::string& text) {
  auto it = processes_.find(pid);
  if (it == processes_.end()) {
    // What r580 answers for a process that never initialised CUDA (a pid that does not exist
    // at all gets CUDA_ERROR_OPERATING_SYSTEM; the fake cannot tell the two apart).
    fail(text, pid, "CUDA_ERROR_NOT_INITIALIZED", "not a CUDA process");
  }
  return it->second;
}

GpuInfo* FakeDriver::find_gpu(const std::string& uuid) {
  for (GpuInfo& gpu : gpus_) {
    if (gpu.uuid == uuid) return &gpu;
  }
  return nullptr;
}

void FakeDriver::fail(const std::string& text, pid_t pid, const std::string& error,
                      const std::string& detail) const {
  std::string message = text + " failed: " + error + ": " + detail;
  auto it = processes_.find(pid);
  if (it != processes_.end()) {
    message += std::string("; the process is now ") + state_name(it->second.state);
  }
  std::string hint;
  if (it != processes_.end() && it->second.state == ProcessState::kFailed) {
    hint = "the driver marked the process FAILED, which cannot be undone: kill it";
  }
  throw Error(ErrorKind::kGpu, message, hint);
}

void FakeDriver::require_state(const Process& process, ProcessState needed, const std::string& call,
                               pid_t pid, const std::string& text) const {
  if (process.state == needed) return;
  fail(text, pid, "CUDA_ERROR_ILLEGAL_STATE",
       call + " needs a " + state_name(needed) + " process, this one is " +
           state_name(process.state));
}

}  // namespace gpusnap::gpu
