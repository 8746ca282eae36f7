// Where gpusnap finds libgpusnap-preload.so, how it puts it into a workload's environment, and
// how it waits for the library's helper threads.
#include "engine/preload.h"

#include <pthread.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "testing/unit.h"

namespace gpusnap::engine {
namespace {

using testing::ScopedEnv;

TEST(PreloadLibrary, FoundBesideTheRunningBinaryOrNamedOrNone) {
  {
    // The unit test binary is build/tests/...: nothing beside it, and ../lib/gpusnap is absent.
    // So without the variable: none, or the one an installed tree holds.
    ::unsetenv(kPreloadEnv);  // NOLINT(concurrency-mt-unsafe)
    auto found = find_preload_library();
    if (found) {
      EXPECT_EQ(found->filename(), kPreloadFileName);
    }
  }
  testing::TempDir dir;
  auto lib = dir / "libgpusnap-preload.so";
  testing::write(lib, "not really a library, but readable");
  {
    ScopedEnv env(kPreloadEnv, lib.string());
    ASSERT_TRUE(find_preload_library());
    EXPECT_EQ(*find_preload_library(), lib);
    ScopedEnv existing("LD_PRELOAD", "/opt/other.so");
    EXPECT_EQ(preload_environment(), "LD_PRELOAD=" + lib.string() + ":/opt/other.so");
  }
  {
    ScopedEnv env(kPreloadEnv, "");
    EXPECT_FALSE(find_preload_library());
    EXPECT_FALSE(preload_environment());
  }
  {
    ScopedEnv env(kPreloadEnv, (dir / "missing.so").string());
    auto e = testing::error_of([] { find_preload_library(); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->kind(), ErrorKind::kUsage);
    EXPECT_NE(std::string(e->what()).find("missing.so, which cannot be read"), std::string::npos)
        << e->what();
  }
}

TEST(PreloadLibrary, SeenInAProcesssMappings) {
  std::vector<common::Mapping> maps(2);
  maps[0].path = "/usr/lib/x86_64-linux-gnu/libc.so.6";
  EXPECT_FALSE(maps_preload_library(maps));
  maps[1].path = "/opt/gpusnap/bin/libgpusnap-preload.so";
  EXPECT_TRUE(maps_preload_library(maps));
}

TEST(PreloadLibrary, WaitsForTheHelperThreadsAndGivesUpAtTheLimit) {
  // A thread of this process named as the library's helpers are, for 300 ms.
  auto helper = [] {
    pthread_setname_np(pthread_self(), kFillThreadName);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  };
  {
    std::thread t(helper);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto still = wait_for_fill_threads({::getpid()}, std::chrono::milliseconds(50));
    EXPECT_EQ(still, std::vector<pid_t>{::getpid()});
    t.join();
  }
  {
    std::thread t(helper);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto began = std::chrono::steady_clock::now();
    auto still = wait_for_fill_threads({::getpid()}, std::chrono::seconds(10));
    EXPECT_TRUE(still.empty());
    EXPECT_GE(std::chrono::steady_clock::now() - began, std::chrono::milliseconds(200));
    t.join();
  }
  // No helper: no wait. A process that is gone has nothing left to populate.
  EXPECT_TRUE(wait_for_fill_threads({::getpid(), 1 << 22}, std::chrono::seconds(10)).empty());
}

}  // namespace
}  // namespace gpusnap::engine
