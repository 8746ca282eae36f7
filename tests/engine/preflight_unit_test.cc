// Preflight: what gpusnap refuses before it freezes anything, on synthetic process lists.
#include "engine/preflight.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "common/proc.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap::engine {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

proc::Process process(pid_t pid, const std::string& comm, std::vector<proc::OpenFile> files) {
  proc::Process p;
  p.pid = pid;
  p.ppid = 1;
  p.comm = comm;
  p.files = std::move(files);
  return p;
}

// A server and its worker, holding only what CRIU captures.
std::vector<proc::Process> capturable_tree() {
  return {process(100, "server",
                  {{0, "/dev/null"},
                   {1, "/tmp/out.log"},
                   {2, "pipe:[55]"},
                   {3, "socket:[77]"},
                   {4, "anon_inode:[eventfd]"},
                   {5, "anon_inode:[eventpoll]"}}),
          process(101, "worker", {{0, "/dev/null"}, {6, "anon_inode:[timerfd]"}})};
}

TEST(PreflightTest, AcceptsCapturableTree) {
  EXPECT_NO_THROW(refuse_uncapturable(capturable_tree()));
  EXPECT_NO_THROW(refuse_uncapturable({}));
}

TEST(PreflightTest, RefusesIoUringNamingProcessAndFd) {
  auto tree = capturable_tree();
  tree[1].pid = 4321;
  tree[1].comm = "node";
  tree[1].files.push_back({7, "anon_inode:[io_uring]"});
  Error e = catch_error([&] { refuse_uncapturable(tree); });
  EXPECT_EQ(e.kind(), ErrorKind::kNotCapturable);
  EXPECT_STREQ(e.what(), "process 4321 (node) holds an io_uring instance (fd 7), which CRIU cannot "
                         "checkpoint");
  EXPECT_TRUE(Contains(e.hint(), "`gpusnap run`"));
  EXPECT_TRUE(Contains(e.hint(), "UV_USE_IO_URING=0"));
}

TEST(PreflightTest, RefusesPerfEventsAndBpfPrograms) {
  auto tree = capturable_tree();
  tree[0].files.push_back({12, "anon_inode:[perf_event]"});
  Error e = catch_error([&] { refuse_uncapturable(tree); });
  EXPECT_EQ(e.kind(), ErrorKind::kNotCapturable);
  EXPECT_STREQ(e.what(),
               "process 100 (server) holds a perf event (fd 12), which CRIU cannot checkpoint");
  EXPECT_TRUE(Contains(e.hint(), "profiling"));

  tree = capturable_tree();
  tree[1].files.push_back({9, "anon_inode:bpf-prog"});
  e = catch_error([&] { refuse_uncapturable(tree); });
  EXPECT_EQ(e.kind(), ErrorKind::kNotCapturable);
  EXPECT_STREQ(e.what(),
               "process 101 (worker) holds a BPF program (fd 9), which CRIU cannot checkpoint");
}

TEST(PreflightTest, NamesTheFirstProblemInTreeOrder) {
  auto tree = capturable_tree();
  tree[0].files.push_back({20, "anon_inode:[io_uring]"});
  tree[1].files.push_back({8, "anon_inode:[io_uring]"});
  Error e = catch_error([&] { refuse_uncapturable(tree); });
  EXPECT_TRUE(Contains(e.what(), "process 100 (server)"));
  EXPECT_TRUE(Contains(e.what(), "(fd 20)"));
}

TEST(PreflightTest, ATerminalOnStdioMakesAShellJob) {
  EXPECT_FALSE(uses_terminal(capturable_tree()));
  EXPECT_FALSE(uses_terminal({}));
  for (int fd : {0, 1, 2}) {
    for (const char* tty : {"/dev/pts/3", "/dev/tty", "/dev/tty1", "/dev/console"}) {
      auto tree = capturable_tree();
      tree[1].files = {{fd, tty}};
      EXPECT_TRUE(uses_terminal(tree)) << "fd " << fd << " -> " << tty;
    }
  }
}

