// What gpusnap checks of a container whatever runtime runs it, from the host's /proc alone: the
// role gpusnap plays as its PID 1, whether gpusnap can work in it, the identity of the files its
// workload maps (recorded at a capture, compared at a restore into another container), and the
// pids its PID namespace gives the processes. The runtime's part (finding the container and its
// state) is container/runc.h.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "common/proc.h"
#include "gpusnap/artifact.h"

namespace gpusnap::container {

// gpusnap's role as a container's PID 1, from its command line: `gpusnap init [--placeholder]`.
enum class Role { kOther, kShim, kPlaceholder };
Role role_of(pid_t pid);

// The checks a capture and a restore share, of a container (`what`, as errors name it) in state
// `status` whose PID 1 is `pid` on the host: running, in gpusnap's user namespace, with a
// writable /tmp. Throws Error (kNotFound when not running, else kNotCapturable) with the fix.
void refuse_unusable(pid_t pid, const std::string& status, const std::string& what);

// The files the processes of `tree` map (executables, libraries), identified in the root
// filesystem that process `root_pid` sees: size, and build-id or checksum. A file gone since
// is left out (CRIU decides what that means).
std::vector<RootfsFileRecord> identify_mapped_files(pid_t root_pid,
                                                    const std::vector<proc::Process>& tree);

// Throws Error(kIncompatible) when the root filesystem that process `pid` sees (of the container
// `what`) lacks any of `files` or has another one (size, then build-id or content), naming the
// first and asking for the image of the captured container `captured_id`.
void refuse_other_rootfs(pid_t pid, const std::vector<RootfsFileRecord>& files,
                         const std::string& what, const std::string& captured_id);

// Rewrites the manifest's pids (processes, GPU processes, the source) into the pids the
// container's PID namespace gives them: the pids CRIU records and restores.
void use_namespace_pids(Manifest& manifest);

}  // namespace gpusnap::container
