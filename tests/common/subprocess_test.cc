// Subprocess and run_capture: exit statuses, timeouts, no stray children, and exactly the
// descriptors and environment a child is given.
#include "common/subprocess.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/fd.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap {
namespace {

using namespace gpusnap::testing;  // testing/unit.h
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Everything until EOF.
std::string read_all(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(buf, static_cast<size_t>(n));
  }
}

common::SpawnOptions command(std::vector<std::string> argv) {
  common::SpawnOptions o;
  o.argv = std::move(argv);
  return o;
}

// A program of the build tree, found from this test binary (build/tests/).
std::string built(const std::string& relative) {
  auto exe = std::filesystem::read_symlink("/proc/self/exe");
  return (exe.parent_path().parent_path() / relative).string();
}

// Whether a process with this pid exists (a zombie counts).
bool pid_exists(pid_t pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

TEST(RunCaptureTest, CapturesOutputAndExitCode) {
  common::RunResult r = common::run_capture({"/bin/echo", "hello", "world"});
  EXPECT_TRUE(r.status.exited);
  EXPECT_EQ(r.status.code, 0);
  EXPECT_TRUE(r.status.ok());
  EXPECT_EQ(r.output, "hello world\n");
  EXPECT_EQ(r.status.describe(), "exited with code 0");
}

TEST(RunCaptureTest, CapturesStdoutAndStderrTogether) {
  common::RunResult r = common::run_capture({"/bin/sh", "-c", "echo out; echo err >&2; exit 3"});
  EXPECT_EQ(r.output, "out\nerr\n");
  EXPECT_TRUE(r.status.exited);
  EXPECT_EQ(r.status.code, 3);
  EXPECT_FALSE(r.status.ok());
}

TEST(RunCaptureTest, CapturesMoreThanAPipeBuffer) {
  common::RunResult r = common::run_capture({"/bin/sh", "-c", "head -c 200000 /dev/zero"});
  EXPECT_TRUE(r.status.ok());
  EXPECT_EQ(r.output, std::string(200000, '\0'));
}

TEST(RunCaptureTest, FalseExitsWithOne) {
  common::RunResult r = common::run_capture({"/bin/false"});
  EXPECT_TRUE(r.status.exited);
  EXPECT_EQ(r.status.code, 1);
  EXPECT_FALSE(r.status.ok());
  EXPECT_EQ(r.status.describe(), "exited with code 1");
  EXPECT_EQ(r.output, "");
}

TEST(RunCaptureTest, MissingProgramExitsWith127) {
  common::RunResult r = common::run_capture({"/nonexistent/program", "--version"});
  EXPECT_TRUE(r.status.exited);
  EXPECT_EQ(r.status.code, 127);
}

TEST(RunCaptureTest, ProgramWithoutSlashIsLookedUpOnPath) {
  common::RunResult r = common::run_capture({"echo", "found"});
  EXPECT_TRUE(r.status.ok());
  EXPECT_EQ(r.output, "found\n");
}

TEST(RunCaptureTest, ReportsDeathBySignal) {
  common::RunResult r = common::run_capture({"/bin/sh", "-c", "kill -TERM $$"});
  EXPECT_FALSE(r.status.exited);
  EXPECT_EQ(r.status.code, SIGTERM);
  EXPECT_FALSE(r.status.ok());
  EXPECT_TRUE(Contains(r.status.describe(), "killed by signal 15 ("));
}

TEST(RunCaptureTest, TimeoutKillsTheCommand) {
  auto start = Clock::now();
  Error e = catch_error([] { common::run_capture({"/bin/sleep", "10"}, 100ms); });
  auto elapsed = Clock::now() - start;
  EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
  EXPECT_STREQ(e.what(), "/bin/sleep did not finish within 100 ms");
  EXPECT_GE(elapsed, 100ms);
  EXPECT_LT(elapsed, 1s);
}

TEST(RunCaptureTest, TimeoutAppliesAfterTheCommandClosesItsOutput) {
  // EOF comes at once, but the command runs on: the timeout must still hold.
  auto start = Clock::now();
  Error e = catch_error([] {
    common::run_capture({"/bin/sh", "-c", "exec >&- 2>&-; sleep 10"}, 200ms);
  });
  auto elapsed = Clock::now() - start;
  EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
  EXPECT_STREQ(e.what(), "/bin/sh did not finish within 200 ms");
  EXPECT_GE(elapsed, 200ms);
  EXPECT_LT(elapsed, 2s);
}

TEST(RunCaptureTest, CommandThatClosesItsOutputAndExitsIsNotATimeout) {
  common::RunResult r =
      common::run_capture({"/bin/sh", "-c", "echo early; exec >&- 2>&-; sleep 0.2; exit 5"}, 5s);
  EXPECT_TRUE(r.status.exited);
  EXPECT_EQ(r.status.code, 5);
  EXPECT_EQ(r.output, "early\n");
}

TEST(RunCaptureTest, GrandchildHoldingTheOutputOpenDoesNotDelayTheResult) {
  // The command exits at once but leaves a background process with its stdout: EOF would come
  // only when that one ends, after the timeout. The command finished, so that is no timeout.
  auto start = Clock::now();
  common::RunResult r = common::run_capture(
      {"/bin/sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x; sleep 5 & echo $!; exit 3"}, 2s);
  auto elapsed = Clock::now() - start;
  EXPECT_LT(elapsed, 1500ms);
  EXPECT_TRUE(r.status.exited);
  EXPECT_EQ(r.status.code, 3);
  // All the command wrote before it exited is there: 100000 x, then the background pid.
  ASSERT_GT(r.output.size(), 100000u);
  EXPECT_EQ(r.output.substr(0, 100000), std::string(100000, 'x'));
  pid_t grandchild = static_cast<pid_t>(std::stol(r.output.substr(100000)));
  ASSERT_GT(grandchild, 0);
  EXPECT_EQ(::kill(grandchild, SIGKILL), 0) << "the background process should still run";
}

TEST(SubprocessTest, DestructionKillsAndReapsARunningChild) {
  pid_t pid = 0;
  auto start = Clock::now();
  {
    common::Subprocess child(command({"/bin/sleep", "10"}));
    pid = child.pid();
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(child.running());
    EXPECT_EQ(child.poll(), std::nullopt);
  }
  EXPECT_LT(Clock::now() - start, 1s);
  errno = 0;
  EXPECT_EQ(::kill(pid, 0), -1) << "the child still exists (as a zombie?)";
  EXPECT_EQ(errno, ESRCH);
}

TEST(SubprocessTest, WaitWithTimeoutLeavesTheChildRunning) {
  common::Subprocess child(command({"/bin/sleep", "10"}));
  auto start = Clock::now();
  EXPECT_EQ(child.wait(50ms), std::nullopt);
  EXPECT_GE(Clock::now() - start, 50ms);
  EXPECT_TRUE(child.running());
  child.kill(SIGTERM);
  std::optional<common::ExitStatus> status = child.wait(2s);
  ASSERT_TRUE(status.has_value());
  EXPECT_FALSE(status->exited);
  EXPECT_EQ(status->code, SIGTERM);
  EXPECT_FALSE(child.running());
  EXPECT_EQ(child.poll()->code, SIGTERM) << "the status is kept";
}

TEST(SubprocessTest, WaitWithTimeoutNeverReturnsEarly) {
  common::Subprocess child(command({"/bin/sleep", "10"}));
  for (auto timeout : {1ms, 2ms, 3ms, 5ms, 7ms, 10ms, 13ms}) {
    for (int i = 0; i < 5; ++i) {
      auto start = Clock::now();
      EXPECT_EQ(child.wait(timeout), std::nullopt);
      EXPECT_GE(Clock::now() - start, timeout) << timeout.count() << " ms";
    }
  }
}

TEST(SubprocessTest, ReleasedChildOutlivesItsSubprocess) {
  pid_t pid = 0;
  {
    common::Subprocess child(command({"/bin/sleep", "10"}));
    pid = child.release();
    EXPECT_FALSE(child.running());
  }
  EXPECT_TRUE(pid_exists(pid));
  // The caller owns it now: adopt it again to end it.
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  int raw = 0;
  EXPECT_EQ(::waitpid(pid, &raw, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(raw));
}

TEST(SubprocessTest, MovedFromSubprocessDoesNotKill) {
  common::Subprocess a(command({"/bin/sh", "-c", "exit 4"}));
  pid_t pid = a.pid();
  common::Subprocess b(std::move(a));
  EXPECT_EQ(b.pid(), pid);
  EXPECT_FALSE(a.running());  // NOLINT(bugprone-use-after-move): moved-from is defined here
  std::optional<common::ExitStatus> status = b.wait();
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->exited);
  EXPECT_EQ(status->code, 4);
}

TEST(SubprocessTest, RefusesEmptyCommand) {
  Error e = catch_error([] { common::Subprocess child(common::SpawnOptions{}); });
  EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  EXPECT_STREQ(e.what(), "spawn: empty command");
}

TEST(SubprocessTest, KeptFdArrivesAtTheRequestedNumber) {
  common::Pipe pipe = common::Pipe::make();
  common::SpawnOptions o = command({"/bin/sh", "-c", "printf 'via fd 5' >&5"});
  o.keep_fds = {{pipe.write.get(), 5}};
  common::Subprocess child(o);
  pipe.write.reset();
  EXPECT_EQ(read_all(pipe.read.get()), "via fd 5");
  std::optional<common::ExitStatus> status = child.wait();
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->ok()) << status->describe();
}

