// CRIU's dump, run under a guardian process that outlives gpusnap.
//
// Why: if gpusnap is killed mid-dump, interrupting CRIU would be the worst outcome (a process
// with CRIU's parasite code inside it cannot be resumed safely). So CRIU runs as the child of a
// small guardian in its own session: it always finishes and, since gpusnap dumps with
// --leave-running, always resumes the tree. The guardian then waits for gpusnap's word: the
// artifact was committed, or (gpusnap died) it removes the staging directory, so no partial
// artifact is ever left behind.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/subprocess.h"

namespace gpusnap::engine {

class GuardedDump {
 public:
  // `helper` is the gpusnap binary, which runs the guardian as `gpusnap __dump-guard SPEC`.
  // If gpusnap dies mid-way, the guardian returns `gpu_pids` (CUDA processes) to RUNNING and,
  // when `control_dir` is set, asks the paused workload to resume.
  GuardedDump(const std::string& helper, std::vector<std::string> criu_argv,
              std::filesystem::path staging, std::filesystem::path criu_output,
              const std::vector<pid_t>& gpu_pids, const std::filesystem::path& control_dir);
  GuardedDump(const GuardedDump&) = delete;
  GuardedDump& operator=(const GuardedDump&) = delete;
  // Without commit(): the guardian removes the staging directory once CRIU has finished.
  ~GuardedDump();

  // Blocks until CRIU exits; returns its status.
  ExitStatus wait();
  // Tells the guardian the artifact is in place: it must not remove anything.
  void commit();

 private:
  UniqueFd control_;  // write end: 'C' = committed; EOF = abandoned
  UniqueFd status_;   // read end: CRIU's exit status from the guardian
  std::optional<Subprocess> guardian_;
};

// The guardian's entry point (`gpusnap __dump-guard SPEC`); returns its exit code.
int dump_guard_main(const std::string& spec_json);

}  // namespace gpusnap::engine
