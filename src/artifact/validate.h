// The bounds and paths of a manifest, checked once and in one place. A manifest is read from a
// directory anyone with write access to the storage may have forged or damaged; everything
// gpusnap later does with its paths and sizes (open a file, map it into a copy, allocate a
// checksum per chunk) is safe because of these checks.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "gpusnap/artifact.h"

namespace gpusnap::artifact {

// Bounds on what a manifest may claim. Far above anything a capture writes, low enough that
// nothing gpusnap does with them runs out of memory or time.
inline constexpr uint64_t kMinChunkBytes = 4096;
inline constexpr uint64_t kMaxChunkBytes = 4ull << 30;
inline constexpr size_t kMaxFiles = 1 << 20;
inline constexpr size_t kMaxProcesses = 1 << 16;
inline constexpr size_t kMaxHostImages = 1 << 16;
inline constexpr size_t kMaxPhases = 1024;
inline constexpr size_t kMaxPathBytes = 4096;
inline constexpr size_t kMaxRootfsFiles = 1 << 16;     // files a container's workload maps
inline constexpr size_t kMaxIdentityHex = 128;         // an xxh3 or a build-id, in hex
inline constexpr uint64_t kMaxFileBytes = 1ull << 50;  // 1 PiB
// The manifest itself: a capture of 1000 processes with 10 TiB of images writes ~10 MB.
inline constexpr uint64_t kMaxManifestBytes = 64ull << 20;

// Throws Error(kBadArtifact) naming the first field out of bounds or the first unsafe path:
// a path that is empty, absolute, climbs out with "..", or names the manifest; a file listed
// twice; a chunk count that does not match the size; a host image whose file is not listed
// in files[] or is shorter than its range. Needs nothing but the manifest.
void validate_manifest(const Manifest& manifest);

// Checks the listed files on disk, under `root`: each a regular file (not a symlink, FIFO or
// directory), inside the artifact (no symlinked directory on its way out), at its listed size.
// Throws Error(kBadArtifact) for the first that is not.
void check_listed_files(const std::filesystem::path& root, const Manifest& manifest);

// Entries under `root` that no artifact holds: anything that is neither a regular file nor a
// directory (a symlink, FIFO, socket or device), and directories on no listed file's path.
// Regular files not listed are reported by verify's checksum comparison.
std::vector<VerifyProblem> unexpected_entries(const std::filesystem::path& root,
                                              const Manifest& manifest);

}  // namespace gpusnap::artifact
