// Host images: the GPU memory of a checkpointed CUDA process, stored by gpusnap itself.
//
// The driver's checkpoint copies a process's GPU memory into a new private anonymous region of
// that process (one region as large as the GPU memory in use, measured on the H200). Left to
// CRIU, that region is the bulk of the image and goes through CRIU's page path: one thread,
// about 1.5 GB/s on restore. Instead, after gpu-checkpoint and before the dump, gpusnap:
//
//   1. finds the regions: private anonymous memory mapped by the checkpoint (maps before and
//      after compared), at least kMinHostImageBytes;
//   2. copies each into a file of the artifact with many threads, leaving zero blocks as holes;
//   3. replaces the region in the process by a private mapping of that file (same address,
//      protection and madvise flags, same bytes): a few system calls run in the process
//      (common/syscall_injection.h) while its CUDA state is checkpointed and nothing touches the
//      region;
//   4. names the file to CRIU as external (`--external file[MNT:INODE]`): CRIU records the
//      mapping and no page of it (clean pages of a private file mapping are never dumped).
//
// On restore CRIU maps the artifact's file back in place (`--inherit-fd`), with no copy: the
// driver's restore reads it straight from the page cache, and every copy of one artifact
// shares those pages. The region stays a private mapping, so nothing a process writes reaches
// the artifact.
//
// Any failure before step 3 leaves the region as it was and the process to CRIU's path; step 3
// is checked by re-reading the process's mappings, never assumed.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/syscall_injection.h"
#include "common/worker_pool.h"
#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"

namespace gpusnap::engine {

inline constexpr uint64_t kMinHostImageBytes = 64ull << 20;
inline constexpr const char* kHostImageDir = "host-images";
// Where a container's processes reach that folder of the staging directory: mounted there for
// the capture (container/mount.h; CRIU needs the container's /tmp writable anyway).
inline constexpr const char* kContainerHostImageMount = "/tmp/.gpusnap-host-images";

struct Range {
  uint64_t start = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - start; }
  bool operator==(const Range&) const = default;
};

// Private anonymous read-write memory in `after` not mapped at all in `before`, in ranges of
// at least `min_bytes`, in address order.
std::vector<Range> new_anonymous_ranges(const std::vector<common::Mapping>& before,
                                        const std::vector<common::Mapping>& after,
                                        uint64_t min_bytes);

struct StoredHostImages {
  std::vector<HostImageRecord> images;
  // The images' files with their chunk checksums, computed from the bytes as they were copied
  // (for ArtifactWriter::seal, which then need not read them again).
  std::vector<FileRecord> files;
};

struct HostImageOptions {
  int threads = 4;                  // copying at once
  uint64_t chunk_bytes = 64 << 20;  // the manifest's checksum chunk
  // Largest file of a host image (rounded down to whole chunks); 0: one file per region.
  // Threads filling one file share its page cache; several files spread that, at the cost of
  // one mapping per file in the process (measured on the H200: docs/benchmarks.md).
  uint64_t file_bytes = 0;
  // The host-images folder as the process reaches it: "" for gpusnap's own path, which a process
  // in another mount namespace cannot open (its memory is then left to CRIU). A container's
  // capture mounts the folder into the container and names the mount point here
  // (container/mount.h).
  std::filesystem::path visible_dir;
};

// Copies `pid`'s memory at each range into `artifact_root/host-images/` and remaps it there, as
// described above, hashing each chunk as it goes. Returns the images made (possibly fewer than
// the ranges: a range that could not be moved is left to CRIU and noted on `reporter`).
StoredHostImages store_host_images(pid_t pid, const std::vector<Range>& ranges,
                                   const std::filesystem::path& artifact_root,
                                   const HostImageOptions& options, Reporter& reporter);

// The images' CRIU keys, for criu::DumpOptions::external_files.
std::vector<std::string> criu_external_keys(const std::vector<HostImageRecord>& images);

// The super options ("rw,size=...,huge=within_size") of the mount holding `path`, from the text
// of /proc/self/mountinfo; "" when no mount holds it. `path` must be absolute and canonical.
std::string mount_options_of(const std::filesystem::path& path, const std::string& mountinfo);

// Whether a tmpfs with these super options gives its files 2 MiB pages: huge=always,
// huge=within_size, or huge=advise (gpusnap advises its own mappings of the files).
bool tmpfs_gives_huge_pages(const std::string& super_options);

// Whether `dir` is on a tmpfs whose files get 4 KiB pages only (then a note says what a
// huge-page tmpfs would gain: docs/benchmarks.md).
bool on_tmpfs_without_huge_pages(const std::filesystem::path& dir);

// Whether `size` bytes at `data` are all zero (such a block is left as a hole).
bool all_zero(const unsigned char* data, size_t size);

// --- The driver's memory straight into the artifact ------------------------------------------
//
// With libgpusnap-preload.so in the process (src/preload/populate.cc), the copy above is not
// needed at all: just before the driver's checkpoint, gpusnap leaves the library a request
// naming an empty file of the artifact, and the library maps the driver's region as a shared
// mapping of that file, so that the driver's own copy is the write into the artifact. After the
// call the region is made a private mapping of the same file (the same pages of the page cache,
// nothing copied) by the library's own watcher thread on gpusnap's request (preload.h), so that
// neither the source nor a copy restored later can write into the artifact; the file is hashed
// from the moment the driver's call returns, while the region is made private and CRIU dumps.

