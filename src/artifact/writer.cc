#include "artifact/writer.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>

#include "common/fs.h"
#include "common/proc.h"
#include "gpusnap/error.h"

namespace gpusnap {

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
  staging_ = parent / ("." + final_.filename().string() + kStagingTag +
                       std::to_string(::getpid()) + "-" + fs::random_id().substr(0, 8));
  std::filesystem::create_directory(staging_, ec);
  if (ec) throw sys_error("create " + staging_.string(), ec.value());
  std::filesystem::create_directory(criu_dir(), ec);
  if (ec) throw sys_error("create " + criu_dir().string(), ec.value());
}

ArtifactWriter::~ArtifactWriter() {
  if (!committed_) fs::remove_tree_noexcept(staging_);
}

void ArtifactWriter::seal(Manifest& manifest, Phases& phases) {
  phases.run("checksum", [&] {
    manifest.files = checksum_tree(staging_, manifest.chunk_bytes,
                                   VerifyOptions{0, &phases.reporter()});
  });
}

void ArtifactWriter::commit(const Manifest& manifest, Phases& phases) {
  phases.run("commit", [&] {
    fs::write_file(staging_ / kManifestName, manifest.to_json().dump(2) + "\n");
    fs::fsync_tree(staging_);
    // RENAME_NOREPLACE: two checkpoints racing for one name must not overwrite each other.
    if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, final_.c_str(), RENAME_NOREPLACE) !=
        0) {
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
    if (owner > 0 && !proc::exists(owner)) fs::remove_tree_noexcept(entry.path());
  }
}

}  // namespace gpusnap
