// The GNU build-id of an ELF file: the linker's hash of the file's contents, kept in a note.
// A placeholder container must map the same executables and libraries as the captured one;
// comparing their build-ids (as CRIU's own file validation does) reads a few KiB of headers per
// file, where hashing the whole file read 3.1 GB for a PyTorch workload, mostly from disk
// (3 s of a capture on the H200: docs/benchmarks.md, "Measured once").
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace gpusnap::container {

// Bounds on what is read: a file with more program headers or larger note segments is not
// taken for an ELF with a build-id (its content is then hashed instead).
inline constexpr size_t kMaxProgramHeaders = 1024;
inline constexpr size_t kMaxNoteSegmentBytes = 64 << 10;
inline constexpr size_t kMaxBuildIdBytes = 64;

// The build-id of the 64-bit little-endian ELF file open at `fd` (read with pread), as
// lowercase hex; nullopt when the file is not such an ELF, has no GNU build-id note, or
// anything in it is out of bounds.
std::optional<std::string> gnu_build_id(int fd);

}  // namespace gpusnap::container
