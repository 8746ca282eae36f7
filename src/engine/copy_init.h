// The init of one restored copy: PID 1 of the copy's fresh PID namespace (also in fresh mount,
// network, IPC and UTS namespaces). It prepares the namespaces for CRIU (its own /proc,
// loopback up), runs `criu restore` so that the restored root becomes its child, reports the
// root's pid, and from then on reaps orphans, forwards published ports from the host into the
// copy, passes SIGTERM/SIGINT on to the root, and exits when the root exits, which ends the
// namespace and everything left in it.
//
// Until gpusnap releases it, the init dies with gpusnap (PR_SET_PDEATHSIG), so a gpusnap killed
// mid-restore leaves no copy, process or namespace behind.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace gpusnap::engine {

struct ForwardSpec {
  int listen_fd;  // a listening socket in the HOST network namespace (inherited)
  uint16_t port;  // where to connect inside the copy
};

struct CopyInitSpec {
  std::vector<std::string> criu_argv;
  std::filesystem::path pidfile;
  std::filesystem::path criu_output;
  std::vector<int> inherit_fds;  // descriptors CRIU hands to the restored tree (closed after)
  std::vector<ForwardSpec> forwards;
  // The copy's own handshake directory, mounted over the path the workload knows (empty: none).
  std::filesystem::path handshake_source;
  std::filesystem::path handshake_target;
  int control_fd = -1;  // to gpusnap: we send "R <nspid>" or "F <reason>", await G, then ack "A"
  // Restore into the namespaces of this placeholder container's init (its host pid) instead
  // of fresh ones of our own: we stay outside, CRIU runs inside as pid criu_pid, and on release
  // the placeholder adopts the restored root (container_init.h). Unreleased, we kill the tree.
  pid_t into_pid = 0;
  pid_t criu_pid = 0;
  pid_t last_pid = 0;  // the highest id of the tree: the namespace's next pids come after it
};

// Runs in the cloned child; returns the exit code of the copy (the root's, or 1 on failure).
int copy_init_main(const CopyInitSpec& spec);

// Makes this process able to act as a PID namespace's init: SIGTERM, SIGINT and SIGHUP become
// deliverable from outside the namespace and, like SIGCHLD, wait in the signal mask for
// supervise()'s signalfd.
void become_init();
// Reaps children and relays published ports until `root` exits; passes SIGTERM, SIGINT and
// SIGHUP on to it. Returns the root's exit code (128 + signal when killed).
int supervise(pid_t root, const std::vector<ForwardSpec>& forwards);

// The spec travels as JSON on the command line of `gpusnap __copy-init SPEC`.
std::string to_json(const CopyInitSpec& spec);
CopyInitSpec copy_init_spec_from_json(const std::string& text);

}  // namespace gpusnap::engine
