#include "criu/kernel_cache.h"

#include <linux/magic.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "common/fs.h"
#include "common/subprocess.h"
#include "gpusnap/error.h"

namespace gpusnap::criu {

namespace {

namespace stdfs = std::filesystem;

// CRIU's cache is a fixed-size structure of under a KiB; anything far larger is not one.
constexpr size_t kMaxCacheBytes = 1 << 20;
// A boot id, CRIU's path and its version.
constexpr size_t kMaxStampBytes = 4096;

bool on_tmpfs(const char* path) {
  struct statfs s {};
  return ::statfs(path, &s) == 0 && s.f_type == TMPFS_MAGIC;
}

std::string boot_id() {
  std::string id;
  if (!fs::try_read_file("/proc/sys/kernel/random/boot_id", &id)) return {};
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

// The folder on /dev/shm CRIU writes its cache into, removed with this object.
class ScratchFolder {
 public:
  ScratchFolder() {
    char name[] = "/dev/shm/gpusnap-criu-kdat.XXXXXX";
    if (::mkdtemp(name) == nullptr) throw sys_error("cannot create a folder in /dev/shm", errno);
    path_ = name;
  }
  ~ScratchFolder() {
    std::error_code ec;
    stdfs::remove_all(path_, ec);
  }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;
  const stdfs::path& path() const { return path_; }

 private:
  stdfs::path path_;
};

bool make_cache(const Binary& criu, const std::string& stamp) {
  if (!on_tmpfs("/dev/shm")) return false;
  ScratchFolder scratch;
  common::SpawnOptions o;
  o.argv = {criu.path, "check"};
  o.clone_flags = CLONE_NEWNS;
  o.bind_mounts = {{scratch.path().string(), "/run"}};
  common::Subprocess check(o);
  if (!check.wait(std::chrono::seconds(20))) return false;  // killed and reaped by `check`
  std::string bytes;
  if (!fs::try_read_regular_file(scratch.path() / "criu.kdat", &bytes, kMaxCacheBytes) ||
      bytes.empty()) {
    return false;
  }
  // Through a temporary name and a rename: a CRIU starting meanwhile reads the old file or the
  // new one, never half of one.
  fs::write_file_durable(kKernelCache, bytes);
  fs::write_file_durable(kKernelCacheStamp, stamp);
  return true;
}

}  // namespace

bool keep_kernel_cache(const Binary& criu) {
  try {
    if (on_tmpfs("/run") || ::geteuid() != 0) return false;
    const std::string id = boot_id();
    if (id.empty()) return false;
    const std::string stamp = id + " " + criu.path + " " + criu.version + "\n";
    std::string recorded;
    struct stat cache {};
    if (::stat(kKernelCache, &cache) == 0 &&
        fs::try_read_regular_file(kKernelCacheStamp, &recorded, kMaxStampBytes) &&
        recorded == stamp) {
      return false;
    }
    return make_cache(criu, stamp);
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace gpusnap::criu
