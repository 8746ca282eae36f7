#include "engine/tier.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "gpusnap/error.h"

namespace gpusnap::engine {
namespace {

namespace stdfs = std::filesystem;
using nlohmann::json;

Error bad_entry(const stdfs::path& dir, const std::string& name, const std::string& why) {
  return Error(
      ErrorKind::kHandshake,
      "the workload left " + (dir / name).string() + " in its memory tier's folder: " + why,
      "only libgpusnap-tier.so writes there; check what else the workload does at "
      "its pause");
}

// The effective uid and gid of `pid` (the second field of the Uid: and Gid: lines).
std::pair<uid_t, gid_t> owner_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  uid_t uid = 0;
  gid_t gid = 0;
  bool got_uid = false;
  bool got_gid = false;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string key;
    unsigned long real = 0;
    unsigned long effective = 0;
    fields >> key >> real >> effective;
    if (!fields) continue;
    if (key == "Uid:") {
      uid = static_cast<uid_t>(effective);
      got_uid = true;
    } else if (key == "Gid:") {
      gid = static_cast<gid_t>(effective);
      got_gid = true;
    }
  }
  if (!got_uid || !got_gid) {
    throw Error(ErrorKind::kNotFound,
                "process " + std::to_string(pid) + " is gone (no Uid/Gid in its status)",
                "capture a running workload");
  }
  return {uid, gid};
}

}  // namespace

stdfs::path make_tier_dir(const stdfs::path& staging, pid_t pid) {
  const auto [uid, gid] = owner_of(pid);
  stdfs::path dir = staging / kTierDirName;
  if (::mkdir(dir.c_str(), 0700) != 0) throw sys_error("cannot create " + dir.string(), errno);
  if (::chown(dir.c_str(), uid, gid) != 0) {
    throw sys_error("cannot hand " + dir.string() + " to the workload's user", errno);
  }
  return dir;
}

TierContents check_tier_dir(const stdfs::path& dir) {
  static const std::regex kImage(R"(([0-9]{1,10})-w[0-9]{1,4}\.img)");
  static const std::regex kIndex(R"([0-9]{1,10}\.json)");
  TierContents contents;
  std::vector<stdfs::path> indexes;
  std::error_code ec;
  for (stdfs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (++contents.files > kMaxTierEntries) {
      throw bad_entry(dir, name, "more than " + std::to_string(kMaxTierEntries) + " entries");
    }
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      throw bad_entry(dir, name, "not a regular file");
    }
    if (std::regex_match(name, kIndex)) {
      if (static_cast<uintmax_t>(st.st_size) > kMaxTierIndexBytes) {
        throw bad_entry(dir, name, "an index larger than 1 MiB");
      }
      indexes.push_back(it->path());
    } else if (!std::regex_match(name, kImage)) {
      throw bad_entry(dir, name, "not a file of the tier (PID-wN.img or PID.json)");
    }
  }
  if (ec) throw sys_error("cannot list " + dir.string(), ec.value());
  for (const auto& path : indexes) {
    std::ifstream in(path);
    try {
      const json index = json::parse(in);
      if (index.at("format") != "gpusnap-tier" || index.at("version") != 1) {
        throw bad_entry(dir, path.filename().string(), "an index of another format");
      }
      for (const auto& f : index.at("files")) {
        const auto name = f.at("path").get<std::string>();
        const auto size = f.at("size").get<uintmax_t>();
        if (!std::regex_match(name, kImage) || stdfs::file_size(dir / name, ec) != size || ec) {
          throw bad_entry(dir, path.filename().string(),
                          "an index naming " + name + ", which is not there at " +
                              std::to_string(size) + " bytes");
        }
      }
      for (const auto& g : index.at("gpus")) {
        const auto bytes = g.at("bytes").get<uint64_t>();
        contents.gpu_bytes[g.at("uuid").get<std::string>()] += bytes;
        contents.bytes += bytes;
      }
    } catch (const json::exception& e) {
      throw bad_entry(dir, path.filename().string(),
                      std::string("a malformed index (") + e.what() + ")");
    }
  }
  if (contents.files == 0) stdfs::remove(dir, ec);
  return contents;
}

void add_tier_memory(std::optional<GpuFacts>& gpu, pid_t pid, const TierContents& tier) {
  if (tier.bytes == 0 || !gpu || gpu->processes.empty()) return;
  GpuProcessRecord* entry = &gpu->processes.front();
  for (auto& p : gpu->processes) {
    if (p.pid == pid) entry = &p;
  }
  for (const auto& [uuid, bytes] : tier.gpu_bytes) {
    bool found = false;
    for (auto& g : entry->gpus) {
      if (g.uuid == uuid) {
        g.bytes += bytes;
        found = true;
      }
    }
    if (!found) entry->gpus.push_back({uuid, bytes});
  }
  entry->bytes += tier.bytes;
  // A GPU that holds tier memory is used, whatever NVML said after the drain.
  for (auto& g : gpu->gpus) {
    if (tier.gpu_bytes.count(g.uuid) != 0) g.used = true;
  }
}

json tier_member(const stdfs::path& dir) {
  std::error_code ec;
  return stdfs::is_directory(dir, ec) ? dir.string() : std::string();
}

json artifact_tier_dir(const stdfs::path& artifact, const Manifest& manifest) {
  const std::string prefix = std::string(kTierDirName) + "/";
  for (const auto& f : manifest.files) {
    if (f.path.rfind(prefix, 0) == 0) return (stdfs::absolute(artifact) / kTierDirName).string();
  }
  return std::string();
}

}  // namespace gpusnap::engine
