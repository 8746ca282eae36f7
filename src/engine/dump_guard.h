// The guardian of one capture: a small process, started before gpusnap changes anything of the
// workload (its pause, the GPU lock), that outlives gpusnap and undoes what gpusnap cannot.
//
// Why: a gpusnap killed between the pause and the end of the capture would otherwise leave the
// workload paused (the handshake waits for a resume nobody sends) or its GPU state checkpointed
// until someone runs gpusnap again. And CRIU's dump must never be interrupted (a process with
// CRIU's parasite code inside it cannot be resumed safely), so the guardian also runs the dump,
// as its own child in its own session: it always finishes and, since gpusnap dumps with
// --leave-running, always thaws the tree.
//
// Unless gpusnap says commit() (the artifact is in place and the source handled), the guardian,
// once gpusnap's end of the pipe closes (gpusnap failed and rolled back, or died) and any dump
// has finished: removes the staging directory and the requests left for libgpusnap-preload.so
// (the driver's memory straight into the artifact), returns the CUDA processes to RUNNING and asks
// a paused workload to resume, withdrawing a pause it may not have seen yet. Each step is a no-op
// where gpusnap's own rollback already did it, so the guardian always does them all.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/subprocess.h"

namespace gpusnap::engine {

class CaptureGuard {
 public:
  // `helper` is the gpusnap binary, which runs the guardian as `gpusnap __dump-guard SPEC`.
  // `workload_pids`: every process of the captured tree (a guardian waiting on the workload's
  // answer stops once none is alive). `control_dir`: the workload's handshake directory (empty:
  // it does not speak it).
  // `preload_requests`: the requests this capture may leave the preload library.
  // `capture_lock_fd`: the capture lock's descriptor (capture_lock.h), held by the guardian
  // until it exits, so that no other capture of the tree starts while its dump still runs.
  CaptureGuard(const std::string& helper, const std::filesystem::path& staging,
               const std::vector<pid_t>& gpu_pids, const std::vector<pid_t>& workload_pids,
               const std::filesystem::path& control_dir,
               const std::vector<std::filesystem::path>& preload_requests = {},
               int capture_lock_fd = -1);
  CaptureGuard(const CaptureGuard&) = delete;
  CaptureGuard& operator=(const CaptureGuard&) = delete;
  // Without commit(): the guardian puts everything back (see above) and exits; waits for it.
  ~CaptureGuard();

  // Runs CRIU (`criu_argv`, output appended to `criu_output`) in the guardian; blocks until CRIU
  // exits and returns its status.
  common::ExitStatus dump(const std::vector<std::string>& criu_argv,
                          const std::filesystem::path& criu_output);
  // Tells the guardian the capture is over: it must not touch anything.
  void commit();

 private:
  common::UniqueFd control_;  // write end: 'D' + a dump request, 'C' = committed; EOF = abandoned
  common::UniqueFd status_;   // read end: CRIU's exit status from the guardian
  std::optional<common::Subprocess> guardian_;
};

// The guardian's own main (`gpusnap __dump-guard SPEC`).
int dump_guard_main(const std::string& spec_json);

}  // namespace gpusnap::engine