TEST(SubprocessTest, KeptFdsSurviveExecAndMayCrossNumbers) {
  // Two pipes delivered at each other's numbers: the moves must not clobber one another.
  common::Pipe a = common::Pipe::make();
  common::Pipe b = common::Pipe::make();
  const int fa = a.write.get();
  const int fb = b.write.get();
  common::SpawnOptions o;
  o.argv = {"/bin/sh", "-c", "echo A >&" + std::to_string(fb) + "; echo B >&" + std::to_string(fa)};
  o.keep_fds = {{fa, fb}, {fb, fa}};
  common::Subprocess child(o);
  a.write.reset();
  b.write.reset();
  EXPECT_EQ(read_all(a.read.get()), "A\n");
  EXPECT_EQ(read_all(b.read.get()), "B\n");
  EXPECT_TRUE(child.wait()->ok());
}

TEST(SubprocessTest, ChildHasOnlyKeptFds) {
  common::Pipe parent_pipe = common::Pipe::make();  // O_CLOEXEC: closed by the exec
  common::UniqueFd inheritable(
      ::dup(parent_pipe.read.get()));  // no O_CLOEXEC: closed by Subprocess
  ASSERT_TRUE(inheritable);
  common::Pipe kept = common::Pipe::make();
  common::SpawnOptions o = command(
      {built("tests/fd_probe"), "closed", std::to_string(parent_pipe.write.get()), "closed",
       std::to_string(inheritable.get()), "open", "100", "open", "0", "open", "1", "open", "2"});
  o.keep_fds = {{kept.write.get(), 100}};
  common::Subprocess child(o);
  std::optional<common::ExitStatus> status = child.wait();
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->exited);
  EXPECT_EQ(status->code, 0) << "10: CLOEXEC fd open, 11: plain fd open, 12: kept fd closed, "
                                "13-15: stdio closed (it is /dev/null)";
}

