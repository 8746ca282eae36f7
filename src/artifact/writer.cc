#include "artifact/writer.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <string_view>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/proc.h"
#include "gpusnap/error.h"

namespace gpusnap::artifact {

namespace {

// The pid a record or staging name starts with; 0 when it does not start with one (a name
// somebody else put there), which the callers skip.
pid_t owner_pid(std::string_view name) {
  pid_t pid = 0;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), pid);
  return ec == std::errc{} && end != name.data() ? pid : 0;
}

constexpr const char* kStagingTag = ".staging-";

std::filesystem::path records_dir(const std::filesystem::path& run_dir) {
  return run_dir / "staging";
}
// Why the staging directory cannot be made in `dir`: most often the user's -o points at a
// place no artifact can be written (read-only, /proc, full), which is theirs to fix.
Error output_error(const std::filesystem::path& dir, int err) {
  if (err == ENOSPC || err == EDQUOT) {
    return Error(ErrorKind::kEnvironment, "no space left in " + dir.string(),
                 "free some space there, or choose another -o path");
  }
  if (err == EROFS) {
    return Error(ErrorKind::kUsage, "output directory " + dir.string() + " is read-only",
                 "choose an -o path on a writable filesystem");
  }
  if (err == EACCES || err == EPERM || err == ENOENT || err == ENOTDIR || err == EINVAL) {
    return Error(ErrorKind::kUsage,
                 "cannot create an artifact in " + dir.string() + ": " + errno_text(err),
                 "choose an -o path in a writable directory of an ordinary filesystem");
  }
  return sys_error("create a staging directory in " + dir.string(), err);
}

}  // namespace

ArtifactWriter::ArtifactWriter(const std::filesystem::path& final_path, WriterOptions options)
    : ArtifactWriter(final_path, std::move(options), StagingDir{}) {}

