// Cuts an artifact into content-addressed chunks.
//
// Two ways to cut, chosen per file:
// - Host images (GPU memory): fixed chunks, counted from the image's first byte of data (its
//   `file_offset`), so the same GPU memory gives the same chunks whatever its address was.
//   Holes are never read (SEEK_DATA), and GPU contents are not compressed (measured: zstd -1
//   saves 26-35 % on bf16 weights at ~0.8 GB/s of decompression per core, slower than the
//   network and disks it would save; docs/benchmarks.md).
// - Every other file (CRIU's images, logs): content-defined chunks on page boundaries. A cut
//   falls after a 4 KiB page whose hash has its low bits zero, so the same memory in two
//   captures gives the same chunks even when other pages before it moved the data by whole
//   pages in CRIU's pages image. These are zstd-compressed when that saves at least a tenth.
// In both, a chunk loses its leading and trailing all-zero 64 KiB blocks, and an all-zero
// chunk is not stored at all: zeros are holes.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"
#include "store/layout.h"

namespace gpusnap::store {

struct ChunkingOptions {
  uint64_t host_image_chunk = 8ull << 20;
  uint64_t cdc_min = 512ull << 10;
  uint64_t cdc_average = 2ull << 20;  // a power of two; the expected distance between cuts
  uint64_t cdc_max = 8ull << 20;
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

using ChunkSink = std::function<void(const Chunk&)>;

// Cuts every file of the artifact (not manifest.json: the layout carries the manifest) and
// calls `sink` once per stored chunk, from several threads at once (it must be thread-safe;
// when it throws, chunking stops and the error is rethrown). Reports progress as phase
// `progress_name` in bytes of the files read. Returns the artifact's layout.
Layout chunk_artifact(const Artifact& artifact, const ChunkingOptions& options,
                      const ChunkSink& sink, Reporter& reporter,
                      std::string_view progress_name = "chunk");

}  // namespace gpusnap::store
