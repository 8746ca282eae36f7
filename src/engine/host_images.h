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
//      (common/remote.h) while its CUDA state is checkpointed and nothing touches the region;
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

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/remote.h"
#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"

namespace gpusnap::engine {

inline constexpr uint64_t kMinHostImageBytes = 64ull << 20;
inline constexpr const char* kHostImageDir = "host-images";

struct Range {
  uint64_t start = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - start; }
  bool operator==(const Range&) const = default;
};

// Private anonymous read-write memory in `after` not mapped at all in `before`, in ranges of
// at least `min_bytes`, in address order.
std::vector<Range> new_anonymous_ranges(const std::vector<Mapping>& before,
                                        const std::vector<Mapping>& after, uint64_t min_bytes);

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

}  // namespace gpusnap::engine
