// Reading processes from /proc: this test process, a forked tree, a zombie, a pid that does
// not exist.
#include "common/proc.h"

#include <errno.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/subprocess.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap::proc {
namespace {

using namespace gpusnap::testing;  // testing/unit.h
using namespace std::chrono_literals;

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// A pid above the kernel's pid_max: no process can have it.
pid_t impossible_pid() {
  return static_cast<pid_t>(std::stol(first_line("/proc/sys/kernel/pid_max")) + 1);
}

const OpenFile* find_fd(const Process& p, int fd) {
  for (const auto& f : p.files) {
    if (f.fd == fd) return &f;
  }
  return nullptr;
}

// A child that forks a grandchild and waits for it; both are killed and reaped on destruction.
class ForkedTree {
 public:
  ForkedTree() {
    common::Pipe report = common::Pipe::make();
    child_ = ::fork();
    if (child_ < 0) throw std::runtime_error("fork failed");
    if (child_ == 0) {
      pid_t grandchild = ::fork();
      if (grandchild == 0) {
        for (;;) ::pause();
      }
      (void)::write(report.write.get(), &grandchild, sizeof grandchild);
      int raw = 0;
      while (::waitpid(grandchild, &raw, 0) < 0 && errno == EINTR) {
      }
      ::_exit(0);
    }
    report.write.reset();
    if (::read(report.read.get(), &grandchild_, sizeof grandchild_) !=
        static_cast<ssize_t>(sizeof grandchild_)) {
      grandchild_ = 0;
    }
  }
  ForkedTree(const ForkedTree&) = delete;
  ForkedTree& operator=(const ForkedTree&) = delete;
  ~ForkedTree() {
    if (grandchild_ > 0) ::kill(grandchild_, SIGKILL);  // the child reaps it and exits
    ::kill(child_, SIGKILL);
    ::waitpid(child_, nullptr, 0);
  }

  pid_t child() const { return child_; }
  pid_t grandchild() const { return grandchild_; }