TEST(SubprocessTest, ForkFailureNamesTheProgram) {
  common::SpawnOptions c = command({"/bin/true"});
  c.clone_flags = CLONE_SIGHAND;  // without CLONE_VM: clone fails with EINVAL
  Error e = catch_error([&] { common::Subprocess child(c); });
  EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  EXPECT_EQ(std::string(e.what()), std::string("fork /bin/true: ") + std::strerror(EINVAL));
}

TEST(SubprocessTest, StdioGoesWhereAsked) {
  common::Pipe in = common::Pipe::make();
  common::Pipe out = common::Pipe::make();
  common::SpawnOptions o;
  o.argv = {"/bin/sh", "-c", "read line; echo \"got $line\"; echo nothing >&2"};
  o.stdin_fd = in.read.get();
  o.stdout_fd = out.write.get();  // stderr: /dev/null
  common::Subprocess child(o);
  in.read.reset();
  out.write.reset();
  ASSERT_EQ(::write(in.write.get(), "ping\n", 5), 5);
  in.write.reset();
  EXPECT_EQ(read_all(out.read.get()), "got ping\n");
  EXPECT_TRUE(child.wait()->ok());
}

TEST(SubprocessTest, EnvAddReachesTheChildAndReplaces) {
  ::setenv("GPUSNAP_TEST_REPLACED", "old", 1);
  common::Pipe out = common::Pipe::make();
  common::SpawnOptions o;
  o.argv = {"/usr/bin/env"};
  o.env_add = {"GPUSNAP_TEST_ADDED=hello there", "GPUSNAP_TEST_REPLACED=new"};
  o.stdout_fd = out.write.get();
  common::Subprocess child(o);
  out.write.reset();
  const std::string env = "\n" + read_all(out.read.get());
  ::unsetenv("GPUSNAP_TEST_REPLACED");
  EXPECT_TRUE(child.wait()->ok());
  EXPECT_TRUE(Contains(env, "\nGPUSNAP_TEST_ADDED=hello there\n"));
  EXPECT_TRUE(Contains(env, "\nGPUSNAP_TEST_REPLACED=new\n"));
  EXPECT_FALSE(Contains(env, "GPUSNAP_TEST_REPLACED=old"));
  EXPECT_TRUE(Contains(env, "\nPATH=")) << "the rest of our environment is kept";
}

}  // namespace
}  // namespace gpusnap
