// Writes an artifact directory from its layout and its chunks: the files a restore maps,
// exactly as the capture wrote them (host images sparse, starting with the same hole, so that
// a huge-page tmpfs maps them 2 MiB at a time). The directory appears only when complete
// (ArtifactWriter: staging name, fsync, rename).
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include "gpusnap/phases.h"
#include "store/layout.h"

namespace gpusnap::store {

// Returns the blob's bytes, already checked against its digest. Called from several threads.
using BlobSource = std::function<std::string(const BlobInfo&)>;

struct MaterialiseOptions {
  int threads = 8;
  // Order in which files are written: by default CRIU's images first, host images last (a
  // restore can start on the CPU images while GPU memory still arrives).
  std::string progress_name = "materialise";
};

// Writes the artifact at `dest` (which must not exist; its parent must). Every chunk is
// decompressed and checked for its exact length. On any failure nothing appears at `dest`.
// Throws Error(kBadArtifact) for a chunk that does not decode to its extent.
void materialise(const Layout& layout, const std::filesystem::path& dest, const BlobSource& source,
                 const MaterialiseOptions& options, Reporter& reporter);

}  // namespace gpusnap::store
