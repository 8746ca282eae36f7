#include "engine/preload.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <system_error>
#include <thread>

#include "common/fd.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

std::optional<std::filesystem::path> find_preload_library() {
  if (const char* named = std::getenv(kPreloadEnv); named != nullptr) {
    if (*named == '\0') return std::nullopt;
    auto path = std::filesystem::absolute(named);
    if (::access(path.c_str(), R_OK) != 0) {
      throw Error(ErrorKind::kUsage,
                  std::string(kPreloadEnv) + " names " + path.string() + ", which cannot be read",
                  std::string("point it at ") + kPreloadFileName +
                      ", or set it empty to start workloads without it");
    }
    return path;
  }
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return std::nullopt;
  for (const auto& candidate :
       {exe.parent_path() / kPreloadFileName,
        exe.parent_path().parent_path() / "lib" / "gpusnap" / kPreloadFileName}) {
    if (::access(candidate.c_str(), R_OK) == 0) return candidate;
  }
  return std::nullopt;
}

std::optional<std::string> preload_environment() {
  auto library = find_preload_library();
  if (!library) return std::nullopt;
  std::string value = library->string();
  // Ours first: it must see the driver's mmap before any other library that wraps it.
  if (const char* existing = std::getenv("LD_PRELOAD"); existing != nullptr && *existing != '\0') {
    value += std::string(":") + existing;
  }
  return "LD_PRELOAD=" + value;
}

bool maps_preload_library(const std::vector<common::Mapping>& maps) {
  for (const auto& m : maps) {
    if (std::filesystem::path(m.path).filename() == kPreloadFileName) return true;
  }
  return false;
}

namespace {

// Waits up to `limit` until `done()`, asking every 2 ms; false when it never was.
template <typename Done>
bool wait_until(Done done, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

}  // namespace

bool has_thread_named(pid_t pid, const char* name) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/task", ec), end;
       !ec && it != end; it.increment(ec)) {
    std::ifstream comm(it->path() / "comm");
    std::string comm_name;
    if (std::getline(comm, comm_name) && comm_name == name) return true;
  }
  return false;  // none, or the process is gone
}

void write_preload_request(const std::filesystem::path& path, const std::string& text) {
  auto temp = path;
  temp += ".tmp";
  {
    common::UniqueFd out(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!out || ::fchmod(out.get(), 0600) != 0 ||
        ::write(out.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
      const int err = errno;
      ::unlink(temp.c_str());
      throw sys_error("write " + temp.string(), err);
    }
  }
  // Renamed into place whole: the library never reads half a request.
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    throw sys_error("rename " + temp.string(), err);
  }
}

std::filesystem::path remap_request_path(const std::filesystem::path& preload_request) {
  auto path = preload_request;
  path += ".remap";
  return path;
}

bool remap_in_process(pid_t pid, const std::filesystem::path& preload_request,
                      const RemapRequest& range, std::chrono::milliseconds limit) {
  std::ostringstream text;
  text << std::hex << range.start << " " << range.end << " " << std::dec << range.offset << " "
       << range.prot << " " << range.advice << "\n";
  const auto request = remap_request_path(preload_request);
  write_preload_request(request, text.str());
  if (wait_until([&] { return !has_thread_named(pid, kRemapThreadName); }, limit)) {
    // The watcher removes what it took, unless it reached the request through a read-only
    // mount (a container's).
    ::unlink(request.c_str());
    return true;
  }
  cancel_remap_watchers({pid}, {preload_request}, limit);
  return false;
}

void cancel_remap_watchers(const std::vector<pid_t>& pids,
                           const std::vector<std::filesystem::path>& requests,
                           std::chrono::milliseconds limit) noexcept {
  const auto watching = [&] {
    return std::any_of(pids.begin(), pids.end(),
                       [](pid_t pid) { return has_thread_named(pid, kRemapThreadName); });
  };
  if (!watching()) return;
  for (const auto& r : requests) {
    try {
      // A request already there (a remap asked for) is left to be taken as it is.
      if (!std::filesystem::exists(remap_request_path(r))) {
        write_preload_request(remap_request_path(r), "cancel\n");
      }
    } catch (...) {  // NOLINT(bugprone-empty-catch): the watcher then leaves at its lifetime
    }
  }
  (void)wait_until([&] { return !watching(); }, limit);
  for (const auto& r : requests) ::unlink(remap_request_path(r).c_str());
}

std::vector<pid_t> wait_for_fill_threads(const std::vector<pid_t>& pids,
                                         std::chrono::milliseconds limit) {
  std::vector<pid_t> filling = pids;
  (void)wait_until(
      [&] {
        std::erase_if(filling, [](pid_t pid) { return !has_thread_named(pid, kFillThreadName); });
        return filling.empty();
      },
      limit);
  return filling;
}

}  // namespace gpusnap::engine
