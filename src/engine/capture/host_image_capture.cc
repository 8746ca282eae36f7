// The host images of a capture (src/engine/capture/host_image_capture.h).
#include "engine/capture/host_image_capture.h"

#include <sys/stat.h>

#include <cerrno>
#include <chrono>

#include "common/fs.h"
#include "engine/preload.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

// How long the preload library's helpers may go on populating after the driver's checkpoint
// returns. They work ahead of the driver's copy, so they normally finish before it; this only
// bounds a starved machine.
constexpr std::chrono::milliseconds kFillThreadsLimit{30000};

}  // namespace

// A folder of gpusnap's own for one capture (0700, in a folder that exists), removed with
// everything in it when the capture ends, however it ends. A killed gpusnap leaves it; the
// guardian removes the requests in it (engine/dump_guard.h), so what stays is an empty folder.
class CaptureFolder {
 public:
  explicit CaptureFolder(std::filesystem::path path) : path_(std::move(path)) {
    if (::mkdir(path_.c_str(), 0700) != 0) throw sys_error("create " + path_.string(), errno);
  }
  CaptureFolder(const CaptureFolder&) = delete;
  CaptureFolder& operator=(const CaptureFolder&) = delete;
  ~CaptureFolder() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

HostImageCapture::HostImageCapture(std::vector<pid_t> cuda, std::filesystem::path staging,
                                   const CheckpointOptions& options, bool in_container, int threads,
                                   Reporter& reporter)
    : cuda_(std::move(cuda)),
      staging_(std::move(staging)),
      options_(options),
      in_container_(in_container),
      threads_(threads),
      reporter_(reporter),
      requests_dir_(options.run_dir / kPreloadRequestsDir) {
  if (options_.host_images && options_.direct_host_images) {
    for (pid_t pid : cuda_) {
      if (direct_capture_possible(pid, common::read_mappings(pid), in_container_)) {
        direct_.insert(pid);
      }
    }
  }
  // Where this capture leaves the preload library its requests: a container's processes reach
  // them and their files through mounts (without them, that memory is copied).
  if (in_container_ && !direct_.empty()) requests_dir_ = reach_from_container();
}

HostImageCapture::~HostImageCapture() = default;

std::vector<std::filesystem::path> HostImageCapture::requests() const {
  std::vector<std::filesystem::path> requests;
  requests.reserve(direct_.size());
  for (pid_t pid : direct_) requests.push_back(preload_request_path(requests_dir_, pid));
  return requests;
}

void HostImageCapture::remember_mappings() {
  for (pid_t pid : cuda_) maps_before_[pid] = common::read_mappings(pid);
}

void HostImageCapture::note_processes_without_preload() const {
  std::string pids;
  for (const auto& [pid, m] : maps_before_) {
    if (!maps_preload_library(m)) pids += (pids.empty() ? "" : ", ") + std::to_string(pid);
  }
  if (pids.empty()) return;
  reporter_.note(
      "CUDA process " + pids + " runs without " + kPreloadFileName +
      ": the driver's checkpoint fills its host memory in one thread (16 GiB: 4-6 s longer on "
      "the H200); workloads started by `gpusnap run` or `gpusnap init` have it "
      "(docs/design.md, \"The driver's checkpoint\")");
}

void HostImageCapture::before_gpu_checkpoint() {
  for (pid_t pid : direct_) {
    direct_images_.push_back(std::make_unique<DirectHostImage>(
        pid, staging_, requests_dir_, reporter_,
        images_mount_ ? images_mount_->path() : std::filesystem::path()));
  }
  std::vector<std::filesystem::path> files;
  for (const auto& d : direct_images_) {
    if (!d->file().empty()) files.push_back(d->file());
  }
  write_behind_.emplace(files);
}

void HostImageCapture::after_gpu_checkpoint() {
  write_behind_.reset();
  for (auto& d : direct_images_) d->withdraw();
  // The preload library may still be populating a region ahead of the driver's copy; it must be
  // done before the region is copied, moved or dumped.
  for (pid_t pid : wait_for_fill_threads(cuda_, kFillThreadsLimit)) {
    if (direct_.count(pid) > 0) {
      throw Error(ErrorKind::kTimeout,
                  "process " + std::to_string(pid) + ": " + kPreloadFileName +
                      " was still populating its GPU state's memory after " +
                      std::to_string(kFillThreadsLimit.count()) + " ms",
                  "try again on a less loaded machine, or with --no-direct-host-images");
    }
    maps_before_.erase(pid);  // its region stays with CRIU
    reporter_.note("process " + std::to_string(pid) + ": " + kPreloadFileName +
                   " was still populating its GPU state's host memory after " +
                   std::to_string(kFillThreadsLimit.count()) + " ms; that memory is left to CRIU");
  }
}

std::vector<FileRecord> HostImageCapture::store(Manifest& manifest) {
  std::vector<HostImageRecord> written;
  for (auto& d : direct_images_) {
    if (auto rec = d->adopt(staging_, reporter_)) written.push_back(*rec);
  }
  // The files are complete once the driver's call has returned: they are hashed while the
  // regions are made private and while CRIU dumps.
  if (!written.empty()) hashing_.emplace(staging_, written, manifest.chunk_bytes, threads_);
  for (auto& d : direct_images_) d->make_private(reporter_);
  manifest.host_images = written;
  return store_copies(manifest);
}

std::vector<FileRecord> HostImageCapture::hashed(Manifest& manifest) {
  return hashing_->join(manifest.host_images);
}

// Each CUDA process's new host memory into files of the artifact, one process at a time, each
// with every I/O thread.
std::vector<FileRecord> HostImageCapture::store_copies(Manifest& manifest) {
  HostImageOptions o;
  o.threads = threads_;
  o.chunk_bytes = manifest.chunk_bytes;
  o.file_bytes = options_.host_image_file_bytes;
  if (in_container_ && !maps_before_.empty()) o.visible_dir = container_host_images_dir();
  std::vector<FileRecord> files;
  for (const auto& [pid, maps] : maps_before_) {
    auto ranges = new_anonymous_ranges(maps, common::read_mappings(pid), kMinHostImageBytes);
    auto stored = store_host_images(pid, ranges, staging_, o, reporter_);
    manifest.host_images.insert(manifest.host_images.end(), stored.images.begin(),
                                stored.images.end());
    files.insert(files.end(), stored.files.begin(), stored.files.end());
  }
  if (!manifest.host_images.empty() && on_tmpfs_without_huge_pages(staging_)) {
    reporter_.note(
        "the artifact is on a tmpfs without huge pages: its host images are written and mapped "
        "4 KiB at a time; a tmpfs mounted with huge=within_size stores and restores them "
        "faster (docs/benchmarks.md)");
  }
  return files;
}

// A container's processes open their host images through a mount of the folder in their /tmp:
// kept until the capture ends, as CRIU's dump finds the files through it. Read-only, unless the
// driver writes into them there (reach_from_container()). "" (with a note) when it cannot be
// made: that memory then goes through CRIU's pages, as before.
std::filesystem::path HostImageCapture::container_host_images_dir(bool read_only) {
  if (images_mount_) return images_mount_->path();
  const auto dir = staging_ / kHostImageDir;
  try {
    std::filesystem::create_directories(dir);
    images_mount_.emplace(options_.pid, dir, kContainerHostImageMount, read_only);
    return images_mount_->path();
  } catch (const std::exception& e) {
    reporter_.note(std::string("host images: ") + e.what());
    return {};
  }
}

// The driver's memory of a container's processes straight into the artifact, as on the host:
// the library in them looks for its request at kContainerPreloadRequests (`gpusnap init` set
// that), where a folder of this capture's own is mounted read-only, holding their requests alone
// (another capture's, or a request for a process elsewhere, are never in their reach); the file
// a request names is in the host-images folder, mounted writable for the driver's write. That
// folder is the staging directory's: what a process of the container could put there lands in
// its own artifact, listed and checksummed, and reaches nothing else. Returns the requests'
// folder; without either mount, `direct_` is emptied (with a note) and that memory is copied
// after the driver's call.
std::filesystem::path HostImageCapture::reach_from_container() {
  auto fallback = [&](const std::string& why) {
    reporter_.note(
        "the driver's memory of the container's processes is copied into the artifact after its "
        "checkpoint: " +
        why);
    direct_.clear();
    requests_mount_.reset();
    requests_folder_.reset();
    return options_.run_dir / kPreloadRequestsDir;
  };
  try {
    // Root's only, as DirectHostImage makes it for the host's workloads.
    const auto requests_root = options_.run_dir / kPreloadRequestsDir;
    std::filesystem::create_directories(options_.run_dir);
    if (::mkdir(requests_root.c_str(), 0700) != 0 && errno != EEXIST) {
      throw sys_error("create " + requests_root.string(), errno);
    }
    requests_folder_ = std::make_unique<CaptureFolder>(
        requests_root / ("container-" + fs::random_id().substr(0, 12)));
    requests_mount_.emplace(options_.pid, requests_folder_->path(), kContainerPreloadRequests,
                            true);
  } catch (const std::exception& e) {
    return fallback(e.what());
  }
  if (container_host_images_dir(false).empty()) return fallback("no host-images mount");
  return requests_folder_->path();
}

}  // namespace gpusnap::engine
