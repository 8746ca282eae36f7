#include "engine/preload.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <system_error>
#include <thread>

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

bool has_fill_thread(pid_t pid) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/task", ec), end;
       !ec && it != end; it.increment(ec)) {
    std::ifstream comm(it->path() / "comm");
    std::string name;
    if (std::getline(comm, name) && name == kFillThreadName) return true;
  }
  return false;  // none, or the process is gone: nothing of it is being populated
}

}  // namespace

std::vector<pid_t> wait_for_fill_threads(const std::vector<pid_t>& pids,
                                         std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<pid_t> filling = pids;
  for (;;) {
    std::erase_if(filling, [](pid_t pid) { return !has_fill_thread(pid); });
    if (filling.empty() || std::chrono::steady_clock::now() >= deadline) return filling;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace gpusnap::engine
