// A host folder mounted into a running container for as long as an object lives. A workload in a
// container sees its own mounts only, so the folders gpusnap makes for it on the host (its memory
// tier's folder at a capture; the artifact's tier folder and the prefill's sockets at a restore
// into a placeholder) would otherwise be out of its reach, and its memory would go the slow way,
// through the driver's checkpoint. No volume of the pod has to be set up for it.
//
// How: a detached bind of the folder is made here (open_tree), then attached inside the
// container's mount namespace (move_mount) by a child that joined that namespace and the
// container's root: a process with threads may not join a mount namespace itself.
#pragma once

#include <sys/types.h>

#include <filesystem>

#include "common/fd.h"

namespace gpusnap::container {

class MountInside {
 public:
  // Mounts `host_dir` at `inside`, an absolute path in the container's root whose parent exists
  // there. The mount point is made as an empty folder (mode 0700); an empty one of that name (a
  // killed gpusnap's, still mounted or not) is removed first. The mount is nosuid, nodev, noexec,
  // and read-only when `read_only`. `target`: a process of the container. Throws
  // Error(kEnvironment) naming the step that failed and why.
  MountInside(pid_t target, const std::filesystem::path& host_dir, std::filesystem::path inside,
              bool read_only);
  // Detaches the mount and removes its folder. The container may have ended by then: its mount
  // namespace lives while this object holds it. Failures are ignored; what a killed gpusnap
  // leaves is an empty mount point, removed by the next mount of that name.
  ~MountInside();
  MountInside(const MountInside&) = delete;
  MountInside& operator=(const MountInside&) = delete;

  // The path inside the container.
  const std::filesystem::path& path() const { return inside_; }

 private:
  common::UniqueFd mnt_ns_;  // the container's mount namespace
  common::UniqueFd root_;    // its root directory, as the target process sees it
  std::filesystem::path inside_;
};

}  // namespace gpusnap::container
