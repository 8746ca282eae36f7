// The one worker pool (src/common/worker_pool.h): every worker runs, the first failure is the
// one the caller sees and stops the rest, the others are joined before it is rethrown.
#include "common/worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap::common {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

TEST(WorkerPool, EveryWorkerRunsOnAThreadOfItsOwn) {
  std::mutex mu;
  std::set<std::size_t> ks;
  std::set<std::thread::id> ids;
  run_workers(4, [&](std::size_t k, const std::atomic<bool>&) {
    std::lock_guard lock(mu);
    ks.insert(k);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ks, (std::set<std::size_t>{0, 1, 2, 3}));
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 0u);
  run_workers(0, [](std::size_t, const std::atomic<bool>&) { FAIL() << "no worker asked for"; });
}

TEST(WorkerPool, TheFirstErrorIsRethrownAfterTheOthersHaveReturnedAndStopsThem) {
  std::atomic<int> returned{0};
  std::atomic<bool> saw_stop{false};
  const Error e = catch_error([&] {
    run_workers(3, [&](std::size_t k, const std::atomic<bool>& stop) {
      if (k == 0) throw Error(ErrorKind::kBadArtifact, "worker 0 failed");
      // The others wait for the stop the failure sets, then fail too, later: theirs is dropped.
      while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      saw_stop = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ++returned;
      throw Error(ErrorKind::kInternal, "a later failure");
    });
  });
  EXPECT_EQ(std::string(e.what()), "worker 0 failed");
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_TRUE(saw_stop.load());
  EXPECT_EQ(returned.load(), 2);  // joined before the rethrow
}

TEST(WorkerPool, ForEachIndexTakesEveryIndexOnceAndTicksOnTheCallingThread) {
  std::vector<std::atomic<int>> taken(1000);
  std::atomic<int> ticks{0};
  const auto caller = std::this_thread::get_id();
  // Two threads and ten 30 ms sleeps: one thread runs at least 150 ms, past the first tick.
  for_each_index(
      taken.size(), 2,
      [&](std::size_t i) {
        ++taken[i];
        if (i % 100 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(30));
      },
      [&] {
        EXPECT_EQ(std::this_thread::get_id(), caller);
        ++ticks;
      });
  for (const auto& t : taken) ASSERT_EQ(t.load(), 1);
  EXPECT_GE(ticks.load(), 2);  // while they ran, and once at the end
  int none = 0;
  for_each_index(
      0, 4, [&](std::size_t) { ++none; }, [&] { ++ticks; });
  EXPECT_EQ(none, 0);
}

TEST(WorkerPool, ForEachIndexTakesNoIndexAfterAFailure) {
  std::atomic<std::size_t> ran{0};
  EXPECT_THROW(for_each_index(100000, 2,
                              [&](std::size_t i) {
                                ++ran;
                                if (i == 10) throw std::runtime_error("index 10");
                              }),
               std::runtime_error);
  EXPECT_LT(ran.load(), 100000u);
}

TEST(WorkerPool, ADestroyedPoolStopsItsWorkersAndKeepsTheirFailure) {
  std::atomic<bool> stopped{false};
  {
    WorkerPool pool(2, [&](std::size_t, const std::atomic<bool>& stop) {
      while (!stop) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      stopped = true;
      throw Error(ErrorKind::kInternal, "stopped");
    });
    EXPECT_FALSE(pool.stopping());
  }  // no join: the destructor stops and waits, and throws nothing
  EXPECT_TRUE(stopped.load());
}

}  // namespace
}  // namespace gpusnap::common
