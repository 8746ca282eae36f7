// The memory tier of a capture (docs/memory-tier.md), for engine/checkpoint.cc, on
// top of engine/tier_files.h: the folder the workload drains its tier into at the pause
// (STAGING/tier), what it left there checked, and its files hashed in the background beside CRIU's
// dump (tier-hash). Its memory counts in the GPU facts (GpuCheckpoint::describe).
//
// Destroying it stops the hashing (within a chunk per thread) and waits.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <vector>

#include "engine/tier_files.h"
#include "gpusnap/artifact.h"

namespace gpusnap::engine {

class TierDrain {
 public:
  // `staging`: the artifact's staging directory; `pid`: the workload's root, whose user gets
  // the folder; `threads`: for the hashing.
  TierDrain(std::filesystem::path staging, pid_t pid, int threads)
      : staging_(std::move(staging)), pid_(pid), threads_(threads) {}
  TierDrain(const TierDrain&) = delete;
  TierDrain& operator=(const TierDrain&) = delete;

  // At the pause: makes the folder the pause request names, and returns it.
  std::filesystem::path make_folder();
  // After the pause: checks what the workload left (engine/tier_files.h, check_tier_dir); returns
  // whether the folder is kept, holding anything.
  bool check();
  // What it drained (nothing before check()).
  const TierContents& contents() const { return contents_; }
  // Before the dump: the tier's files, complete since the pause, start being hashed beside it.
  // Not with --leave-running (`leave_running`): see tier_drain.cc.
  void before_dump(uint64_t chunk_bytes, bool leave_running);
  bool hashing() const { return sums_.has_value(); }
  // Phase tier-hash: waits for the sums; the files' records for ArtifactWriter::seal.
  std::vector<FileRecord> hashed() { return sums_->join(); }

 private:
  std::filesystem::path staging_;
  pid_t pid_;
  int threads_;
  std::filesystem::path dir_;
  TierContents contents_;
  std::optional<TierChecksums> sums_;
};

}  // namespace gpusnap::engine
