// What a drain leaves besides the contents and the index: PID.layout, every segment of the
// process's tier and where each live piece of it went. With it another process
// (gpusnap-tier-prefill, tier/prefill.h) rebuilds the memory of a copy from the artifact while
// the copy itself is still being restored, and hands it over (docs/memory-tier.md).
//
// The file is little-endian 64-bit words: the magic "GSTLAY01", the counts of segments, pieces
// and files, then each segment (va, size, device), then each piece (va, size, file, offset).
// Fixed-size records: the reader bounds everything before it allocates, by the folder's bounds
// (tier/folder_format.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <vector>

#include "tier/tier_driver.h"

namespace gpusnap::tier {

struct LayoutSegment {
  DevicePtr va = 0;
  std::size_t size = 0;
  int device = 0;
};

// A piece of live memory and where a drain put it: `size` bytes at `va` on `device`, in the
// drain's file number `file` (PID-wFILE.img) at `offset`.
struct FilePiece {
  DevicePtr va = 0;
  std::size_t size = 0;
  int device = 0;
  std::size_t file = 0;
  std::uint64_t offset = 0;
};

struct TierLayout {
  std::vector<LayoutSegment> segments;
  std::vector<FilePiece> pieces;
  std::size_t files = 0;
};

// Writes `layout` to `path` (through PATH.tmp and a rename, mode 0600). Throws Error(kInternal).
void write_layout(const std::filesystem::path& path, const TierLayout& layout);
// Reads and checks a layout: the magic, the counts against the file's size and the bounds,
// every piece inside one segment. Throws Error(kBadArtifact) naming what is wrong.
TierLayout read_layout(const std::filesystem::path& path);

}  // namespace gpusnap::tier
