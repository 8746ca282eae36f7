#include "artifact/writer.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/proc.h"
#include "gpusnap/error.h"

namespace gpusnap::artifact {

namespace {
constexpr const char* kStagingTag = ".staging-";
}

ArtifactWriter::ArtifactWriter(std::filesystem::path final_path)
    : final_(std::filesystem::absolute(final_path).lexically_normal()) {
  if (final_.filename().empty()) final_ = final_.parent_path();
  std::error_code ec;
  if (std::filesystem::exists(final_, ec)) {
    throw Error(ErrorKind::kUsage, "output " + final_.string() + " already exists",
                "choose another -o path or remove the old artifact first");
  }
  auto parent = final_.parent_path();
  if (!std::filesystem::is_directory(parent, ec)) {
    throw Error(ErrorKind::kUsage, "output directory " + parent.string() + " does not exist",
                "create it first, or choose another -o path");
  }
  remove_stale_staging(parent);
  for (int attempt = 1;; ++attempt) {
    staging_ = parent / ("." + final_.filename().string() + kStagingTag +
                         std::to_string(::getpid()) + "-" + fs::random_id().substr(0, 8));
    std::filesystem::create_directory(staging_, ec);
    if (ec) throw sys_error("create " + staging_.string(), ec.value());
    // From here on the destructor does not run if we throw: remove the directory ourselves.
    if (lock_staging()) break;
    // A sweep in a PID namespace that cannot see us found it before we locked it and removed
    // it: try a new name.
    if (attempt == 3) {
      throw Error(ErrorKind::kInternal,
                  "staging directories in " + parent.string() + " keep vanishing",
                  "is another program removing hidden directories there?");
    }
  }
  std::filesystem::create_directory(criu_dir(), ec);
  if (ec) {
    fs::remove_tree_noexcept(staging_);
    throw sys_error("create " + criu_dir().string(), ec.value());
  }
}

bool ArtifactWriter::lock_staging() {
  UniqueFd fd(::open(staging_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  int err = errno;
  if (fd && ::flock(fd.get(), LOCK_EX) != 0) {
    err = errno;
    fd.reset();
  }
  if (!fd) {
    fs::remove_tree_noexcept(staging_);
    throw sys_error("lock " + staging_.string(), err);
  }
  // Between mkdir and flock, the directory was unlocked: still ours only if it is still there.
  // (A sweeper holds its own lock while it removes, so our flock waited for it to finish.)
  struct stat held {
  }, named{};
  if (::fstat(fd.get(), &held) != 0 || ::stat(staging_.c_str(), &named) != 0 ||
      held.st_dev != named.st_dev || held.st_ino != named.st_ino) {
    return false;
  }
  staging_lock_ = std::move(fd);
  return true;
}

ArtifactWriter::~ArtifactWriter() {
  if (!committed_) fs::remove_tree_noexcept(staging_);
}

void ArtifactWriter::seal(Manifest& manifest, Phases& phases,
                          const std::vector<FileRecord>& known) {
  phases.run("checksum", [&] {
    manifest.files =
        checksum_tree(staging_, manifest.chunk_bytes, VerifyOptions{0, &phases.reporter()}, known);
  });
}

void ArtifactWriter::commit(const Manifest& manifest, Phases& phases) {
  phases.run("commit", [&] {
    fs::write_file(staging_ / kManifestName, manifest.to_json().dump(2) + "\n");
    fs::fsync_tree(staging_);
    // RENAME_NOREPLACE: two checkpoints racing for one name must not overwrite each other.
    if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, final_.c_str(), RENAME_NOREPLACE) != 0) {
      if (errno == EEXIST || errno == ENOTEMPTY) {
        throw Error(ErrorKind::kUsage, "output " + final_.string() + " appeared meanwhile",
                    "choose another -o path");
      }
      throw sys_error("rename " + staging_.string() + " to " + final_.string(), errno);
    }
    committed_ = true;
    fs::fsync_path(final_.parent_path());
  });
}

void ArtifactWriter::remove_stale_staging(const std::filesystem::path& dir) noexcept {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    auto name = entry.path().filename().string();
    auto tag = name.rfind(kStagingTag);
    if (name.empty() || name[0] != '.' || tag == std::string::npos) continue;
    auto rest = name.substr(tag + std::string(kStagingTag).size());
    pid_t owner = static_cast<pid_t>(std::atoi(rest.c_str()));
    if (owner <= 0) continue;
    // Cheap first filter: an owner alive in our PID namespace is (as far as we can tell)
    // still writing. An owner we cannot see is not necessarily dead: it may live in another
    // PID namespace (a container sharing this volume). Only its lock tells.
    if (proc::exists(owner)) continue;
    UniqueFd fd(::open(entry.path().c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;
    // Removed while holding the lock, so a writer that just created this name waits in its
    // flock until the directory is gone, and then sees that it is.
    fs::remove_tree_noexcept(entry.path());
  }
}

}  // namespace gpusnap::artifact