ArtifactWriter::ArtifactWriter(const std::filesystem::path& final_path, WriterOptions options,
                               StagingDir earlier)
    : final_(std::filesystem::absolute(final_path).lexically_normal()),
      options_(std::move(options)) {
  if (final_.filename().empty()) final_ = final_.parent_path();
  std::error_code ec;
  // symlink_status: a dangling symlink at the output is there too (the final rename would
  // refuse it after the whole capture).
  if (std::filesystem::exists(std::filesystem::symlink_status(final_, ec))) {
    throw Error(ErrorKind::kUsage, "output " + final_.string() + " already exists",
                "choose another -o path or remove the old artifact first");
  }
  auto parent = final_.parent_path();
  if (!std::filesystem::is_directory(parent, ec)) {
    throw Error(ErrorKind::kUsage, "output directory " + parent.string() + " does not exist",
                "create it first, or choose another -o path");
  }
  remove_stale_staging(parent);
  if (!options_.run_dir.empty()) {
    // Recorded before the directory exists: a gpusnap killed a moment after its mkdir leaves
    // a record that `gpusnap recover` follows.
    std::filesystem::create_directories(records_dir(options_.run_dir), ec);
    record_ = records_dir(options_.run_dir) /
              (std::to_string(::getpid()) + "-" + fs::random_id().substr(0, 8));
    fs::write_file_durable(record_, parent.string());
  }
  if (!earlier.dir.empty() && take_over(std::move(earlier))) return;
  for (int attempt = 1;; ++attempt) {
    staging_ = staging_path(final_);
    // 0700 from mkdir on (the umask can only take bits away): CRIU's images, written inside
    // with its own modes, are never reachable by other users.
    if (::mkdir(staging_.c_str(), 0700) != 0) throw output_error(parent, errno);
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
  if (::mkdir(criu_dir().c_str(), 0700) != 0) {
    const int err = errno;
    fs::remove_tree_noexcept(staging_);
    throw sys_error("create " + criu_dir().string(), err);
  }
}

std::filesystem::path ArtifactWriter::staging_path(const std::filesystem::path& final_path) {
  return final_path.parent_path() /
         ("." + final_path.filename().string() + kStagingTag + std::to_string(::getpid()) + "-" +
          fs::random_id().substr(0, 8));
}

bool ArtifactWriter::take_over(StagingDir earlier) {
  staging_ = staging_path(final_);
  // Renamed to this writer's name: a record under run_dir names the directories by their
  // owner's PID, so that `gpusnap recover` finds this one if this process dies too.
  if (::renameat2(AT_FDCWD, earlier.dir.c_str(), AT_FDCWD, staging_.c_str(), RENAME_NOREPLACE) !=
      0) {
    return false;  // removed meanwhile (a recover): a new one is made
  }
  struct stat held {
  }, named{};
  if (!earlier.lock || ::fstat(earlier.lock.get(), &held) != 0 ||
      ::stat(staging_.c_str(), &named) != 0 || held.st_dev != named.st_dev ||
      held.st_ino != named.st_ino) {
    fs::remove_tree_noexcept(staging_);
    return false;
  }
  staging_lock_ = std::move(earlier.lock);
  resumed_ = true;
  if (::mkdir(criu_dir().c_str(), 0700) != 0 && errno != EEXIST) {
    const int err = errno;
    fs::remove_tree_noexcept(staging_);
    throw sys_error("create " + criu_dir().string(), err);
  }
  return true;
}

bool ArtifactWriter::lock_staging() {
  common::UniqueFd fd(::open(staging_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
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
  if (!committed_ && !keep_) fs::remove_tree_noexcept(staging_);
  if (!record_.empty()) fs::remove_tree_noexcept(record_);
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
    fs::restrict_tree(staging_, options_.group);
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

std::vector<std::string> ArtifactWriter::remove_abandoned_staging(
    const std::filesystem::path& run_dir) noexcept {
  std::vector<std::string> log;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(records_dir(run_dir), ec)) {
    const auto name = entry.path().filename().string();
    const pid_t owner = owner_pid(name);
    if (owner <= 0 || proc::exists(owner)) continue;  // still writing
    std::string dir;
    if (fs::try_read_file(entry.path(), &dir) && !dir.empty()) {
      const std::string mine = std::string(kStagingTag) + std::to_string(owner) + "-";
      for (const auto& staged : std::filesystem::directory_iterator(dir, ec)) {
        if (staged.path().filename().string().find(mine) == std::string::npos) continue;
        remove_stale_staging_entry(staged.path(), owner);
        if (!std::filesystem::exists(std::filesystem::symlink_status(staged.path(), ec))) {
          log.push_back("removed the staging directory " + staged.path().string() +
                        " of a killed gpusnap (pid " + std::to_string(owner) + ")");
        }
      }
    }
    fs::remove_tree_noexcept(entry.path());
  }
  return log;
}

bool ArtifactWriter::is_staging_of(const std::string& entry, const std::string& final_name) {
  return entry.starts_with("." + final_name + kStagingTag);
}

bool ArtifactWriter::is_staging(const std::string& entry) {
  return entry.starts_with(".") && entry.find(kStagingTag) != std::string::npos;
}

void ArtifactWriter::remove_stale_staging(const std::filesystem::path& dir) noexcept {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    auto name = entry.path().filename().string();
    auto tag = name.rfind(kStagingTag);
    if (name.empty() || name[0] != '.' || tag == std::string::npos) continue;
    auto rest = name.substr(tag + std::string(kStagingTag).size());
    const pid_t owner = owner_pid(rest);
    if (owner <= 0) continue;
    remove_stale_staging_entry(entry.path(), owner);
  }
}

void ArtifactWriter::remove_stale_staging_entry(const std::filesystem::path& staged,
                                                pid_t owner) noexcept {
  // Cheap first filter: an owner alive in our PID namespace is (as far as we can tell)
  // still writing. An owner we cannot see is not necessarily dead: it may live in another
  // PID namespace (a container sharing this volume). Only its lock tells.
  if (proc::exists(owner)) return;
  common::UniqueFd fd(::open(staged.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) return;
  // Removed while holding the lock, so a writer that just created this name waits in its
  // flock until the directory is gone, and then sees that it is.
  fs::remove_tree_noexcept(staged);
}

}  // namespace gpusnap::artifact
