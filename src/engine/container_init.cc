#include "engine/container_init.h"

#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <map>

#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "engine/copy_init.h"
#include "engine/preflight.h"
#include "engine/preload.h"
#include "engine/python_site.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

int status_code(int raw) { return WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw); }

// Whether our /proc (the container's) shows `pid` as our child.
bool is_our_child(pid_t pid) {
  try {
    return proc::read_process(pid).ppid == ::getpid();
  } catch (const Error&) {
    return false;
  }
}

}  // namespace

int adopt_signal() { return SIGRTMIN + 2; }

int shim_main(const std::vector<std::string>& command, const ShimOptions& options) {
  if (command.empty()) {
    throw Error(ErrorKind::kUsage, "init needs a command",
                "use `gpusnap init -- CMD ARGS...` or `gpusnap init --placeholder`");
  }
  // Before anything else, as it may refuse: a folder named that is not there.
  std::vector<std::string> tier_env;
  if (options.memory_tier) tier_env = memory_tier_environment(find_python_site());
  become_init();
  common::SpawnOptions o;
  o.argv = command;
  o.stdin_fd = STDIN_FILENO;
  o.stdout_fd = STDOUT_FILENO;
  o.stderr_fd = STDERR_FILENO;
  o.new_session = true;        // CMD's tree is one session: CRIU captures it without a shell job
  o.kill_with_parent = false;  // we are PID 1: the namespace ends with us anyway
  // The library next to this gpusnap (the node's /opt/gpusnap/bin, mounted into the pod): the
  // driver's checkpoint of CMD then populates its host memory in parallel.
  // Its requests where a capture mounts them: the driver's checkpoint then writes straight into
  // the artifact, as for a workload on the host.
  if (auto preload = preload_environment()) {
    o.env_add.push_back(*preload);
    o.env_add.push_back(std::string(kPreloadRequestsEnv) + "=" + kContainerPreloadRequests);
  }
  for (auto& setting : capturable_environment()) o.env_add.push_back(std::move(setting));
  for (auto& setting : tier_env) o.env_add.push_back(std::move(setting));
  common::Subprocess child(o);
  pid_t pid = child.release();  // supervise() reaps it, with every orphan
  return supervise(pid, {});
}

int placeholder_main() {
  become_init();
  sigset_t mask;
  sigemptyset(&mask);
  for (int sig : {SIGCHLD, SIGTERM, SIGINT, SIGHUP, adopt_signal()}) sigaddset(&mask, sig);
  // Single-threaded: a helper program's PID 1, so the process-wide mask is ours to set.
  ::sigprocmask(SIG_BLOCK, &mask, nullptr);  // NOLINT(concurrency-mt-unsafe)
  common::UniqueFd sfd(::signalfd(-1, &mask, SFD_CLOEXEC));
  if (!sfd) throw sys_error("signalfd", errno);
  // Children reaped before the hand-over: what a failed restore left, or a root that exited
  // between the hand-over and our reading of it.
  std::map<pid_t, int> reaped;
  for (;;) {
    signalfd_siginfo si{};
    ssize_t n = ::read(sfd.get(), &si, sizeof si);
    if (n < 0 && errno == EINTR) continue;
    if (n != sizeof si) throw sys_error("read signals", errno);
    int sig = static_cast<int>(si.ssi_signo);
    if (sig == SIGCHLD) {
      int raw;
      for (pid_t pid; (pid = ::waitpid(-1, &raw, WNOHANG)) > 0;) reaped[pid] = status_code(raw);
    } else if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) {
      return 0;  // stopped before any restore: nothing of ours to wind down
    } else if (sig == adopt_signal() && si.ssi_code == SI_QUEUE) {
      auto root = static_cast<pid_t>(si.ssi_int);
      if (auto it = reaped.find(root); it != reaped.end()) return it->second;
      if (is_our_child(root)) return supervise(root, {});
    }
  }
}

bool hand_over(pid_t placeholder, pid_t ns_root) noexcept {
  union sigval value {};
  value.sival_int = ns_root;
  return ::sigqueue(placeholder, adopt_signal(), value) == 0;
}

void kill_restored_tree(pid_t placeholder, pid_t ns_root) noexcept {
  try {
    pid_t host = proc::host_pid_in_namespace(placeholder, ns_root);
    if (host == 0) return;
    for (const auto& p : proc::read_tree(host)) ::kill(p.pid, SIGKILL);
  } catch (const std::exception&) {
    // Gone already.
  }
}

}  // namespace gpusnap::engine
