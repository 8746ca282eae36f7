// The fill of a copy's memory tier done ahead, in a process of its own, while the copy is
// still being restored (docs/memory-tier.md): gpusnap-tier-prefill reads the
// layout the drain left (tier/layout.h), makes physical memory for every segment on the GPU the
// copy will run on, fills it from the artifact's files at line rate, and offers it to the copy
// (tier/handover.h). At its resume the copy's tier maps that memory at its own addresses
// (Tier::adopt) instead of filling: the fill leaves the restore's critical path, where it
// followed CRIU's restore and the driver's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <stop_token>
#include <string>
#include <vector>

#include "tier/arrival.h"
#include "tier/layout.h"
#include "tier/memory_tier.h"
#include "tier/tier_driver.h"

namespace gpusnap::tier {

// A drain file's checksums as the prefill read it: XXH3-128 of each `chunk_bytes` of the file,
// hex, as the artifact's manifest records them. gpusnap compares them with the manifest instead of
// reading the file a second time (docs/memory-tier.md, "The fill done ahead"). `complete` only when
// the pieces covered the file from its first byte without a gap: only then are they the file's.
struct FileSums {
  std::string name;
  std::uint64_t size = 0;  // bytes hashed, from the first
  std::vector<std::string> chunks;
  bool complete = true;
};

class Prefill {
 public:
  // `layout` as read_layout() returns it from DIR/PID.layout (segments sorted, pieces inside);
  // `files` the drain's files in order (PID-wK.img); `device` the GPU, in this process's numbering,
  // the copy runs this memory on; `chunk_bytes` the artifact's checksum chunk (0: no sums);
  // `arriving` (null: every file is there) the files' bytes as a pull writes them: the fill
  // reads none before it is there.
  Prefill(TierDriver& driver, TierSettings settings, TierLayout layout, std::filesystem::path dir,
          std::vector<std::string> files, int device, std::uint64_t chunk_bytes = 0,
          ArrivingFiles* arriving = nullptr);
  // Unmaps and releases everything it made; the copy's imported handles keep their memory.
  ~Prefill();
  Prefill(const Prefill&) = delete;
  Prefill& operator=(const Prefill&) = delete;

  // Makes shareable memory for every segment, maps it at addresses of this process, and copies
  // every piece into it, each piece as soon as its segment is mapped. Throws Error (out of GPU
  // memory: kGpu), having released what it made.
  TransferReport fill();
  // After fill(), with chunk_bytes: the checksums of every file, as read for the copy.
  const std::vector<FileSums>& sums() const { return sums_; }
  // Offers the memory on the connection `sock` (tier/handover.h) and waits for the copy's
  // answer: true once the copy has mapped it.
  bool hand_over(int sock);

 private:
  struct Made {
    LayoutSegment segment;  // in the copy
    DevicePtr here = 0;     // where this process maps it
    Handle handle = 0;
    bool mapped = false;
  };
  // The layout's pieces at their addresses in this process (base_ plus the segment's offset), in
  // address order, and the index of the segment each lies in.
  struct PlacedPieces {
    std::vector<FilePiece> pieces;
    std::vector<std::size_t> segment_of;
  };
  PlacedPieces place_pieces() const;
  // Makes, maps and opens to this device the memory of every segment in address order, each at
  // base_ plus its offset, calling `mapped_one` after each; stops early when `stop` is requested.
  // Runs on a thread of its own while the workers copy (fill()). Throws Error (kGpu).
  void make(const std::stop_token& stop, const std::function<void()>& mapped_one);
  void release_all() noexcept;

  TierDriver& driver_;
  const TierSettings settings_;
  const TierLayout layout_;
  const std::filesystem::path dir_;
  const std::vector<std::string> files_;
  const int device_;
  const std::uint64_t chunk_bytes_;
  ArrivingFiles* const arriving_;
  std::vector<FileSums> sums_;
  DevicePtr base_ = 0;
  std::size_t reserved_ = 0;
  std::vector<Made> made_;
};

}  // namespace gpusnap::tier
