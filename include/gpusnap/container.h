// Containers: a reference to an OCI container by its runtime's state, for capturing the
// workload of a running container and for restoring a snapshot into a placeholder container.
#pragma once

#include <filesystem>
#include <string>

namespace gpusnap {

// A container as its runtime knows it: `runc --root RUNTIME_ROOT state ID`. An empty root is
// found: the one of runc's (/run/runc) and containerd's (/run/containerd/runc/NAMESPACE, or the
// root its tasks' options name) that holds the ID.
struct ContainerRef {
  std::string id;
  std::filesystem::path runtime_root;
};

}  // namespace gpusnap
