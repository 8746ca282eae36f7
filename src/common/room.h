// How much a filesystem still takes, and how much a tree already holds: what a writer asks
// before it writes a large artifact (a capture's room check, a pull's).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>

namespace gpusnap::fs {

// Bytes allocated to the regular files under `root` (holes are free); 0 when it is missing.
// Never throws.
uint64_t allocated_bytes(const std::filesystem::path& root) noexcept;

// The filesystem a path lies on, as a writer asks it whether what it writes fits.
struct Room {
  uint64_t free = 0;    // bytes an unprivileged writer may still use (f_bavail)
  dev_t device = 0;     // which filesystem: two paths with one device share their free space
  bool in_ram = false;  // tmpfs or ramfs: what it holds is host memory
};
// Throws (sys_error) when `path` cannot be asked.
Room room_of(const std::filesystem::path& path);

}  // namespace gpusnap::fs