// The requests' directory under gpusnap's run directory (the library's default is
// /run/gpusnap/preload: GPUSNAP_PRELOAD_REQUESTS names another).
inline constexpr const char* kPreloadRequestsDir = "preload";

// Whether the driver's region of `pid` can go straight into the artifact: the process maps the
// library, reaches the request and the file by path, has no tracer and the machine is x86-64
// (a library without the remap watcher is remapped through ptrace's injection). Reaching them:
// it lives in gpusnap's mount namespace, or, `in_container`, it was started with its requests
// at kContainerPreloadRequests (preload.h), where the capture mounts them, as `gpusnap init`
// starts a container's workload.
bool direct_capture_possible(pid_t pid, const std::vector<common::Mapping>& maps,
                             bool in_container = false);

// The request's path for `pid`: "REQUESTS/PIDNS-PID", the process's PID namespace inode and its
// pid there, which is what the library knows of itself.
std::filesystem::path preload_request_path(const std::filesystem::path& requests_dir, pid_t pid);

// One process's request, from before the driver's call until its region is adopted. Failures
// to set it up are notes, never errors: the process then takes the copying path.
class DirectHostImage {
 public:
  // Creates the empty file `artifact_root/host-images/PID.img` (root's only) and the request
  // naming it. `seen_dir`: where the process reaches that folder when not at its own path (a
  // container's, through a mount); empty when it is.
  DirectHostImage(pid_t pid, const std::filesystem::path& artifact_root,
                  const std::filesystem::path& requests_dir, Reporter& reporter,
                  const std::filesystem::path& seen_dir = {});
  DirectHostImage(const DirectHostImage&) = delete;
  DirectHostImage& operator=(const DirectHostImage&) = delete;
  // Withdraws the request, and tells the library's remap watcher to leave if it never acted.
  ~DirectHostImage();

  pid_t pid() const { return pid_; }
  // The file the library is asked to map (empty when the request could not be made).
  const std::filesystem::path& file() const { return file_; }
  // Removes the request whether or not the library took it (after the driver's call).
  void withdraw() noexcept;
  // After the driver's call: when the process maps the file, shared, as one range, the file is
  // renamed `PID-ADDR.img` as the copying path names it and its record returned (stored_bytes
  // and checksums come from HashedFiles).
  // Otherwise the file is removed and nullopt returned, the process left to the copying path.
  // The record's file is complete (the driver's call has returned): hashing may start at once.
  std::optional<HostImageRecord> adopt(const std::filesystem::path& artifact_root,
                                       Reporter& reporter);
  // After adopt() found the range: makes it private in the process and checks that it is.
  // Throws Error(kEnvironment) when it cannot be: a shared mapping of the artifact must never
  // be captured.
  void make_private(Reporter& reporter);

 private:
  // How long the library's watcher may take to make the region private (one mmap).
  static constexpr std::chrono::milliseconds kRemapLimit{10000};
  void remap_from_inside(const Range& range, uint64_t offset);

  // The file as the process names it (in /proc/PID/maps): file_, or the same name in seen_dir_.
  std::filesystem::path as_seen() const {
    return seen_dir_.empty() ? file_ : seen_dir_ / file_.filename();
  }

  pid_t pid_;
  std::filesystem::path file_;
  std::filesystem::path seen_dir_;
  Range range_;
  uint64_t offset_ = 0;
  common::UniqueFd fd_;  // the adopted file, until make_private()
  std::filesystem::path request_;
  std::filesystem::path remap_request_base_;  // the preload request's path, kept after withdraw()
  bool remapped_ = false;
};

// Starts the write-back of what the driver writes into direct host image files as it goes, on
// a thread of its own, every 200 ms until destroyed. Why: into a store on disk the driver's
// copy dirties the page cache faster than the kernel's flushers clean it (16.5 GiB on the
// H200: 13.6 GiB dirty at the end of the driver's call, most of it written back by the
// commit's fsync, 3.99 s); dirty pages cannot be reclaimed until written. On a tmpfs the call
// does nothing.
class WriteBehind {
 public:
  explicit WriteBehind(const std::vector<std::filesystem::path>& files);
  WriteBehind(const WriteBehind&) = delete;
  WriteBehind& operator=(const WriteBehind&) = delete;
  ~WriteBehind();

 private:
  std::vector<common::UniqueFd> fds_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Host image files hashed chunk by chunk in the background, on `threads` threads, while the
// capture goes on (CRIU's dump needs one core). The destructor stops and waits.
class HashedFiles {
 public:
  HashedFiles(const std::filesystem::path& artifact_root,
              const std::vector<HostImageRecord>& images, uint64_t chunk_bytes, int threads);
  HashedFiles(const HashedFiles&) = delete;
  HashedFiles& operator=(const HashedFiles&) = delete;
  ~HashedFiles();  // the pool stops and is joined before the files it reads go
  // Waits for the hashes; fills in the stored_bytes (bytes in 64 KiB blocks not all zero) of the
  // images of `images` it hashed and returns the files' records for ArtifactWriter::seal.
  // Throws Error on a read failure.
  std::vector<FileRecord> join(std::vector<HostImageRecord>& images);

 private:
  struct File;
  void work(const std::atomic<bool>& stop);

  std::vector<std::unique_ptr<File>> files_;
  uint64_t chunk_bytes_;
  std::atomic<size_t> next_{0};
  std::string failure_;                     // set before the pool starts, read after it ends
  std::optional<common::WorkerPool> pool_;  // last: it stops before the members it reads go
};

}  // namespace gpusnap::engine
