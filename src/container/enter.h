// Running a program inside a container's namespaces. CRIU must see a container's workload as
// a plain process tree of its own namespaces: then it dumps and restores no namespace, only
// the processes, with their files resolved in the container's root. So CRIU itself runs in the
// container's PID, mount, network, IPC, UTS and cgroup namespaces. In that mount namespace the
// host's files (the CRIU prefix, the artifact, the logs) are reached through a descriptor of
// the host's root directory, kept at kHostRootFd: /proc/self/fd/9/PATH.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

#include "common/fd.h"
#include "common/subprocess.h"
#include "criu/criu.h"

namespace gpusnap::container {

inline constexpr int kHostRootFd = 9;

// A host path as a process inside the container's mount namespace reaches it.
std::string host_path(const std::filesystem::path& path);

// The command that starts CRIU from inside the container's mount namespace: the private
// prefix's own loader and libraries (scripts/install-criu), named under the host root, since
// the prefix's shell wrapper would run the container's /bin/sh. Throws Error(kEnvironment)
// when `criu` is not such a prefix.
std::vector<std::string> criu_command(const criu::Binary& criu);

// The full CRIU command line for inside the container: criu_command() in place of args[0].
std::vector<std::string> criu_argv_inside(const criu::Binary& criu,
                                          const std::vector<std::string>& args);

// A pid for CRIU itself inside a placeholder's PID namespace that the restored tree cannot
// need: the namespace's last one (the tree's pids were handed out from 1 upwards).
pid_t criu_pid_inside();

// A duplicate of descriptor `fd` of process `pid` (pidfd_getfd), close-on-exec.
common::UniqueFd borrow_fd(pid_t pid, int fd);

struct EnterSpec {
  pid_t target = 0;               // a process of the container (its init): whose namespaces
  std::vector<std::string> argv;  // run there; host paths through host_path()
  std::filesystem::path output;   // the program's stdout and stderr (a host path; appended)
  std::vector<int> inherit_fds;   // descriptors of ours the program gets at the same numbers
  // The program's pid in the container's PID namespace (0: any). A restore picks one that the
  // restored tree cannot need, since CRIU gives the restored processes their old pids there.
  pid_t pid = 0;
  bool join_cgroups = false;  // also move into the target's cgroups (the restored tree stays)
  // Where the PID namespace's next pid is counted from (ns_last_pid), set by the program before
  // it starts; 0 leaves it. A restore sets the highest id of the tree it restores: CRIU gives the
  // tree's processes and threads their ids explicitly, but its own helpers take the next free
  // ones, which would otherwise be the tree's thread ids and make their restore fail (EEXIST).
  pid_t last_pid = 0;
};

// Runs spec.argv inside the target's namespaces and waits for it. Must be called by a
// single-threaded process (a gpusnap helper): joining a PID or mount namespace is refused to
// threaded ones. Throws Error naming the namespace or step that failed.
common::ExitStatus run_inside(const EnterSpec& spec);

// `gpusnap __container-exec SPEC`: run_inside() as a helper program, for the dump guardian,
// which runs CRIU's dump as a program. Returns the program's exit code (128+signal if killed).
std::string to_json(const EnterSpec& spec);
int exec_main(const std::string& spec_json);

}  // namespace gpusnap::container
