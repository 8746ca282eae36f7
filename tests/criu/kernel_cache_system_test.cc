// CRIU's kernel cache where /run is not a tmpfs (src/criu/kernel_cache.h): made by a real CRIU
// in a mount namespace of its own, stamped with this boot, remade when the stamp is not this
// boot's, and read by CRIU afterwards.
#include "criu/kernel_cache.h"

#include <glob.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include <filesystem>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "common/subprocess.h"
#include "testing/harness.h"

namespace gpusnap::criu {
namespace {

namespace stdfs = std::filesystem;

// Puts back whatever cache and stamp the machine had before the test.
class KeepFile {
 public:
  explicit KeepFile(std::string path) : path_(std::move(path)) {
    std::string bytes;
    if (fs::try_read_file(path_, &bytes)) saved_ = bytes;
  }
  ~KeepFile() {
    if (saved_) {
      fs::write_file(path_, *saved_);
    } else {
      std::error_code ec;
      stdfs::remove(path_, ec);
    }
  }
  KeepFile(const KeepFile&) = delete;
  KeepFile& operator=(const KeepFile&) = delete;

 private:
  std::string path_;
  std::optional<std::string> saved_;
};

size_t scratch_folders_left() {
  glob_t g{};
  const int r = ::glob("/dev/shm/gpusnap-criu-kdat.*", 0, nullptr, &g);
  const size_t n = r == 0 ? g.gl_pathc : 0;
  ::globfree(&g);
  return n;
}

TEST(CriuKernelCache, MadeOnceStampedWithThisBootRemadeWhenStaleAndReadByCriu) {
  SKIP_WITHOUT_CRIU();
  struct statfs s {};
  if (::statfs("/run", &s) == 0 && s.f_type == TMPFS_MAGIC) {
    GTEST_SKIP() << "skipped: /run is a tmpfs here, CRIU keeps its own cache";
  }
  const Binary criu = locate();
  KeepFile cache(kKernelCache), stamp(kKernelCacheStamp);
  stdfs::remove(kKernelCache);
  stdfs::remove(kKernelCacheStamp);

  ASSERT_TRUE(keep_kernel_cache(criu));
  struct stat st {};
  ASSERT_EQ(::stat(kKernelCache, &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, 0u);
  EXPECT_GT(st.st_size, 0);
  std::string boot, recorded;
  ASSERT_TRUE(fs::try_read_file("/proc/sys/kernel/random/boot_id", &boot));
  ASSERT_TRUE(fs::try_read_file(kKernelCacheStamp, &recorded));
  EXPECT_EQ(recorded.rfind(boot.substr(0, boot.find('\n')) + " " + criu.path + " ", 0), 0u)
      << recorded;
  EXPECT_EQ(scratch_folders_left(), 0u);

  // Stamped with this boot and this CRIU: nothing to do.
  EXPECT_FALSE(keep_kernel_cache(criu));
  // An earlier boot's: made again.
  fs::write_file(kKernelCacheStamp, "00000000-0000-0000-0000-000000000000 " + criu.path + "\n");
  EXPECT_TRUE(keep_kernel_cache(criu));
  ASSERT_TRUE(fs::try_read_file(kKernelCacheStamp, &recorded));
  EXPECT_EQ(recorded.rfind(boot.substr(0, boot.find('\n')), 0), 0u) << recorded;

  // CRIU itself reads it instead of probing the kernel.
  testing::TempDir dir;
  const auto log = dir / "check.log";
  auto r = common::run_capture({criu.path, "check", "-v4", "--log-file", log.string()});
  std::string text;
  ASSERT_TRUE(fs::try_read_file(log, &text)) << r.output;
  EXPECT_NE(text.find(std::string("Loaded kdat cache from ") + kKernelCache), std::string::npos)
      << text.substr(0, 2000);
}

}  // namespace
}  // namespace gpusnap::criu