 private:
  pid_t child_ = 0;
  pid_t grandchild_ = 0;
};

TEST(ProcTest, ReadsThisProcess) {
  common::Pipe pipe = common::Pipe::make();
  Process p = read_process(::getpid());
  EXPECT_EQ(p.pid, ::getpid());
  EXPECT_EQ(p.ppid, ::getppid());
  EXPECT_EQ(p.comm, first_line("/proc/self/comm"));
  EXPECT_FALSE(p.comm.empty());
  EXPECT_EQ(p.state, 'R');
  EXPECT_GE(p.threads, 1);
  EXPECT_GT(p.rss_bytes, 0u);
  EXPECT_EQ(p.rss_bytes % 1024, 0u);
  ASSERT_FALSE(p.cmdline.empty());
  EXPECT_EQ(p.cmdline[0], program_invocation_name);
  ASSERT_FALSE(p.nspid.empty());
  EXPECT_EQ(p.nspid.back(), ::getpid());
  EXPECT_EQ(innermost_pid(p), ::getpid());
  for (int fd : {0, 1, 2}) EXPECT_NE(find_fd(p, fd), nullptr) << "fd " << fd;
  const OpenFile* read_end = find_fd(p, pipe.read.get());
  ASSERT_NE(read_end, nullptr);
  EXPECT_EQ(read_end->target.rfind("pipe:[", 0), 0u) << read_end->target;
  EXPECT_TRUE(std::is_sorted(p.files.begin(), p.files.end(),
                             [](const OpenFile& a, const OpenFile& b) { return a.fd < b.fd; }));
}

TEST(ProcTest, MissingProcessIsNotFound) {
  const pid_t pid = impossible_pid();
  Error e = catch_error([&] { read_process(pid); });
  EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
  EXPECT_EQ(std::string(e.what()), "no process with pid " + std::to_string(pid));
  EXPECT_EQ(e.hint(), "check the pid with `ps -p " + std::to_string(pid) + "`");
  for (pid_t bad : {0, -1}) {
    EXPECT_EQ(catch_error([&] { read_process(bad); }).kind(), ErrorKind::kNotFound) << bad;
  }
  EXPECT_EQ(catch_error([&] { read_tree(pid); }).kind(), ErrorKind::kNotFound);
}

TEST(ProcTest, Exists) {
  EXPECT_TRUE(exists(::getpid()));
  EXPECT_TRUE(exists(1));
  EXPECT_FALSE(exists(0));
  EXPECT_FALSE(exists(-1));
  EXPECT_FALSE(exists(impossible_pid()));
}

TEST(ProcTest, ReadsAForkedTreeParentsFirst) {
  ForkedTree t;
  ASSERT_GT(t.grandchild(), 0);
  std::vector<Process> tree = read_tree(t.child());
  ASSERT_EQ(tree.size(), 2u);
  EXPECT_EQ(tree[0].pid, t.child());
  EXPECT_EQ(tree[0].ppid, ::getpid());
  EXPECT_EQ(tree[1].pid, t.grandchild());
  EXPECT_EQ(tree[1].ppid, t.child());
  EXPECT_EQ(tree[1].comm, tree[0].comm);

  EXPECT_EQ(children(t.child()), std::vector<pid_t>{t.grandchild()});
  EXPECT_TRUE(children(t.grandchild()).empty());
  auto ours = children(::getpid());
  EXPECT_NE(std::find(ours.begin(), ours.end(), t.child()), ours.end());
  EXPECT_TRUE(children(impossible_pid()).empty());

  // Without a new PID namespace, a pid means the same inside and out.
  EXPECT_EQ(host_pid_in_namespace(t.child(), t.grandchild()), t.grandchild());
  EXPECT_EQ(host_pid_in_namespace(t.child(), impossible_pid()), 0);

  std::vector<Process> subtree = read_tree(t.grandchild());
  ASSERT_EQ(subtree.size(), 1u);
  EXPECT_EQ(subtree[0].pid, t.grandchild());
}

TEST(ProcTest, ReadsAZombie) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(3);
  // Not reaped yet: it stays a zombie until waitpid below.
  Process p;
  for (auto deadline = std::chrono::steady_clock::now() + 2s;
       std::chrono::steady_clock::now() < deadline; std::this_thread::sleep_for(1ms)) {
    p = read_process(child);
    if (p.state == 'Z') break;
  }
  EXPECT_EQ(p.state, 'Z');
  EXPECT_EQ(p.ppid, ::getpid());
  EXPECT_EQ(p.rss_bytes, 0u);
  EXPECT_TRUE(p.files.empty());
  EXPECT_TRUE(exists(child));
  int raw = 0;
  ASSERT_EQ(::waitpid(child, &raw, 0), child);
  EXPECT_FALSE(exists(child));
  EXPECT_EQ(catch_error([&] { read_process(child); }).kind(), ErrorKind::kNotFound);
}

TEST(ProcTest, EnvironmentValueIsTheWholeValueOfTheWholeName) {
  common::SpawnOptions o;
  o.argv = {"/bin/sleep", "30"};
  o.env_add = {"GPUSNAP_TEST_A=1", "GPUSNAP_TEST_AB=two=2", "GPUSNAP_TEST_EMPTY="};
  common::Subprocess child(o);
  // Until the exec, the child's environment is ours.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (environment_value(child.pid(), "GPUSNAP_TEST_A") != "1" &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(environment_value(child.pid(), "GPUSNAP_TEST_A"), "1");
  EXPECT_EQ(environment_value(child.pid(), "GPUSNAP_TEST_AB"), "two=2");
  EXPECT_EQ(environment_value(child.pid(), "GPUSNAP_TEST_EMPTY"), "");
  // A name that only begins another, or that is not there at all, has no value.
  EXPECT_EQ(environment_value(child.pid(), "GPUSNAP_TEST"), std::nullopt);
  EXPECT_EQ(environment_value(child.pid(), "GPUSNAP_TEST_NONE"), std::nullopt);
  EXPECT_EQ(environment_value(impossible_pid(), "PATH"), std::nullopt);
  child.kill(SIGKILL);
}

TEST(ProcTest, JoinCmdline) {
  EXPECT_EQ(join_cmdline({"python3", "serve.py", "--port", "80"}), "python3 serve.py --port 80");
  EXPECT_EQ(join_cmdline({"one"}), "one");
  EXPECT_EQ(join_cmdline({}), "");
}

}  // namespace
}  // namespace gpusnap::proc
