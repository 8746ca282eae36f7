#include "engine/preload.h"

#include <unistd.h>

#include <cstdlib>
#include <system_error>

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

bool maps_preload_library(const std::vector<Mapping>& maps) {
  for (const auto& m : maps) {
    if (std::filesystem::path(m.path).filename() == kPreloadFileName) return true;
  }
  return false;
}

}  // namespace gpusnap::engine
