// The workload of a capture that speaks the handshake (src/engine/capture/paused_workload.h).
#include "engine/capture/paused_workload.h"

#include "common/fs.h"
#include "engine/tier_files.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

PausedWorkload::PausedWorkload(const CheckpointOptions& options, bool in_container,
                               Reporter& reporter)
    : pid_(options.pid),
      timeout_(options.handshake_timeout),
      in_container_(in_container),
      reporter_(reporter) {
  if (!options.handshake) return;
  auto dir =
      options.control_dir.empty() ? control_dir_of(pid_) : std::optional(options.control_dir);
  if (!dir) return;
  control_dir_ = *dir;
  // A container's workload names its directory in its own root.
  if (in_container_) dir = "/proc/" + std::to_string(pid_) + "/root" + dir->string();
  Handshake handshake(*dir);
  if (handshake.ready()) handshake_.emplace(std::move(handshake));
}

PausedWorkload::~PausedWorkload() {
  if (!paused_ || done_) return;
  try {
    resume_as_source();
  } catch (const Error& e) {
    reporter_.note(std::string("the workload did not resume after the failed capture: ") +
                   e.what());
  }
}

std::filesystem::path PausedWorkload::dir() const {
  return handshake_ ? handshake_->dir() : std::filesystem::path();
}

void PausedWorkload::pause(const std::filesystem::path& tier_dir) {
  tier_path_ = reachable(tier_dir).string();
  auto answer = handshake_->pause(pid_, timeout_, {{"tier_dir", tier_path_}});
  paused_ = true;
  auto released = answer.find("released_bytes");
  if (released != answer.end() && released->is_number_unsigned() && released->get<uint64_t>() > 0) {
    reporter_.note("the workload released " + fs::human_bytes(released->get<uint64_t>()) + " (" +
                   std::to_string(released->get<uint64_t>()) +
                   " bytes) of cached free GPU memory at the pause: it is not captured");
  }
}

void PausedWorkload::keep_tier(bool kept) { tier_dir_ = kept ? tier_path_ : std::string(); }

void PausedWorkload::resume(const std::string& artifact_id) {
  artifact_id_ = artifact_id;
  resume_as_source();
  tier_mount_.reset();  // filled back: the workload reads the folder no more
}

void PausedWorkload::commit() {
  if (!paused_) return;
  done_ = true;
  handshake_->clear_exchange();
}

void PausedWorkload::resume_as_source() {
  done_ = true;
  handshake_->clear_exchange();
  handshake_->resume(pid_,
                     {{"restored", false},
                      {"copy", 0},
                      {"copies", 1},
                      {"artifact_id", artifact_id_},
                      {"gpu_map", nlohmann::json::object()},
                      {"settings", nlohmann::json::object()},
                      {"tier_dir", tier_dir_}},
                     timeout_);
  handshake_->clear_exchange();
}

// A container's workload sees its own mounts only: the folder is mounted into its handshake
// directory (container/mount.h). Where that cannot be done, the host's path, which reaches the
// folder only when the container mounts the staging directory's volume at the same path; where
// it does not, the tier says so and its memory goes with the driver's checkpoint: slower, never
// wrong.
std::filesystem::path PausedWorkload::reachable(const std::filesystem::path& tier_dir) {
  if (!in_container_) return tier_dir;
  try {
    tier_mount_.emplace(pid_, tier_dir, control_dir_ / kTierMountName, false);
    return tier_mount_->path();
  } catch (const Error& e) {
    reporter_.note(std::string("memory tier: ") + e.what());
    return tier_dir;
  }
}

}  // namespace gpusnap::engine
