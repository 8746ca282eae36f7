#include "engine/dump_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "engine/gpu_state.h"
#include "engine/handshake.h"
#include "engine/preload.h"
#include "engine/tier_files.h"
#include "gpu/driver.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

constexpr int kControlFd = 3;
constexpr int kStatusFd = 4;
// The capture lock, held open (never read) until the guardian exits: its dump and its rollback
// are part of the capture, and another capture of the tree must wait for them.
constexpr int kCaptureLockFd = 5;

// Reads exactly `size` bytes; false on EOF or an error (the other side is gone).
bool read_exact(int fd, void* data, size_t size) {
  size_t got = 0;
  while (got < size) {
    ssize_t n = ::read(fd, static_cast<char*>(data) + got, size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  return true;
}

bool write_exact(int fd, const void* data, size_t size) {
  size_t put = 0;
  while (put < size) {
    ssize_t n = ::write(fd, static_cast<const char*>(data) + put, size - put);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    put += static_cast<size_t>(n);
  }
  return true;
}

// How long the guardian waits for a workload to fill its memory tier from the staging
// directory before removing it: a fill runs at tens of GB/s, so this bounds only a workload that
// hangs (one that died ends the wait at once: the capture's error waits on the guardian).
constexpr std::chrono::milliseconds kTierFillWait{120000};
// How long the guardian waits for the preload library's remap watchers to leave.
constexpr std::chrono::milliseconds kRemapCancelWait{2000};

// Whether the tier's folder holds anything: a drain started (it may still be writing). The
// folder is renamed away while it is looked at, so that no drain can create its files in it
// unseen: a drain that starts meanwhile fails to create them and releases nothing; a drain
// that had created them is seen, and the folder goes back for its fill (the tier checks that its
// files are still in the folder before it releases any memory).
bool tier_dir_in_use(const std::filesystem::path& dir) {
  std::filesystem::path aside = dir;
  aside += ".closed";
  if (::rename(dir.c_str(), aside.c_str()) != 0) return false;  // no tier folder
  std::error_code ec;
  const bool in_use = !std::filesystem::is_empty(aside, ec) || ec;
  if (in_use && ::rename(aside.c_str(), dir.c_str()) != 0) return false;
  return in_use;
}

// CRIU as the guardian's child, to the end whatever happens to gpusnap.
common::ExitStatus run_dump(const nlohmann::json& request) {
  const auto output = request.at("output").get<std::string>();
  common::UniqueFd out(::open(output.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  common::SpawnOptions o;
  o.argv = request.at("argv").get<std::vector<std::string>>();
  o.stdout_fd = out.get();
  o.stderr_fd = out.get();
  o.kill_with_parent = false;  // CRIU must finish even if we are killed
  common::Subprocess criu(o);
  return *criu.wait();
}

}  // namespace

int dump_guard_main(const std::string& spec_json) {
  auto spec = nlohmann::json::parse(spec_json);
  // gpusnap may be gone by the time we report to it: a write to its closed pipe must fail
  // with EPIPE, not kill us before we clean up.
  ::signal(SIGPIPE, SIG_IGN);
  for (;;) {
    char word = 0;
    if (!read_exact(kControlFd, &word, 1)) break;  // EOF: gpusnap failed or died
    if (word == 'C') return 0;
    uint32_t size = 0;
    if (word != 'D' || !read_exact(kControlFd, &size, sizeof size)) break;
    std::string request(size, '\0');
    if (!read_exact(kControlFd, request.data(), size)) break;
    common::ExitStatus status = run_dump(nlohmann::json::parse(request));
    int encoded[2] = {status.exited ? 1 : 0, status.code};
    (void)write_exact(kStatusFd, encoded, sizeof encoded);
  }
  // A request nobody took must not send a later mapping into a removed artifact (the library
  // would only fail to open the file, but the request is ours to take back).
  const auto preload_requests = spec.value("preload_requests", std::vector<std::string>{});
  for (const auto& request : preload_requests) ::unlink(request.c_str());
  // A remap watcher the library started for this capture leaves now, whether or not gpusnap
  // asked it to act: it must not wait in the process for a request nobody will send.
  const auto gpu_pids = spec.at("gpu_pids").get<std::vector<pid_t>>();
  cancel_remap_watchers(gpu_pids, {preload_requests.begin(), preload_requests.end()},
                        kRemapCancelWait);
  const auto staging = spec.at("staging").get<std::string>();
  // A memory tier that drained into the staging directory has its contents only there: the
  // workload must fill them back before the directory goes (docs/memory-tier.md).
  const bool tier_holds_memory = tier_dir_in_use(std::filesystem::path(staging) / kTierDirName);
  if (!tier_holds_memory) fs::remove_tree_noexcept(staging);
  // The workload's GPU state back first, then its own resume: the order gpusnap itself keeps.
  // Rather now than leave the workload blocked in its next CUDA call, or paused, until someone
  // runs gpusnap again.
  if (!gpu_pids.empty()) {
    auto driver = gpu::open_nvidia_driver();
    if (driver->available()) return_to_running(*driver, gpu_pids);
  }
  if (auto dir = spec.at("control_dir").get<std::string>(); !dir.empty()) {
    if (tier_holds_memory) {
      (void)Handshake(dir).resume_as_source_and_wait(
          kTierFillWait, spec.value("workload_pids", std::vector<pid_t>{}));
    } else {
      Handshake(dir).request_resume_as_source();
    }
  }
  if (tier_holds_memory) fs::remove_tree_noexcept(staging);
  return 0;
}

CaptureGuard::CaptureGuard(const std::string& helper, const std::filesystem::path& staging,
                           const std::vector<pid_t>& gpu_pids,
                           const std::vector<pid_t>& workload_pids,
                           const std::filesystem::path& control_dir,
                           const std::vector<std::filesystem::path>& preload_requests,
                           int capture_lock_fd) {
  common::Pipe control = common::Pipe::make();
  common::Pipe status = common::Pipe::make();
  common::SpawnOptions o;
  // A separate program rather than a forked function: gpusnap may have driver threads by now.
  std::vector<std::string> requests;
  requests.reserve(preload_requests.size());
  for (const auto& r : preload_requests) requests.push_back(r.string());
  nlohmann::json spec{{"staging", staging.string()},
                      {"gpu_pids", gpu_pids},
                      {"workload_pids", workload_pids},
                      {"control_dir", control_dir.string()},
                      {"preload_requests", requests}};
  o.argv = {helper, "__dump-guard", spec.dump()};
  o.keep_fds = {{control.read.get(), kControlFd}, {status.write.get(), kStatusFd}};
  if (capture_lock_fd >= 0) o.keep_fds.push_back({capture_lock_fd, kCaptureLockFd});
  o.kill_with_parent = false;
  o.new_session = true;  // a Ctrl-C meant for gpusnap must not reach CRIU
  guardian_.emplace(o);
  control_ = std::move(control.write);
  status_ = std::move(status.read);
}

CaptureGuard::~CaptureGuard() {
  control_.reset();  // EOF without 'C': the guardian puts things back once CRIU is done
  guardian_->wait();
  guardian_->release();
}

common::ExitStatus CaptureGuard::dump(const std::vector<std::string>& criu_argv,
                                      const std::filesystem::path& criu_output) {
  const std::string request =
      nlohmann::json{{"argv", criu_argv}, {"output", criu_output.string()}}.dump();
  const auto size = static_cast<uint32_t>(request.size());
  const char word = 'D';
  if (!write_exact(control_.get(), &word, 1) || !write_exact(control_.get(), &size, sizeof size) ||
      !write_exact(control_.get(), request.data(), request.size())) {
    throw Error(ErrorKind::kCriu, "the capture's guardian process died before CRIU's dump");
  }
  int encoded[2] = {0, 0};
  if (!read_exact(status_.get(), encoded, sizeof encoded)) {
    throw Error(ErrorKind::kCriu, "the process running CRIU's dump died");
  }
  return common::ExitStatus{encoded[0] == 1, encoded[1]};
}

void CaptureGuard::commit() {
  const char word = 'C';
  if (!write_exact(control_.get(), &word, 1)) throw sys_error("tell the capture's guardian", errno);
  control_.reset();
}

}  // namespace gpusnap::engine
