// The host images of a capture (engine/host_images.h), for engine/checkpoint.cc: the GPU memory
// the driver's checkpoint moves into each CUDA process's host memory, stored in files of the
// artifact by gpusnap rather than through CRIU's pages. Two routes:
// - direct: with libgpusnap-preload.so in the process, the driver writes straight into a file
//   of the artifact (requests left just before the driver's checkpoint, withdrawn after it);
// - copying: the new memory found by comparing the mappings before and after, copied into files
//   and mapped back in place.
// Either way the files are named to CRIU as external (criu_keys()), and hashed while the capture
// goes on (host-images-hash).
//
// Its points: made before the preflight (which direct processes; a container's mounts), the
// mappings before the checkpoint (gpu-facts), before and after the driver's checkpoint, phase
// host-images, CRIU's arguments, host-images-hash. Destroying it withdraws what is left of the
// requests, stops the hashing, then removes the mounts and the requests' folder.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/proc.h"
#include "container/mount.h"
#include "engine/host_images.h"
#include "gpusnap/artifact.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/phases.h"

namespace gpusnap::engine {

class CaptureFolder;

class HostImageCapture {
 public:
  // Chooses the CUDA processes (`cuda`) whose GPU memory the driver writes straight into the
  // artifact being staged at `staging`. A container's processes (`in_container`) reach their
  // requests and files through mounts, made now: the room the capture needs is reckoned from
  // the choice. `threads`: for copying and hashing.
  HostImageCapture(std::vector<pid_t> cuda, std::filesystem::path staging,
                   const CheckpointOptions& options, bool in_container, int threads,
                   Reporter& reporter);
  ~HostImageCapture();
  HostImageCapture(const HostImageCapture&) = delete;
  HostImageCapture& operator=(const HostImageCapture&) = delete;

  // The processes whose memory goes straight into the artifact.
  const std::set<pid_t>& direct() const { return direct_; }
  // The requests this capture may leave the preload library (for the dump guardian).
  std::vector<std::filesystem::path> requests() const;

  // In gpu-facts: each CUDA process's mappings, before the driver's checkpoint adds its region.
  void remember_mappings();
  // The driver's checkpoint of a process started without the preload library populates its
  // host memory in one thread: said once, with the way out.
  void note_processes_without_preload() const;
  // In gpu-checkpoint, just before the driver's call (so that no other mapping of the process
  // takes it): the direct processes' requests, and the write-back of what the driver writes.
  void before_gpu_checkpoint();
  // In gpu-checkpoint, after the driver's call: the requests withdrawn; the preload library's
  // helpers, which may still be populating a region ahead of the driver's copy, done (a direct
  // process's overdue helper fails the capture: kTimeout; another's region is left to CRIU).
  void after_gpu_checkpoint();
  // Phase host-images: the direct files adopted, hashed from now on, their regions made private;
  // the rest of the new memory copied into files. Sets manifest.host_images; returns the copied
  // files' records (checksummed as copied) for ArtifactWriter::seal.
  std::vector<FileRecord> store(Manifest& manifest);
  // CRIU's arguments: the images' keys, external files for CRIU's dump.
  static std::vector<std::string> criu_keys(const Manifest& manifest) {
    return criu_external_keys(manifest.host_images);
  }
  bool hashing() const { return hashing_.has_value(); }
  // Phase host-images-hash: waits for the direct files' hashes (filling in their images'
  // stored_bytes in `manifest`); their records for ArtifactWriter::seal.
  std::vector<FileRecord> hashed(Manifest& manifest);

 private:
  std::filesystem::path reach_from_container();
  std::filesystem::path container_host_images_dir(bool read_only = true);
  std::vector<FileRecord> store_copies(Manifest& manifest);

  std::vector<pid_t> cuda_;
  std::filesystem::path staging_;
  const CheckpointOptions& options_;
  bool in_container_;
  int threads_;
  Reporter& reporter_;
  std::set<pid_t> direct_;
  std::filesystem::path requests_dir_;
  // A container's host-images folder mounted into it (container_host_images_dir()), and this
  // capture's preload requests with their mount (reach_from_container()); the mounts go first.
  std::unique_ptr<CaptureFolder> requests_folder_;
  std::optional<container::MountInside> requests_mount_;
  std::optional<container::MountInside> images_mount_;
  std::map<pid_t, std::vector<common::Mapping>> maps_before_;
  std::vector<std::unique_ptr<DirectHostImage>> direct_images_;
  std::optional<WriteBehind> write_behind_;
  std::optional<HashedFiles> hashing_;
};

}  // namespace gpusnap::engine
