// A stand-in for the NVIDIA driver, for tests on machines without a GPU. It keeps fake GPUs and
// per-process checkpoint states, enforces the driver's state machine the way the real driver does
// (an out-of-order call throws, so a test catches gpusnap misusing the API), records every call in
// order, and fails chosen calls on demand. Deterministic: no clock, no randomness, no I/O.
// Thread-safe: every method takes one internal mutex.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "gpu/driver.h"

namespace gpusnap::gpu {

class FakeDriver final : public Driver {
 public:
  // One injected failure. It fires on the nth call (1 = the next) named `call` for `pid`,
  // counting from when it was injected, and then is spent.
  struct Fault {
    std::string call;  // "state", "lock", "checkpoint", "restore", "unlock", "facts", "usage"
    pid_t pid = 0;     // 0: any pid (facts and usage have none)
    int nth = 1;
    // The process's state after the failed call; nullopt leaves it as it was.
    std::optional<ProcessState> after;
    // The driver error the message names.
    std::string error = "CUDA_ERROR_UNKNOWN";
    // For "lock": fail as the lock's timeout does (Error kind kTimeout, message says the lock
    // timed out and the process stays RUNNING; `after` is then ignored).
    bool timeout = false;
  };

  // Available, driver "580.159.04" for CUDA 13000, no GPUs, no processes.
  FakeDriver();

  // --- Set-up -----------------------------------------------------------------------------------

  // A GPU with `uuid`, all of its memory free (143771 MiB, an H200, unless told otherwise).
  static GpuInfo make_gpu(std::string uuid, std::string name = "NVIDIA H200",
                          uint64_t memory_total = 143771ULL << 20);

  // Makes available() false with this reason; every other call then throws kEnvironment as the
  // real driver does on a host without one. Calls are then not recorded.
  void set_unavailable(std::string reason);
  void set_versions(std::string driver_version, int cuda_driver_version);
  // Adds a GPU; its index becomes its position in the list.
  void add_gpu(GpuInfo gpu);
  void set_free_memory(const std::string& gpu_uuid, uint64_t bytes);
  // Registers a CUDA process, RUNNING unless told otherwise. The driver treats any other pid as
  // not a CUDA process (CUDA_ERROR_NOT_INITIALIZED, as r580 does).
  void add_process(pid_t pid, ProcessState state = ProcessState::kRunning);
  // The process exited: later calls for it fail as for an unknown pid; its GPU memory is freed.
  void remove_process(pid_t pid);
  // GPU memory `pid` holds on `gpu_uuid`, taken from that GPU's free memory while the process
  // holds GPU state (RUNNING or LOCKED); usage() reports it then. Checkpoint returns it to the
  // GPU's free memory; restore takes it from the target GPU's and fails with
  // CUDA_ERROR_OUT_OF_MEMORY, leaving the process FAILED, when the target has too little: the
  // hazard gpusnap must check for before restoring.
  void set_usage(pid_t pid, const std::string& gpu_uuid, uint64_t bytes);

  // --- Failure injection
  // --------------------------------------------------------------------------

  void inject(Fault fault);
  // Shorthand: the nth `call` for `pid` fails, leaving the process in `after` (or as it was).
  void fail_next(std::string call, pid_t pid, std::optional<ProcessState> after = std::nullopt,
                 int nth = 1);
  // Shorthand: the next lock of `pid` times out.
  void time_out_next_lock(pid_t pid);

  // --- Inspection
  // ---------------------------------------------------------------------------------

  // Every call in order: "facts", "usage", "state 1234", "lock 1234", "checkpoint 1234",
  // "restore 1234", "restore 1234 GPU-a->GPU-b GPU-c->GPU-d", "unlock 1234". A call is recorded
  // even when it fails.
  std::vector<std::string> calls() const;
  // Only the calls that move a state: lock, checkpoint, restore, unlock.
  std::vector<std::string> transitions() const;
  void clear_calls();
  // A process's state, without recording a call. Throws std::out_of_range for an unknown pid.
  ProcessState peek_state(pid_t pid) const;
  // The timeout of the last lock call, if any.
  std::optional<std::chrono::milliseconds> last_lock_timeout() const;

  // --- Driver
  // -------------------------------------------------------------------------------------

  bool available() const override;
  std::string reason() const override;
  DriverFacts facts() override;
  std::vector<ProcessGpuUsage> usage() override;
  bool uses_gpu(pid_t pid) override;
  ProcessState state(pid_t pid) override;
  void lock(pid_t pid, std::chrono::milliseconds timeout) override;
  void checkpoint(pid_t pid) override;
  void restore(pid_t pid, const std::vector<GpuPair>& pairs) override;
  void unlock(pid_t pid) override;

 private:
  struct Process {
    ProcessState state = ProcessState::kRunning;
    std::map<std::string, uint64_t> usage;  // GPU uuid -> bytes
  };
  struct PendingFault {
    Fault fault;
    int seen = 0;  // matching calls since injection
  };

  // All of these expect mutex_ held.
  // The common start of lock, checkpoint and unlock: the call recorded under `call`, its fault
  // applied, and the process, which must be in state `needed`.
  Process& transition(pid_t pid, const char* api, const char* call, ProcessState needed);
  void require_available() const;
  void record(std::string call);
  // Counts the call against pending faults; applies and throws the first that fires.
  void maybe_fault(const std::string& call, pid_t pid, const std::string& call_text);
  Process& process_or_throw(pid_t pid, const std::string& call_text);
  GpuInfo* find_gpu(const std::string& uuid);
  [[noreturn]] void fail(const std::string& call_text, pid_t pid, const std::string& error,
                         const std::string& detail) const;
  void require_state(const Process& process, ProcessState needed, const std::string& call,
                     pid_t pid, const std::string& call_text) const;

  mutable std::mutex mutex_;
  std::string unavailable_reason_;
  std::string driver_version_ = "580.159.04";
  int cuda_driver_version_ = 13000;
  std::vector<GpuInfo> gpus_;
  std::map<pid_t, Process> processes_;
  std::vector<PendingFault> faults_;
  std::vector<std::string> calls_;
  std::optional<std::chrono::milliseconds> last_lock_timeout_;
};

}  // namespace gpusnap::gpu
