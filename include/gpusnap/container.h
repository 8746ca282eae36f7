// Containers: a reference to an OCI container by its runtime's state, for capturing the
// workload of a running container and for restoring a snapshot into a placeholder container.
#pragma once

#include <filesystem>
#include <string>

namespace gpusnap {

// A container as its runtime knows it: `runc --root RUNTIME_ROOT state ID`.
struct ContainerRef {
  std::string id;
  std::filesystem::path runtime_root = "/run/runc";
};

}  // namespace gpusnap
