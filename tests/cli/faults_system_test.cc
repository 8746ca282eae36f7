// The fault battery, kept: bad command lines, gpusnap killed at random points of a capture,
// a full disk, two captures of one process at once. Each case is a counted number of trials
// (docs/reliability.md has the table); each trial checks the guarantees of docs/design.md:
// the source workload keeps running and answering, no partial artifact is ever visible, and
// nothing is left behind once `gpusnap recover` has run.
#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/subprocess.h"
#include "testing/capture_restore.h"

namespace gpusnap::testing {
namespace {

namespace stdfs = std::filesystem;
using nlohmann::json;
using BadCommandLine = CaptureRestoreTest;
using Permissions = CaptureRestoreTest;
using Faults = CaptureRestoreTest;

// A tmpfs of `size` mounted at DIR/NAME for the test's lifetime.
class SmallFilesystem {
 public:
  SmallFilesystem(const TempDir& dir, const std::string& name, const std::string& options)
      : path_(dir / name) {
    stdfs::create_directories(path_);
    mounted_ = ::mount("tmpfs", path_.c_str(), "tmpfs", 0, options.c_str()) == 0;
  }
  ~SmallFilesystem() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const stdfs::path& path() const { return path_; }

 private:
  stdfs::path path_;
  bool mounted_ = false;
};

// The names in `dir`, hidden ones (staging) included.
std::vector<std::string> names_in(const stdfs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : stdfs::directory_iterator(dir, ec)) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

void expect_error(const CliResult& r, int code, const std::string& line) {
  EXPECT_EQ(r.exit_code, code) << r.err;
  EXPECT_EQ(r.err, "gpusnap: error: " + line + "\n");
}

TEST_F(BadCommandLine, RefusedBeforeAnyCapture) {
  auto& source = start();
  const auto pid = std::to_string(source.pid());
  const auto out = snap.string();
  const std::string help = " (fix: see `gpusnap checkpoint --help`)";
  expect_error(gpusnap({"checkpoint", "--pid", pid, "-o", out, "extra"}), 2,
               "unexpected argument 'extra' for checkpoint" + help);
  expect_error(gpusnap({"checkpoint", "--pid", " " + pid, "-o", out}), 2,
               "--pid must be a whole number from 1 to 4194304, not ' " + pid + "'" + help);
  expect_error(gpusnap({"checkpoint", "--pid", "2", "-o", out, "--quiet"}), 2,
               "pid 2 is a kernel thread (fix: give the pid of the workload's own root process)");
  expect_error(gpusnap({"checkpoint", "--pid", pid, "-o", ""}), 2,
               "-o needs a path, not an empty one" + help);
  expect_error(gpusnap({"checkpoint", "--pid", pid, "-o", "/proc/x", "--quiet"}), 2,
               "cannot create an artifact in /proc: No such file or directory (fix: choose an -o "
               "path in a writable directory of an ordinary filesystem)");
  // A group number the kernel cannot hold is refused, not wrapped around (4294967296 would be
  // 0, root's group) nor taken as chown's "no change".
  for (const std::string gid : {"4294967295", "4294967296", "99999999999999999999999"}) {
    expect_error(gpusnap({"checkpoint", "--pid", pid, "-o", out, "--group", gid}), 2,
                 "--group " + gid +
                     " is not a group id (fix: give a group of this host, by name or by a number "
                     "below 4294967295)");
  }
  stdfs::create_symlink(dir / "nowhere", dir / "dangling");
  const auto started = std::chrono::steady_clock::now();
  expect_error(gpusnap({"checkpoint", "--pid", pid, "-o", (dir / "dangling").string(), "-q"}), 2,
               "output " + (dir / "dangling").string() +
                   " already exists (fix: choose another -o path or remove the old artifact "
                   "first)");
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(2))
      << "refused before the capture, not after it";
  EXPECT_FALSE(stdfs::exists(dir / "nowhere"));
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
}

TEST_F(BadCommandLine, ReadOnlyOutputIsAUsageError) {
  SmallFilesystem ro(dir, "ro", "size=1m");
  if (!ro.mounted()) GTEST_SKIP() << "skipped: cannot mount a tmpfs here";
  ASSERT_EQ(::mount(nullptr, ro.path().c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr), 0);
  expect_error(gpusnap({"checkpoint", "--pid", std::to_string(start().pid()), "-o",
                        (ro.path() / "snap").string(), "--quiet"}),
               2,
               "output directory " + ro.path().string() +
                   " is read-only (fix: choose an -o path on a writable filesystem)");
}

TEST_F(Permissions, ArtifactIsRootOnlyWhateverTheUmask) {
  start({"--mib", "8"});
  const mode_t old = ::umask(022);  // the child gpusnap inherits it
  auto cp = gpusnap({"checkpoint", "--pid", std::to_string(source().pid()), "-o", snap.string(),
                     "--leave-running"});
  ::umask(old);
  ASSERT_EQ(cp.exit_code, 0) << cp.err;
  int checked = 0;
  for (const auto& e : stdfs::recursive_directory_iterator(snap)) {
    struct stat st {};
    ASSERT_EQ(::lstat(e.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 077, 0u) << e.path() << " is readable by others";
    ++checked;
  }
  EXPECT_GT(checked, 3);
}

// Kills gpusnap with SIGKILL at a random moment of a capture, `kTrials` times.
TEST_F(Faults, KilledAtRandomPointsOfACapture) {
  constexpr int kTrials = 12;
  auto& source = start({"--mib", "32", "--threads", "2"});
  // How long a whole capture takes here: the kills fall within it.
  const auto started = std::chrono::steady_clock::now();
  capture({"--leave-running"});
  const auto span = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - started);
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> when(0, static_cast<int>(span.count()));
  int complete = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    const auto out = dir / "out";
    stdfs::create_directories(out);
    const int delay = trial == 0 ? 5 : when(rng);  // one within the first ~10 ms, always
    common::SpawnOptions o;
    o.argv = {
        gpusnap_bin(),           "checkpoint",      "--pid",  std::to_string(source.pid()), "-o",
        (out / "snap").string(), "--leave-running", "--quiet"};
    common::Subprocess killed(o);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    killed.kill(SIGKILL);
    killed.wait();
    // The guardian finishes (or abandons) CRIU's dump on its own; recover sweeps the rest.
    ASSERT_TRUE(eventually(
        [&] {
          gpusnap({"recover", "--json"});
          auto names = names_in(out);
          return names.empty() || names == std::vector<std::string>{"snap"};
        },
        std::chrono::seconds(30)))
        << "trial " << trial << " (kill after " << delay << " ms) left " << names_in(out).size()
        << " entries, e.g. " << (names_in(out).empty() ? "" : names_in(out)[0]);
    if (stdfs::exists(out / "snap")) {
      // Visible means complete: it verifies.
      auto v = gpusnap({"verify", (out / "snap").string()});
      EXPECT_EQ(v.exit_code, 0) << "trial " << trial << ": " << v.out << v.err;
      ++complete;
    }
    // The source was never lost, frozen or stopped.
    EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK") << "trial " << trial;
    stdfs::remove_all(out);
  }
  std::printf("faults: %d kills, %d left a complete artifact, %d nothing\n", kTrials, complete,
              kTrials - complete);
}

