#include "common/room.h"

#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>

#include <cerrno>

#include "gpusnap/error.h"

namespace gpusnap::fs {

uint64_t allocated_bytes(const std::filesystem::path& root) noexcept {
  uint64_t n = 0;
  std::error_code ec;
  for (std::filesystem::recursive_directory_iterator it(root, ec), end; !ec && it != end;
       it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      n += static_cast<uint64_t>(st.st_blocks) * 512;
    }
  }
  return n;
}

Room room_of(const std::filesystem::path& path) {
  struct statfs type {};
  struct statvfs vfs {};
  struct stat st {};
  if (::statfs(path.c_str(), &type) != 0 || ::statvfs(path.c_str(), &vfs) != 0 ||
      ::stat(path.c_str(), &st) != 0) {
    throw sys_error("statfs " + path.string(), errno);
  }
  return {static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize, st.st_dev,
          type.f_type == TMPFS_MAGIC || type.f_type == RAMFS_MAGIC};
}

}  // namespace gpusnap::fs
