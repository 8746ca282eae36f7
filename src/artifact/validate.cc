#include "artifact/validate.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "gpusnap/error.h"

namespace gpusnap::artifact {

namespace {

constexpr const char* kForged = "the artifact is damaged or forged; take a new checkpoint";

Error bad(const std::string& what) { return Error(ErrorKind::kBadArtifact, what, kForged); }

// A path for a message: a forged one may be 4 KiB of control characters.
std::string shown(const std::string& path) {
  std::string out;
  for (char c : path.substr(0, 120)) {
    out += static_cast<unsigned char>(c) < 0x20 || c == 0x7f ? '?' : c;
  }
  return path.size() > 120 ? out + "..." : out;
}

// Only a ".." component climbs out of the artifact: "a..b" is a harmless name.
void check_path(const std::string& path, const char* field) {
  const std::filesystem::path p(path);
  bool unsafe = path.empty() || path.size() > kMaxPathBytes || p.is_absolute() ||
                path.find('\0') != std::string::npos || path == kManifestName ||
                std::any_of(p.begin(), p.end(), [](const std::filesystem::path& part) {
                  return part == ".." || part == "." || part.empty();
                });
  if (unsafe) throw bad(std::string("manifest lists an unsafe path '") + shown(path) + "'" + field);
}

void check_count(size_t count, size_t max, const char* field) {
  if (count > max) {
    throw bad(std::string("manifest lists ") + std::to_string(count) + " " + field +
              ", more than the " + std::to_string(max) + " gpusnap accepts");
  }
}

// The files a placeholder must hold: absolute paths in the container's root, without ".." (they
// are opened inside that root anyway, container/runc.cc), each identified by exactly one short
// hex string.
void check_rootfs_files(const std::vector<RootfsFileRecord>& files) {
  check_count(files.size(), kMaxRootfsFiles, "container files");
  auto hex = [](const std::string& s) {
    return s.size() <= kMaxIdentityHex &&
           std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(c) != 0; });
  };
  for (const auto& f : files) {
    const std::filesystem::path p(f.path);
    const bool unsafe = f.path.size() > kMaxPathBytes || !p.is_absolute() ||
                        f.path.find('\0') != std::string::npos ||
                        std::any_of(p.begin(), p.end(),
                                    [](const std::filesystem::path& part) { return part == ".."; });
    if (unsafe) {
      throw bad("manifest lists an unsafe container file '" + shown(f.path) + "'");
    }
    if (f.xxh3.empty() == f.build_id.empty() || !hex(f.xxh3) || !hex(f.build_id)) {
      throw bad("manifest identifies the container file '" + shown(f.path) +
                "' by neither one checksum nor one build-id");
    }
  }
}

}  // namespace

void validate_manifest(const Manifest& m) {
  if (m.chunk_bytes < kMinChunkBytes || m.chunk_bytes > kMaxChunkBytes) {
    throw bad("manifest has a checksum chunk size of " + std::to_string(m.chunk_bytes) +
              " bytes, outside " + std::to_string(kMinChunkBytes) + " to " +
              std::to_string(kMaxChunkBytes));
  }
  check_count(m.processes.size(), kMaxProcesses, "processes");
  check_count(m.files.size(), kMaxFiles, "files");
  check_count(m.host_images.size(), kMaxHostImages, "host images");
  check_count(m.checkpoint_phases.size(), kMaxPhases, "checkpoint phases");
  std::map<std::string, uint64_t> sizes;
  for (const auto& f : m.files) {
    check_path(f.path, "");
    if (!sizes.emplace(f.path, f.size).second) {
      throw bad("manifest lists the file '" + shown(f.path) + "' twice");
    }
    if (f.size > kMaxFileBytes) {
      throw bad("manifest gives " + shown(f.path) + " an impossible size of " +
                std::to_string(f.size) + " bytes");
    }
    const uint64_t chunks = std::max<uint64_t>(1, (f.size + m.chunk_bytes - 1) / m.chunk_bytes);
    if (f.chunks.size() != chunks) {
      throw bad("manifest lists " + std::to_string(f.chunks.size()) + " checksums for " +
                shown(f.path) + ", whose size makes " + std::to_string(chunks) + " chunks");
    }
  }
  if (m.container) check_rootfs_files(m.container->rootfs_files);
  for (const auto& i : m.host_images) {
    check_path(i.file, " for a host image");
    auto listed = sizes.find(i.file);
    if (listed == sizes.end()) {
      throw bad("manifest names the host image '" + shown(i.file) +
                "', which is not among its files");
    }
    // from_json refused end <= start; the range must lie within the file, or the copy's
    // mapping of it would fault past its end.
    const uint64_t range = i.end - i.start;
    if (i.file_offset > listed->second || range > listed->second - i.file_offset ||
        i.stored_bytes > range) {
      throw bad("manifest maps host image '" + shown(i.file) + "' beyond the end of the file");
    }
  }
}

void check_listed_files(const std::filesystem::path& root, const Manifest& manifest) {
  std::error_code ec;
  const auto real_root = std::filesystem::canonical(root, ec);
  if (ec) throw sys_error("resolve " + root.string(), ec.value());
  for (const auto& f : manifest.files) {
    const auto path = root / f.path;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
      throw Error(ErrorKind::kBadArtifact, "artifact file " + shown(f.path) + " is missing",
                  "the artifact is incomplete; copy it again or take a new checkpoint");
    }
    if (!S_ISREG(st.st_mode)) {
      throw bad("artifact file " + shown(f.path) + " is not a regular file");
    }
    // A directory on the way may be a symlink that leads out of the artifact.
    const auto real = std::filesystem::canonical(path, ec);
    const auto rel = ec ? std::filesystem::path("..") : real.lexically_relative(real_root);
    if (rel.empty() || *rel.begin() == "..") {
      throw bad("artifact file " + shown(f.path) + " lies outside the artifact");
    }
    if (static_cast<uint64_t>(st.st_size) != f.size) {
      throw Error(ErrorKind::kBadArtifact,
                  "artifact file " + f.path + " has " + std::to_string(st.st_size) +
                      " bytes, the manifest says " + std::to_string(f.size) + " (truncated?)",
                  "the artifact is damaged; copy it again or take a new checkpoint");
    }
  }
}

std::vector<VerifyProblem> unexpected_entries(const std::filesystem::path& root,
                                              const Manifest& manifest) {
  std::set<std::filesystem::path> dirs;  // every directory on a listed file's path
  for (const auto& f : manifest.files) {
    for (auto p = std::filesystem::path(f.path).parent_path(); !p.empty(); p = p.parent_path()) {
      dirs.insert(p);
    }
  }
  std::vector<VerifyProblem> problems;
  std::error_code ec;
  // Symlinks are not followed: one to /etc is reported, not walked.
  for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    const auto rel = it->path().lexically_relative(root);  // relative() follows symlinks
    const auto status = it->symlink_status(ec);
    if (ec) break;
    if (std::filesystem::is_regular_file(status)) continue;
    if (std::filesystem::is_directory(status)) {
      if (dirs.count(rel) == 0) problems.push_back({rel.string(), "unexpected directory"});
      continue;
    }
    const char* what = std::filesystem::is_symlink(status)  ? "a symlink"
                       : std::filesystem::is_fifo(status)   ? "a FIFO"
                       : std::filesystem::is_socket(status) ? "a socket"
                                                            : "a device or special file";
    problems.push_back({rel.string(), std::string(what) + ", not a regular file"});
  }
  if (ec) problems.push_back({root.string(), "cannot be listed: " + ec.message()});
  return problems;
}

}  // namespace gpusnap::artifact
