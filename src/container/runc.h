// A container found through its runtime (runc): its state, and the targets a capture and a
// restore take from it. The checks that do not depend on the runtime (gpusnap's role as PID 1,
// the rootfs's files, the namespace's pids) are container/checks.h, included here.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

#include "common/proc.h"
#include "container/checks.h"
#include "gpusnap/artifact.h"
#include "gpusnap/container.h"

namespace gpusnap::container {

// What `runc --root DIR state ID` says about a container.
struct State {
  std::string id;
  std::string status;  // "running", "created", "paused", "stopped"
  pid_t pid = 0;       // its PID 1, as the host sees it
  std::filesystem::path bundle;
  std::filesystem::path rootfs;
  std::filesystem::path runtime_root;  // the runc root it was found in
};

// Throws Error: kEnvironment without runc, kNotFound for an unknown container. A ref without a
// runtime root is searched for in the runtimes' roots (find_runtime_root()).
State read_state(const ContainerRef& given);

// A running container whose PID 1 is `gpusnap init -- CMD`: the tree to capture is CMD's.
struct CaptureTarget {
  State state;
  pid_t root = 0;  // CMD, as the host sees it
};
// Throws Error naming the container and the fix when it is not running, its PID 1 is not the
// gpusnap shim, or the shim has no single child to capture.
CaptureTarget capture_target(const ContainerRef& ref);

// What the manifest records of a container capture: runtime, id, rootfs and the identity of
// every file the tree maps (path in the container, size, checksum).
ContainerRecord describe(const CaptureTarget& target, const std::vector<proc::Process>& tree);

// A running container whose PID 1 is `gpusnap init --placeholder`, waiting for a snapshot.
struct Placeholder {
  State state;
};
// Throws Error when the artifact was not captured from a container, the container is not a
// waiting placeholder, or its root filesystem lacks or differs in a file the workload maps.
Placeholder placeholder_target(const ContainerRef& ref, const Manifest& manifest);

}  // namespace gpusnap::container
