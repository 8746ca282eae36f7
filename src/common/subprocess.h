// Child processes as owned objects. A Subprocess that is destroyed while its child still runs
// kills (SIGKILL) and reaps it, so no error path leaves a stray process behind.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gpusnap::common {

struct SpawnOptions {
  std::vector<std::string> argv;
  std::vector<std::string> env_add;  // "KEY=VALUE" added to (or replacing in) our environment
  int stdin_fd = -1;                 // -1: /dev/null
  int stdout_fd = -1;                // -1: /dev/null
  int stderr_fd = -1;                // -1: /dev/null
  // Descriptors the child gets at fixed numbers: {source fd in parent, number in child}.
  std::vector<std::pair<int, int>> keep_fds;
  bool kill_with_parent = true;  // PR_SET_PDEATHSIG(SIGKILL)
  bool new_session = false;      // setsid(): no terminal signals from ours
  int clone_flags = 0;           // CLONE_NEW* namespaces for the child
  // With CLONE_NEWNS in clone_flags: {source, target} folders bound over their targets in the
  // child's own mount namespace before it runs the program (every mount made private first, so
  // nothing reaches the parent's namespace).
  std::vector<std::pair<std::string, std::string>> bind_mounts;
  // Refuse io_uring to the child and its descendants (seccomp: io_uring_setup fails with
  // ENOSYS, as on a kernel without it), so libraries fall back to plain system calls and the
  // process stays capturable by CRIU.
  bool deny_io_uring = false;
};

struct ExitStatus {
  bool exited = false;  // false: killed by a signal
  int code = 0;         // exit code, or the signal number
  bool ok() const { return exited && code == 0; }
  std::string describe() const;
};

class Subprocess {
 public:
  explicit Subprocess(const SpawnOptions& options);
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&&) = delete;
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !status_; }
  // Waits for exit; with a timeout, returns nullopt when it expires (the child keeps running).
  std::optional<ExitStatus> wait(std::optional<std::chrono::milliseconds> timeout = {});
  // Non-blocking check.
  std::optional<ExitStatus> poll();
  void kill(int signal);
  // Forget the child: it is no longer killed on destruction (it was handed to someone else).
  pid_t release();

 private:
  pid_t pid_ = -1;
  std::optional<ExitStatus> status_;
};

// Leaves a child that is ending to a thread of its own that reaps it: for one whose exit is
// slow (a GPU context torn down) and whose end nobody needs to wait for. Should this process
// end first, the child is killed with it (kill_with_parent) or reaped by init.
void reap_in_background(Subprocess child);

// Runs a command to completion, capturing stdout and stderr together.
struct RunResult {
  ExitStatus status;
  std::string output;
};
RunResult run_capture(const std::vector<std::string>& argv,
                      std::chrono::milliseconds timeout = std::chrono::minutes(1));

}  // namespace gpusnap::common
