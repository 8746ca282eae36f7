// Writes an artifact directory from its layout and its chunks: the files a restore maps,
// exactly as the capture wrote them (host images sparse, starting with the same hole, so that
// a huge-page tmpfs maps them 2 MiB at a time). The directory appears only when complete
// (ArtifactWriter: staging name, fsync, rename).
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include "artifact/writer.h"
#include "gpusnap/phases.h"
#include "store/layout.h"

namespace gpusnap::store {

// Returns the blob's bytes, already checked against its digest. Called from several threads.
using BlobSource = std::function<std::string(const BlobInfo&)>;

// For a reader that uses the artifact while it is written (a restore overlapping its pull:
// store/stream.h). Each hook may throw to stop the writing; nothing then appears at `dest`.
struct ArrivalHooks {
  // Every file exists in the staging directory at its size, and its manifest.json is there:
  // Artifact::open of the staging directory works, the files' bytes still arrive.
  std::function<void(const std::filesystem::path& staging)> created;
  // Every byte of the file at `path` (relative) is written (from the writing threads).
  std::function<void(const std::string& path)> file_written;
  // The first `bytes` of the file at `path` are written (its holes included), called each time
  // that prefix grows, from the writing threads, one call at a time: a reader may take those
  // bytes while the rest still arrives (a memory tier's fill, store/stream.h).
  std::function<void(const std::string& path, uint64_t bytes)> prefix_written;
  // Before each chunk is fetched (from the writing threads).
  std::function<void()> before_chunk;
  // Every file is written; the commit (the rename to `dest`) waits for this to return.
  std::function<void()> before_commit;
  // The artifact is at `dest`, whole: what follows (the node cache's record) is the pull's own.
  std::function<void()> committed;
};

// The files that hold GPU memory: host images (the driver's restore reads them) and the memory
// tier's drain files (tier/PID-wK.img, read by its fill). Written after every other file, the
// drain files last: CRIU's images and the tier's small index and layout files come first, so a
// restore overlapping the pull starts on them (store/stream.h).
bool holds_gpu_memory(const std::string& path);
// The memory tier's drain files (tier/PID-wK.img): the last of a pull, read by the tier's fill
// alone.
bool is_tier_drain_file(const std::string& path);

struct MaterialiseOptions {
  int threads = 8;
  std::string progress_name = "materialise";
  // On a failure the staging directory stays, hidden, with what was written: a pull resumes
  // from it (store/transfer.h). Otherwise it is removed, and so it is after a write that found
  // no space (ENOSPC, EDQUOT) whatever this says: it would only keep the filesystem full.
  bool keep_partial = false;
  // A staging directory an earlier materialise of `dest` left (taken over, lock included):
  // written into again, every uncompressed extent already there intact (checked against its
  // digest) kept as it is and not asked of the source. Null or empty: a new one.
  artifact::StagingDir* resume = nullptr;
  // Where the staging directory is recorded for `gpusnap recover` (WriterOptions::run_dir).
  std::filesystem::path run_dir;
  ArrivalHooks arrival;
};

// CPU seconds the writing threads spent, summed over them: where a transfer's CPU goes when it,
// not the link, bounds it (docs/store.md, "Where a pull's CPU goes").
struct TransferCpu {
  double fetch = 0;   // in the BlobSource: receiving and checking the digest, or a cache's read
  double decode = 0;  // decompressing zstd chunks
  double write = 0;   // finding the holes and writing the files
};

struct MaterialiseResult {
  uint64_t extents_kept = 0;  // found intact in a resumed staging directory
  uint64_t bytes_kept = 0;
  TransferCpu cpu;
};

// Writes the artifact at `dest` (which must not exist; its parent must). Every chunk is
// decompressed and checked for its exact length. On any failure nothing appears at `dest`.
// Throws Error(kBadArtifact) for a chunk that does not decode to its extent.
MaterialiseResult materialise(const Layout& layout, const std::filesystem::path& dest,
                              const BlobSource& source, const MaterialiseOptions& options,
                              Reporter& reporter);

}  // namespace gpusnap::store
