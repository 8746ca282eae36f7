// gpusnap's side of the workload handshake (docs/handshake.md): files in the workload's control
// directory, written atomically, polled by path. Nothing the workload holds open points at
// gpusnap, so the handshake survives the capture; each restored copy gets its own directory
// mounted at the same path.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace gpusnap::engine {

inline constexpr const char* kControlDirEnv = "GPUSNAP_CONTROL_DIR";

// The control directory a process was started with (its GPUSNAP_CONTROL_DIR), if any.
std::optional<std::filesystem::path> control_dir_of(pid_t pid);

class Handshake {
 public:
  explicit Handshake(std::filesystem::path dir) : dir_(std::move(dir)) {}
  const std::filesystem::path& dir() const { return dir_; }

  // Whether the workload has said READY.
  bool ready() const;
  // Waits for READY while `pid` lives. Throws kTimeout, or kHandshake when the process exits.
  void wait_ready(pid_t pid, std::chrono::milliseconds timeout) const;
  // Asks the workload to pause and waits for PAUSED; returns that answer (it may say what the
  // workload released, "released_bytes"). `members` go into the request besides its id and
  // timeout (the memory tier's folder, engine/tier_files.h). Throws kHandshake (FAILED, or the
  // process died) or kTimeout; the workload is then left as it was.
  nlohmann::json pause(pid_t pid, std::chrono::milliseconds timeout,
                       const nlohmann::json& members = nlohmann::json::object());
  // Asks it to resume with `context` and waits for RESUMED. Throws like pause().
  void resume(pid_t pid, const nlohmann::json& context, std::chrono::milliseconds timeout);
  // Asks the workload to resume as the source without waiting for its answer: for one that
  // may be paused when nobody is left to wait (a pause that timed out, a gpusnap killed
  // mid-capture). The pending pause is withdrawn first, so a workload that has not seen it
  // never pauses; one that is running answers at once. Never throws.
  void request_resume_as_source() const noexcept;
  // The same, then waits up to `timeout` for the workload's answer (RESUMED or FAILED) to it:
  // for a workload whose memory tier must be filled from the staging directory before that
  // directory may go. False when no answer came in time, or at once when none of `workload`'s
  // processes is alive any more (a workload that died during the capture never answers, and
  // its capture's error waits on this). Never throws.
  bool resume_as_source_and_wait(std::chrono::milliseconds timeout,
                                 const std::vector<pid_t>& workload) const noexcept;
  // Removes the request and answer files of finished steps.
  void clear_exchange() const noexcept;

 private:
  // Withdraws a pending pause and writes a resume as the source; its id, or "" on failure.
  std::string write_resume_as_source() const noexcept;
  // Writes `request` (with a new id) and waits for `answer` or `failed` with that id; returns
  // the answer.
  nlohmann::json exchange(pid_t pid, const std::string& request, nlohmann::json body,
                          const std::string& answer, std::chrono::milliseconds timeout);

  std::filesystem::path dir_;
};

}  // namespace gpusnap::engine