TEST(PreflightTest, ATerminalOnAnotherFdIsNotAShellJob) {
  auto tree = capturable_tree();
  tree[0].files.push_back({5, "/dev/pts/3"});
  EXPECT_FALSE(uses_terminal(tree));
  tree[0].files.push_back({3, "/dev/tty"});
  EXPECT_FALSE(uses_terminal(tree));
  tree[1].files = {{0, "/dev/ptmx"}, {1, "/dev/null"}, {2, "/tmp/dev/pts/1"}};
  EXPECT_FALSE(uses_terminal(tree));
}

TEST(PreflightTest, RefusesHostInit) {
  Error e = catch_error([] { refuse_bad_root(1); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_STREQ(e.what(), "pid 1 is the host's init and cannot be captured");
}

TEST(PreflightTest, RefusesItselfAndItsParents) {
  for (pid_t root : {::getpid(), ::getppid()}) {
    Error e = catch_error([&] { refuse_bad_root(root); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage);
    if (root == 1) continue;  // run directly under init: refused as init (above)
    EXPECT_EQ(std::string(e.what()),
              "pid " + std::to_string(root) + " is gpusnap itself or one of its parents");
    EXPECT_TRUE(Contains(e.hint(), "not of the shell"));
  }
}

TEST(PreflightTest, AcceptsAChild) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  EXPECT_NO_THROW(refuse_bad_root(child));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

TEST(CaptureRoomTest, ReadsMemAvailableFromMeminfo) {
  EXPECT_EQ(memory_available("MemTotal:       131961788 kB\nMemFree:  1 kB\n"
                             "MemAvailable:   131454724 kB\nBuffers: 2 kB\n"),
            131454724ull * 1024);
  EXPECT_EQ(memory_available("MemTotal: 5 kB\n"), 0u);
}

constexpr uint64_t kGiB = 1ull << 30;

CaptureRoom room(uint64_t gpu, uint64_t copied, bool in_ram, uint64_t available, uint64_t free) {
  CaptureRoom r;
  r.gpu_bytes = gpu * kGiB;
  r.copied_gpu_bytes = copied * kGiB;
  r.cpu_bytes = 0;
  r.store_in_ram = in_ram;
  r.memory_available = available * kGiB;
  r.store_free = free * kGiB;
  r.store = "/mnt/store";
  return r;
}

TEST(CaptureRoomTest, TheDirectPathNeedsTheGpuBytesOnceTheCopyTwice) {
  // 48 GiB on a RAM store of a host with 100 GiB available: written straight into the
  // artifact it fits; copied after the driver's call it needs 96 GiB of memory.
  EXPECT_NO_THROW(refuse_without_room(room(48, 0, true, 100, 110)));
  EXPECT_NO_THROW(refuse_without_room(room(48, 48, true, 100, 110)));
  Error e = catch_error([] { refuse_without_room(room(60, 60, true, 100, 110)); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_EQ(std::string(e.what()),
            "the capture needs 120.0 GiB of host memory (60.0 GiB of GPU memory the driver's "
            "checkpoint puts in the processes' own memory + 60.0 GiB of artifact in RAM "
            "(/mnt/store)), this host has 100.0 GiB available (MemAvailable)");
  EXPECT_TRUE(Contains(e.hint(), "libgpusnap-preload.so"));
  EXPECT_NO_THROW(refuse_without_room(room(60, 0, true, 100, 110)));
  // On disk the artifact is page cache, which can be reclaimed: only the driver's memory counts.
  EXPECT_NO_THROW(refuse_without_room(room(60, 60, false, 100, 110)));
}

TEST(CaptureRoomTest, AStoreTooSmallIsRefusedWithItsNumbers) {
  Error e = catch_error([] { refuse_without_room(room(16, 0, false, 100, 10)); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_EQ(std::string(e.what()),
            "the artifact needs up to 16.0 GiB (16.0 GiB of GPU memory + 0 B of CPU memory), "
            "/mnt/store has 10.0 GiB free");
}

}  // namespace
}  // namespace gpusnap::engine
