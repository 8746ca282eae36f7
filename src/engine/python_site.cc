#include "engine/python_site.h"

#include <unistd.h>

#include <cstdlib>
#include <system_error>

#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

// The files gpusnap's sitecustomize needs beside it.
bool is_site_folder(const std::filesystem::path& dir) {
  for (const char* name : {"sitecustomize.py", "gpusnap_handshake.py"}) {
    if (::access((dir / name).c_str(), R_OK) != 0) return false;
  }
  return true;
}

}  // namespace

std::filesystem::path find_python_site() {
  const std::string fix =
      std::string("point ") + kPythonSiteEnv +
      " at gpusnap's Python folder (python/ beside gpusnap: the build tree's, or "
      "/opt/gpusnap/bin/python on a node), or run without --memory-tier and call "
      "gpusnap_handshake.use_memory_tier() in the workload";
  if (const char* named = std::getenv(kPythonSiteEnv); named != nullptr && *named != '\0') {
    auto dir = std::filesystem::absolute(named);
    if (!is_site_folder(dir)) {
      throw Error(ErrorKind::kUsage,
                  std::string(kPythonSiteEnv) + " names " + dir.string() +
                      ", which holds no readable sitecustomize.py and gpusnap_handshake.py",
                  fix);
    }
    return dir;
  }
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::vector<std::filesystem::path> candidates;
  if (!ec) candidates.push_back(exe.parent_path() / "python");
  candidates.emplace_back(kInstalledPythonSite);
  std::string looked;
  for (const auto& dir : candidates) {
    if (is_site_folder(dir)) return dir;
    looked += (looked.empty() ? "" : " nor ") + dir.string();
  }
  throw Error(ErrorKind::kUsage,
              "--memory-tier needs gpusnap's Python site folder: neither " + looked +
                  " holds sitecustomize.py and gpusnap_handshake.py",
              fix);
}

std::vector<std::string> memory_tier_environment(const std::filesystem::path& site) {
  std::string path = site.string();
  // Ours first: Python imports the first sitecustomize on the path (ours imports the next).
  if (const char* existing = std::getenv("PYTHONPATH"); existing != nullptr && *existing != '\0') {
    path += std::string(":") + existing;
  }
  return {"PYTHONPATH=" + path, std::string(kMemoryTierEnv) + "=1"};
}

}  // namespace gpusnap::engine
