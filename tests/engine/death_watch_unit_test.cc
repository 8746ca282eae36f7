// DeathWatch on real child processes: how each one's end is told, and that the living and a
// recycled pid are not taken for deaths.
#include "engine/death_watch.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "common/proc.h"

namespace gpusnap::engine {
namespace {

// A child that sleeps until told otherwise; the caller reaps it.
pid_t sleeper() {
  pid_t pid = ::fork();
  if (pid == 0) {
    for (;;) ::pause();
  }
  return pid;
}

bool is_zombie(pid_t pid) {
  auto f = stat_fields(pid);
  return !f.empty() && f[0] == "Z";
}

void wait_zombie(pid_t pid) {
  for (int i = 0; i < 2000 && !is_zombie(pid); ++i) ::usleep(1000);
}

TEST(DeathWatch, TellsHowEachProcessEndedAndNothingForTheLiving) {
  pid_t alive = sleeper(), killed = sleeper(), reaped = sleeper();
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  pid_t exits = ::fork();
  if (exits == 0) {  // exits with status 3 once told
    char c;
    ::close(go[1]);
    (void)!::read(go[0], &c, 1);
    ::_exit(3);
  }
  ::close(go[0]);
  std::vector<proc::Process> tree;
  for (pid_t pid : {alive, killed, exits, reaped}) tree.push_back(proc::read_process(pid));
  DeathWatch watch(tree);
  EXPECT_TRUE(watch.deaths().empty());

  ::kill(killed, SIGTERM);
  ::close(go[1]);
  ::kill(reaped, SIGKILL);
  wait_zombie(killed);
  wait_zombie(exits);
  ::waitpid(reaped, nullptr, 0);

  auto deaths = watch.deaths();
  ASSERT_EQ(deaths.size(), 3u);
  EXPECT_EQ(deaths[0].rfind("process " + std::to_string(killed) + " (", 0), 0u) << deaths[0];
  EXPECT_NE(deaths[0].find(") was killed by SIGTERM"), std::string::npos) << deaths[0];
  EXPECT_NE(deaths[1].find(") exited with status 3"), std::string::npos) << deaths[1];
  EXPECT_NE(deaths[2].find(") exited (reaped by its parent before gpusnap could read how)"),
            std::string::npos)
      << deaths[2];

  ::kill(alive, SIGKILL);
  for (pid_t pid : {alive, killed, exits}) ::waitpid(pid, nullptr, 0);
}

TEST(DeathWatch, DescribesWaitStatuses) {
  EXPECT_EQ(describe_wait_status(SIGSEGV), "was killed by SIGSEGV");
  EXPECT_EQ(describe_wait_status(SIGABRT | 0x80), "was killed by SIGABRT (core dumped)");
  EXPECT_EQ(describe_wait_status(3 << 8), "exited with status 3");
}

}  // namespace
}  // namespace gpusnap::engine
