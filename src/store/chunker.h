// Cuts an artifact into content-addressed chunks.
//
// Three ways to cut, chosen per file:
// - Host images (GPU memory): fixed chunks, counted from the image's first byte of data (its
//   `file_offset`), so the same GPU memory gives the same chunks whatever its address was.
//   Holes are never read (SEEK_DATA), and GPU contents are not compressed (measured: zstd -1
//   saves 26-35 % on bf16 weights at ~0.8 GB/s of decompression per core, slower than the
//   network and disks it would save; docs/benchmarks.md).
// - The memory tier's drain files (tier/PID-wK.img) whose PID.layout the artifact holds: cut
//   where the layout's pieces begin and end, a large piece in fixed chunks from its own start,
//   so the same GPU memory gives the same chunks whatever file and offset the drain's racing
//   workers put it at, and whatever piece lay next to it (plan_tier_cuts below). Compressed as
//   CRIU's images are (below), as they were before. Without a layout that reads, cut as every
//   other file.
// - Every other file (CRIU's images, logs): content-defined chunks on page boundaries. A cut
//   falls after a 4 KiB page whose hash has its low bits zero, so the same memory in two
//   captures gives the same chunks even when other pages before it moved the data by whole
//   pages in CRIU's pages image. These are zstd-compressed when that saves at least a tenth.
// In all, a chunk loses its leading and trailing all-zero 64 KiB blocks, and an all-zero
// chunk is not stored at all: zeros are holes.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"
#include "store/layout.h"

namespace gpusnap::store {

struct ChunkingOptions {
  uint64_t host_image_chunk = 8ull << 20;
  uint64_t cdc_min = 512ull << 10;
  uint64_t cdc_average = 2ull << 20;  // a power of two; the expected distance between cuts
  uint64_t cdc_max = 8ull << 20;
  // Tier pieces smaller than this are glued to their neighbours in the file until the chunk
  // reaches it (never past cdc_max): a model's small tensors (biases, norms) are thousands of
  // pieces but a few MiB, so the chunks they share with whatever lay next to them may be new
  // in every capture without costing more than their own few bytes.
  uint64_t tier_glue_below = 1ull << 20;
  bool compress = true;
  int zstd_level = 1;
  int threads = 8;  // chunks in flight (the sink may wait on a network)
};

// One chunk as it leaves the chunker: where it goes, and the blob that stores it. `blob` is
// valid only during the sink call.
struct Chunk {
  size_t file = 0;  // index into Layout::files
  Extent extent;
  std::string_view blob;
};

// A byte range of a file: a piece of a drain file, or a chunk to be.
struct Cut {
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const Cut&) const = default;
};

// Where a tier drain file of `size` bytes is cut into chunks, given where the layout put its
// pieces (`pieces`, any order): a piece of at least o.tier_glue_below is cut from its own start
// into chunks of o.host_image_chunk; smaller pieces next to each other are glued into one chunk
// of at least that (or what is left of the run); bytes no piece names are cut as a piece of their
// own. The cuts cover the file, in order. Nothing when the pieces do not fit the file (one
// overlapping another, or past its end): the layout is the artifact's, from elsewhere, and then
// says nothing trustworthy about where to cut.
std::optional<std::vector<Cut>> plan_tier_cuts(std::vector<Cut> pieces, uint64_t size,
                                               const ChunkingOptions& options);

using ChunkSink = std::function<void(const Chunk&)>;

// Cuts every file of the artifact (not manifest.json: the layout carries the manifest) and
// calls `sink` once per stored chunk, from several threads at once (it must be thread-safe;
// when it throws, chunking stops and the error is rethrown). Reports progress as phase
// `progress_name` in bytes of the files read. Returns the artifact's layout.
Layout chunk_artifact(const Artifact& artifact, const ChunkingOptions& options,
                      const ChunkSink& sink, Reporter& reporter,
                      std::string_view progress_name = "chunk");

}  // namespace gpusnap::store
