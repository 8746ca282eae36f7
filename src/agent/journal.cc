#include "agent/journal.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>

#include "common/fs.h"
#include "gpusnap/error.h"

namespace gpusnap::agent {

Journal::Journal(const std::filesystem::path& state_dir) : dir_(state_dir / "operations") {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw sys_error("create " + dir_.string(), ec.value());
  if (::chmod(dir_.c_str(), 0700) != 0) throw sys_error("chmod " + dir_.string(), errno);
}

void Journal::record(const std::string& id, const nlohmann::json& entry) {
  fs::write_file_durable(dir_ / (id + ".json"), entry.dump(2) + "\n");
}

void Journal::erase(const std::string& id) noexcept {
  std::error_code ec;
  std::filesystem::remove(dir_ / (id + ".json"), ec);
  // Durable too: an entry that comes back after a power cut would report an operation that
  // ended as interrupted. Best effort: the caller cannot act on a failure.
  try {
    fs::fsync_path(dir_);
  } catch (const std::exception&) {
  }
}

std::vector<Journal::Leftover> Journal::leftovers() const noexcept {
  std::vector<Leftover> out;
  try {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
      const auto& path = e.path();
      if (path.extension() == ".tmp") {
        // A write that did not reach its rename: the entry it was replacing (if any) holds.
        std::filesystem::remove(path, ec);
        continue;
      }
      if (path.extension() != ".json") continue;
      Leftover l{path, nullptr, {}};
      try {
        l.entry = nlohmann::json::parse(fs::read_file(path));
        if (!l.entry.is_object() || !l.entry.contains("id") || !l.entry.contains("kind")) {
          l.problem = "not an operation entry";
          l.entry = nullptr;
        }
      } catch (const std::exception& err) {
        l.problem = err.what();
        l.entry = nullptr;
      }
      out.push_back(std::move(l));
    }
  } catch (const std::exception&) {
    // Out of memory while listing: what was read is returned, the rest waits for the next
    // start.
  }
  std::sort(out.begin(), out.end(),
            [](const Leftover& a, const Leftover& b) { return a.path < b.path; });
  return out;
}

void Journal::discard(const Leftover& leftover) noexcept {
  std::error_code ec;
  std::filesystem::remove(leftover.path, ec);
}

}  // namespace gpusnap::agent
