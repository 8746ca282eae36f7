// HugePageAdvisor on a real process: a large anonymous region that appears while it watches is
// advised (VmFlags "hg" in smaps), and nothing else is: not what was mapped before, not small
// regions, nothing when the advisor is inactive. (Each test maps one region: two adjacent
// anonymous mappings would merge into one.)
#include <sys/mman.h>
#include <sys/syscall.h>

#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/remote.h"
#include "engine/host_images.h"
#include "engine/huge_pages.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

// The VmFlags of the mapping of `pid` that starts at `start`; "" when there is none.
std::string vm_flags(pid_t pid, uint64_t start) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps");
  std::ostringstream want;
  want << std::hex << start << "-";
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(want.str(), 0) == 0) inside = true;
    if (inside && line.rfind("VmFlags:", 0) == 0) return line.substr(8);
  }
  return "";
}

bool has_flag(const std::string& flags, const std::string& flag) {
  std::istringstream words(flags);
  for (std::string w; words >> w;) {
    if (w == flag) return true;
  }
  return false;
}

// Maps `bytes` of private anonymous memory in `pid`, as the driver's checkpoint does.
uint64_t map_in(pid_t pid, uint64_t bytes) {
  RemoteThread thread(pid);
  long at = thread.syscall(SYS_mmap, 0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                           static_cast<uint64_t>(-1), 0);
  EXPECT_GT(at, 0);
  return static_cast<uint64_t>(at);
}

// The largest private anonymous mapping of `pid`.
Mapping largest_anonymous(pid_t pid) {
  Mapping best;
  for (const auto& m : read_mappings(pid)) {
    if (m.path.empty() && m.size() > best.size()) best = m;
  }
  return best;
}

TEST(HugePageAdvisor, AdvisesOnlyTheLargeRegionThatAppearsWhileItWatches) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir, {"--mib", "96"});  // its own 96 MiB exist before: never advised
  const pid_t pid = source.pid();
  const Mapping own = largest_anonymous(pid);
  ASSERT_GE(own.size(), 96 * kMiB);
  std::map<pid_t, std::vector<Mapping>> before{{pid, read_mappings(pid)}};

  engine::HugePageAdvisor advisor(before, true);
  const uint64_t large = map_in(pid, 128 * kMiB);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!has_flag(vm_flags(pid, large), "hg") && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto notes = advisor.stop();

  EXPECT_TRUE(has_flag(vm_flags(pid, large), "hg")) << vm_flags(pid, large);
  EXPECT_FALSE(has_flag(vm_flags(pid, own.start), "hg")) << vm_flags(pid, own.start);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0], "process " + std::to_string(pid) +
                          ": asked for huge pages in the 128.0 MiB the driver mapped");
  // The process is left running and answering, its own memory intact.
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
}

TEST(HugePageAdvisor, LeavesSmallRegionsAlone) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir);
  const pid_t pid = source.pid();
  std::map<pid_t, std::vector<Mapping>> before{{pid, read_mappings(pid)}};
  engine::HugePageAdvisor advisor(before, true);
  const uint64_t small = map_in(pid, engine::kMinHostImageBytes / 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(advisor.stop().empty());
  EXPECT_FALSE(vm_flags(pid, small).empty());
  EXPECT_FALSE(has_flag(vm_flags(pid, small), "hg")) << vm_flags(pid, small);
}

TEST(HugePageAdvisor, InactiveDoesNothing) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir);
  const pid_t pid = source.pid();
  std::map<pid_t, std::vector<Mapping>> before{{pid, read_mappings(pid)}};
  engine::HugePageAdvisor advisor(before, false);
  const uint64_t large = map_in(pid, 128 * kMiB);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(advisor.stop().empty());
  EXPECT_FALSE(vm_flags(pid, large).empty());
  EXPECT_FALSE(has_flag(vm_flags(pid, large), "hg")) << vm_flags(pid, large);
}

TEST(HugePageAdvisor, AProcessThatEndsIsLeftAloneWithANote) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  auto source = std::make_unique<Workload>(dir);
  const pid_t pid = source->pid();
  std::map<pid_t, std::vector<Mapping>> before{{pid, read_mappings(pid)}};
  engine::HugePageAdvisor advisor(before, true);
  source.reset();  // killed and reaped
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto notes = advisor.stop();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].rfind("process " + std::to_string(pid) + ": no huge pages", 0), 0u)
      << notes[0];
}

}  // namespace
}  // namespace gpusnap::testing
