// The layout of an artifact in the store: which chunk (by sha256) holds which byte range of
// which file. Ranges no extent covers are zeros (holes when materialised). The layout is the
// OCI config blob of a pushed snapshot and the record of a snapshot in the node cache; with the
// chunks it names, it is the whole artifact.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpusnap/artifact.h"

namespace gpusnap::store {

inline constexpr const char* kLayoutFormat = "gpusnap-layout";
inline constexpr int kLayoutVersion = 1;
// No chunk is larger, stored or not: what a reader must be ready to hold in memory.
inline constexpr uint64_t kMaxChunkBytes = 32ull << 20;

// How a chunk's bytes are stored: as they are, zstd, or zstd of their byte split
// (store/byte_split.h). Chosen per chunk from its bytes alone (store/chunker.h).
enum class Encoding { kRaw, kZstd, kZstdSplit2 };

struct Extent {
  uint64_t offset = 0;  // in the file
  uint64_t length = 0;  // bytes of the file it fills
  std::string digest;   // sha256 of the blob as stored (compressed or not)
  Encoding encoding = Encoding::kRaw;
  uint64_t stored = 0;  // the blob's size
};

struct FileLayout {
  std::string path;  // relative to the artifact root
  uint64_t size = 0;
  std::vector<Extent> extents;  // sorted, disjoint
};

struct BlobInfo {
  std::string digest;
  uint64_t size = 0;
  Encoding encoding = Encoding::kRaw;
};

// The implicit move reaches nlohmann::json's assert_invariant(), which is not declared
// noexcept but throws nothing.
// NOLINTNEXTLINE(bugprone-exception-escape)
struct Layout {
  nlohmann::json manifest;  // the artifact's manifest.json
  std::vector<FileLayout> files;

  uint64_t apparent_bytes() const;  // sum of the file sizes
  uint64_t data_bytes() const;      // bytes covered by extents (not zeros)
  // Every distinct blob, in first-use order, and the sum of their sizes: what the snapshot
  // costs a store that holds nothing else.
  std::vector<BlobInfo> blobs() const;
  uint64_t stored_bytes() const;

  nlohmann::json to_json() const;
  // Checks everything (format, bounds, digests, extents inside their file and disjoint, the
  // manifest valid and listing exactly the files the layout has, at the same sizes). Throws
  // Error(kBadArtifact) naming the first problem.
  static Layout from_json(const nlohmann::json& doc);
};

}  // namespace gpusnap::store
