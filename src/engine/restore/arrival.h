// An artifact still arriving while it restores (RestoreOptions::arriving: a pull overlapping the
// restore), for engine/restore.cc. The restore opens it from its staging directory, gives CRIU
// its images as soon as they are there (await-criu-images), and takes the rest where it first
// needs it (await-artifact): before CRIU without GPU state (CRIU's restore lets the copies run),
// else once the copies are located, when CRIU no longer reads the staging directory and the
// artifact may take its final name. The host images were handed to CRIU as descriptors, which
// the rename leaves valid; their bytes are first read by the driver's restore. The tier's drain
// files are read as they arrive by its prefills (they reach the folder through a descriptor,
// which the rename leaves valid too), else by the copies at the resume.
#pragma once

#include <filesystem>

#include "gpusnap/artifact.h"
#include "gpusnap/restore.h"

namespace gpusnap::engine {

class Arrival {
 public:
  // `arriving`: nullptr for an artifact that is all there.
  explicit Arrival(ArrivingArtifact* arriving) : arriving_(arriving) {}

  // At open: where the manifest is read (its staging directory while it arrives), of an artifact
  // that is at `artifact` once it is all there.
  std::filesystem::path open_path(const std::filesystem::path& artifact) const {
    return arriving_ != nullptr ? arriving_->staging() : artifact;
  }
  // Phase await-criu-images.
  void await_criu_images() { arriving_->await_criu_images(); }
  // Phase await-host-images: every file but the tier's drain files, which only the tier reads.
  void await_host_images() { arriving_->await_host_images(); }
  // The artifact still arriving, for the tier's prefills that read it as it arrives; null for
  // one that is all there.
  ArrivingArtifact* still_arriving() const { return arriving_; }
  // Phase await-artifact: every byte is there; the artifact under its final name.
  std::filesystem::path await_all() { return arriving_->complete(); }

 private:
  ArrivingArtifact* arriving_;
};

}  // namespace gpusnap::engine