// A capture that runs out of space in CRIU's dump, `kTrials` times.
TEST_F(Faults, DiskFullDuringTheDumpKeepsTheRealLog) {
  constexpr int kTrials = 3;
  // Room enough for the capture's own check before anything is frozen (it asks for the tree's
  // memory, ~60 MiB); the disk fills once CRIU's dump has started, as another writer would.
  SmallFilesystem small(dir, "small", "size=96m");
  if (!small.mounted()) GTEST_SKIP() << "skipped: cannot mount a tmpfs here";
  auto& source = start({"--mib", "48"});
  // On a loaded machine the dump may end before the filler thread runs: that attempt had room
  // and proves nothing, so it is made again (at most 3x the trials).
  int attempts = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    const auto out = small.path() / "snap";
    const auto filler = small.path() / "filler";
    std::atomic<bool> done{false};
    std::thread fill([&] {
      // The dump has started when its log exists in the staging folder.
      while (!done) {
        for (const auto& e : stdfs::directory_iterator(small.path())) {
          std::error_code ec;
          if (!stdfs::exists(e.path() / "logs" / "criu-dump.log", ec)) continue;
          struct statvfs v {};
          if (::statvfs(small.path().c_str(), &v) != 0) return;
          const off_t room = static_cast<off_t>(v.f_bavail * v.f_frsize) - (256 << 10);
          common::UniqueFd fd(::open(filler.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
          if (fd && room > 0) ::posix_fallocate(fd.get(), 0, room);
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
    auto cp = gpusnap({"checkpoint", "--pid", std::to_string(source.pid()), "-o", out.string(),
                       "--leave-running", "--no-host-images"});
    done = true;
    fill.join();
    stdfs::remove(filler);
    if (cp.exit_code == 0 && ++attempts < 3 * kTrials) {
      std::printf("faults: the dump ended before the disk filled; again\n");
      stdfs::remove_all(out);
      --trial;
      continue;
    }
    EXPECT_EQ(cp.exit_code, 7) << cp.err;
    const auto kept = out.string() + ".criu-dump.log";
    EXPECT_NE(cp.err.find("(log: " + kept + ")"), std::string::npos) << cp.err;
    std::string log;
    ASSERT_TRUE(fs::try_read_file(kept, &log)) << "the named log exists";
    // CRIU's own log, moved whole (a copy came out empty on the full disk): it shows the dump
    // writing pages. Its last lines, the write that failed, are there only when the log itself
    // still had room on the full disk, which depends on where in its page the log stood.
    EXPECT_NE(log.find("Dumping"), std::string::npos)
        << "CRIU's own log, its end:\n"
        << log.substr(log.size() > 3000 ? log.size() - 3000 : 0) << "\ngpusnap: " << cp.err;
    EXPECT_NE(log.find("PPB: "), std::string::npos) << "the dump had started writing pages";
    struct stat st {};
    ASSERT_EQ(::stat(kept.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0600u);
    EXPECT_EQ(names_in(small.path()), std::vector<std::string>{"snap.criu-dump.log"})
        << "no staging, no partial artifact";
    EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
    stdfs::remove(kept);
  }
}

// Whether another capture holds the capture lock of `pid` (engine/capture_lock.h) now.
bool capture_lock_held(pid_t pid) {
  common::UniqueFd fd(::open("/run/gpusnap/captures.lock", O_RDWR | O_CLOEXEC));
  if (!fd) return false;
  struct flock probe {};
  probe.l_type = F_WRLCK;
  probe.l_whence = SEEK_SET;
  probe.l_start = pid;
  probe.l_len = 1;
  if (::fcntl(fd.get(), F_OFD_GETLK, &probe) != 0) return false;
  return probe.l_type != F_UNLCK;
}

// A gpusnap killed while CRIU dumps, `kTrials` times: the guardian finishes the dump, and the
// process stays locked against a new capture until it has (the lock used to die with gpusnap,
// and a capture started then ran into the orphaned dump inside CRIU).
TEST_F(Faults, KilledCaptureKeepsTheLockUntilItsGuardianEnds) {
  constexpr int kTrials = 3;
  auto& source = start({"--mib", "512"});
  for (int trial = 0; trial < kTrials; ++trial) {
    const auto out = dir / "out";
    stdfs::create_directories(out);
    common::SpawnOptions o;
    o.argv = {gpusnap_bin(),
              "checkpoint",
              "--pid",
              std::to_string(source.pid()),
              "-o",
              (out / "snap").string(),
              "--leave-running",
              "--no-host-images",
              "--quiet"};
    common::Subprocess killed(o);
    // The dump has started when its log exists in the staging folder.
    ASSERT_TRUE(eventually(
        [&] {
          for (const auto& e : stdfs::directory_iterator(out)) {
            std::error_code ec;
            if (stdfs::exists(e.path() / "logs" / "criu-dump.log", ec)) return true;
          }
          return false;
        },
        std::chrono::seconds(30)))
        << "trial " << trial;
    killed.kill(SIGKILL);
    killed.wait();
    EXPECT_TRUE(capture_lock_held(source.pid()))
        << "trial " << trial << ": the process was unlocked while its dump still ran";
    // Released once the guardian is done; then recover leaves nothing, the source answers.
    EXPECT_TRUE(
        eventually([&] { return !capture_lock_held(source.pid()); }, std::chrono::seconds(60)))
        << "trial " << trial;
    gpusnap({"recover", "--json"});
    EXPECT_TRUE(names_in(out).empty() || names_in(out) == std::vector<std::string>{"snap"});
    EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK") << "trial " << trial;
    stdfs::remove_all(out);
  }
}

// Two captures of one process started together, `kTrials` times: one wins, the other says so.
TEST_F(Faults, ConcurrentCapturesOfOneProcess) {
  constexpr int kTrials = 4;
  auto& source = start({"--mib", "32"});
  int refused = 0;
  for (int trial = 0; trial < kTrials; ++trial) {
    std::vector<CliResult> results(2);
    {
      std::vector<std::jthread> both;
      for (int i = 0; i < 2; ++i) {
        both.emplace_back([&, i] {
          results[i] =
              gpusnap({"checkpoint", "--pid", std::to_string(source.pid()), "-o",
                       (dir / ("snap-" + std::to_string(trial) + "-" + std::to_string(i))).string(),
                       "--leave-running"});
        });
      }
    }
    int ok = 0;
    for (const auto& r : results) {
      if (r.exit_code == 0) {
        ++ok;
        continue;
      }
      ++refused;
      expect_error(r, 2,
                   "process " + std::to_string(source.pid()) +
                       " is being captured by another gpusnap (fix: wait for that capture "
                       "to end, then try again)");
    }
    EXPECT_GE(ok, 1) << "trial " << trial;
    EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
  }
  std::printf("faults: %d concurrent pairs, %d captures refused as held\n", kTrials, refused);
}

}  // namespace
}  // namespace gpusnap::testing
