// RemoteThread on a real child process: system calls run in it, memory written into it, and
// afterwards it carries on exactly where it was (its blocked read() restarts and completes).
#include "common/syscall_injection.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "common/fd.h"

namespace gpusnap {
namespace {

// A child blocked in read() on a pipe; it echoes what it reads, then exits.
class EchoChild {
 public:
  EchoChild() {
    int to[2], from[2];
    EXPECT_EQ(::pipe(to), 0);
    EXPECT_EQ(::pipe(from), 0);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(to[1]);
      ::close(from[0]);
      char buf[64];
      ssize_t n = ::read(to[0], buf, sizeof buf);
      if (n > 0) (void)!::write(from[1], buf, static_cast<size_t>(n));
      ::_exit(n > 0 ? 0 : 1);
    }
    ::close(to[0]);
    ::close(from[1]);
    to_.reset(to[1]);
    from_.reset(from[0]);
    // Let it reach the read().
    for (int i = 0; i < 1000; ++i) {
      std::string stat;
      char state = '?';
      if (FILE* f = std::fopen(("/proc/" + std::to_string(pid_) + "/stat").c_str(), "r")) {
        char line[512] = {};
        if (std::fgets(line, sizeof line, f)) {
          const char* close = std::strrchr(line, ')');
          if (close) state = close[2];
        }
        std::fclose(f);
      }
      if (state == 'S') break;
      ::usleep(1000);
    }
  }
  ~EchoChild() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // Sends `text`, returns the echo and the child's exit code.
  std::pair<std::string, int> echo(const std::string& text) {
    EXPECT_EQ(::write(to_.get(), text.data(), text.size()), static_cast<ssize_t>(text.size()));
    char buf[64] = {};
    ssize_t n = ::read(from_.get(), buf, sizeof buf);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = 0;
    return {std::string(buf, n > 0 ? static_cast<size_t>(n) : 0),
            WIFEXITED(status) ? WEXITSTATUS(status) : -1};
  }

 private:
  pid_t pid_ = 0;
  common::UniqueFd to_, from_;
};

TEST(RemoteThread, RunsSystemCallsInTheTargetAndLeavesItAsItWas) {
  EchoChild child;
  uint64_t page = 0;
  {
    common::RemoteThread thread(child.pid());
    EXPECT_EQ(thread.syscall(SYS_getpid), child.pid());
    long mapped = thread.syscall(SYS_mmap, 0, 4096, PROT_READ | PROT_WRITE,
                                 MAP_PRIVATE | MAP_ANONYMOUS, static_cast<uint64_t>(-1), 0);
    ASSERT_GT(mapped, 0);
    page = static_cast<uint64_t>(mapped);
    const char text[] = "written by gpusnap";
    thread.write_memory(page, text, sizeof text);
    char back[sizeof text] = {};
    iovec local{back, sizeof back};
    iovec remote{reinterpret_cast<void*>(page), sizeof back};
    ASSERT_EQ(::process_vm_readv(child.pid(), &local, 1, &remote, 1, 0),
              static_cast<ssize_t>(sizeof back));
    EXPECT_STREQ(back, text);
    // A failing call returns the kernel's negative errno, not an exception.
    EXPECT_EQ(thread.syscall(SYS_close, 9999), -EBADF);
  }
  // The mapping persists in the child after the detach.
  bool found = false;
  for (const auto& m : common::read_mappings(child.pid())) found |= m.start == page;
  EXPECT_TRUE(found);
  // The child's interrupted read() restarted: it still echoes and exits normally.
  auto [echo, code] = child.echo("ping");
  EXPECT_EQ(echo, "ping");
  EXPECT_EQ(code, 0);
}

TEST(RemoteThread, RefusesAProcessThatDoesNotExist) {
  EXPECT_ANY_THROW(common::RemoteThread(999999999));
}

}  // namespace
}  // namespace gpusnap
