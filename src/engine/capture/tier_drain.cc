// The memory tier of a capture (src/engine/capture/tier_drain.h).
#include "engine/capture/tier_drain.h"

namespace gpusnap::engine {

std::filesystem::path TierDrain::make_folder() {
  dir_ = make_tier_dir(staging_, pid_);
  return dir_;
}

bool TierDrain::check() {
  contents_ = check_tier_dir(dir_);
  return !tier_member(dir_).get<std::string>().empty();
}

// The tier's files are hashed beside CRIU's dump, which needs one core; not beside the driver's
// checkpoint, which that slowed by 0.15 s on the H200 (docs/memory-tier.md, "Measured: where
// the tier's files are hashed"). The dump takes 0.1 s longer beside them: a source that runs on
// (--leave-running) is not kept paused for that, and its tier's files are read after it
// resumed, in the checksum phase.
void TierDrain::before_dump(uint64_t chunk_bytes, bool leave_running) {
  if (contents_.files == 0 || leave_running) return;
  sums_.emplace(staging_ / kTierDirName, chunk_bytes, threads_);
}

}  // namespace gpusnap::engine
