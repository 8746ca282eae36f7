// The GPU side of a checkpoint and a restore, on top of the driver seam (gpu/driver.h).
//
// Checkpoint: every CUDA process of the tree is locked (all of them before any is
// checkpointed, so a multi-process workload is captured at one consistent point), then
// checkpointed: the driver moves its GPU memory into the process's host memory, which CRIU
// then dumps like any other memory. Restore is the reverse, after CRIU: the driver's restore
// (onto the mapped GPUs) and unlock, addressed by host pid.
//
// Invariant: no failure leaves a process locked or checkpointed. Every process touched is put
// back to RUNNING (restore + unlock as needed) before the error is reported; a process the
// driver marked FAILED cannot be put back and is killed, and the error says so. A journal
// entry (one file per gpusnap under run_dir/journal) names the processes while they are
// away from RUNNING, so that the next gpusnap run repairs what a killed one left.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/proc.h"
#include "gpu/driver.h"
#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"

namespace gpusnap::engine {

// The CUDA processes of a tree (host pids), in tree order.
std::vector<pid_t> cuda_processes(gpu::Driver& driver, const std::vector<proc::Process>& tree);

// The manifest's GPU section for these processes: driver versions, the GPUs they can see, and
// each process's GPU bytes. Must be read while the processes still hold their GPU memory.
GpuFacts describe_gpu_state(gpu::Driver& driver, const std::vector<pid_t>& pids);

// Puts each process back to RUNNING whatever state it is in; kills one the driver marked
// FAILED (and adds it to `killed`, when given). Returns one line per action taken or problem met
// (for notes and error messages). Never throws.
std::vector<std::string> return_to_running(gpu::Driver& driver, const std::vector<pid_t>& pids,
                                           std::vector<pid_t>* killed = nullptr) noexcept;

// Repairs what gpusnap runs that were killed left behind: journal entries whose owner is
// gone. Returns what was done, one line each. Never throws.
std::vector<std::string> recover_abandoned(gpu::Driver& driver,
                                           const std::filesystem::path& run_dir) noexcept;

// Repairs the journal entries owned by `owner`, alive or not: those of an earlier process that
// had the same pid (an agent that is PID 1 of its container always has), which
// recover_abandoned takes for alive. Returns what was done, one line each; unreadable entries
// are left to recover_abandoned to report. Never throws.
std::vector<std::string> recover_entries_of(gpu::Driver& driver,
                                            const std::filesystem::path& run_dir,
                                            pid_t owner) noexcept;

// The GPU side of one checkpoint. Destroying it before commit() or resume_all() returns
// every process to RUNNING.
class GpuCapture {
 public:
  GpuCapture(gpu::Driver& driver, std::vector<pid_t> pids, std::chrono::milliseconds lock_timeout,
             const std::filesystem::path& run_dir, Reporter& reporter);
  GpuCapture(const GpuCapture&) = delete;
  GpuCapture& operator=(const GpuCapture&) = delete;
  ~GpuCapture();

  const std::vector<pid_t>& pids() const { return pids_; }
  void lock_all();        // phase gpu-lock
  void checkpoint_all();  // phase gpu-checkpoint, one thread per process
  void resume_all();      // restore in place + unlock: the source keeps running
  void commit();          // the source is about to be stopped: nothing to undo
  // The processes this capture killed because the driver marked them FAILED.
  const std::vector<pid_t>& killed() const { return killed_; }

 private:
  // Rolls back and rethrows `error` with what the rollback did appended.
  [[noreturn]] void fail(const std::exception& error);
  void write_journal();

  gpu::Driver& driver_;
  std::vector<pid_t> pids_;
  std::vector<pid_t> moved_;  // locked by this capture, so ours to return to RUNNING
  std::vector<pid_t> killed_;
  std::chrono::milliseconds lock_timeout_;
  std::filesystem::path journal_;
  Reporter& reporter_;
  bool done_ = false;
};

// How a GPU snapshot goes onto this host's GPUs.
struct GpuPlan {
  bool has_gpu_state = false;
  std::vector<gpu::GpuPair> pairs;  // empty: every GPU is the one it was taken on
  std::vector<std::string> notes;   // decisions worth telling the user
};

// Checks the artifact's GPU facts against this host and maps its GPUs, refusing before
// anything starts (Error kIncompatible / kEnvironment / kUsage) when: no driver is present,
// the driver version differs, a GPU model differs, the target GPUs lack free memory for the
// copies, a --gpu-map entry is wrong, or a map is given for an artifact without GPU state
// (`gpu_facts` empty). `map` entries are "OLD=NEW", each side a GPU UUID or index.
GpuPlan plan_gpu_restore(const std::optional<GpuFacts>& gpu_facts, gpu::Driver& driver,
                         const std::vector<std::string>& map, int replicas);

// Restores and unlocks the CUDA processes of the restored copies (host pids), all in
// parallel; throws on the first failure (the caller ends the copies).
void restore_gpu_processes(gpu::Driver& driver, const std::vector<pid_t>& host_pids,
                           const std::vector<gpu::GpuPair>& pairs);

}  // namespace gpusnap::engine
