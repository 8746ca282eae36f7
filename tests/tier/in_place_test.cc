// A fill's files read in place (src/tier/in_place.h) against the fake driver, which refuses a
// registration over pages registered already and a copy that reads across two registrations, as
// the driver does.
#include "tier/in_place.h"

#include <fcntl.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "gpusnap/error.h"
#include "testing/unit.h"
#include "tier/fake_tier_driver.h"

namespace gpusnap::tier {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

constexpr std::size_t kWindow = InPlaceFiles::kWindowBytes;

class InPlaceTest : public ::testing::Test {
 protected:
  // One file of `size` bytes, each byte its offset's low byte, opened for reading.
  void make_file(std::uint64_t size) {
    const auto path = dir / ("f" + std::to_string(paths.size()));
    std::ofstream out(path, std::ios::binary);
    std::vector<char> block(1 << 20);
    for (std::uint64_t at = 0; at < size; at += block.size()) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(block.size(), size - at));
      for (std::size_t i = 0; i < n; ++i) block[i] = static_cast<char>((at + i) & 0xff);
      out.write(block.data(), static_cast<std::streamsize>(n));
    }
    out.close();
    paths.push_back(path);
    fds.emplace_back(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fds.back());
  }

  FakeTierDriver driver;
  TempDir dir;
  std::vector<std::filesystem::path> paths;
  std::vector<common::UniqueFd> fds;
};

TEST_F(InPlaceTest, ARangeIsCutAtWindowBoundariesOnly) {
  using Parts = std::vector<std::pair<std::uint64_t, std::size_t>>;
  EXPECT_EQ(InPlaceFiles::split(0, 4096), (Parts{{0, 4096}}));
  EXPECT_EQ(InPlaceFiles::split(kWindow - 100, 300), (Parts{{kWindow - 100, 100}, {kWindow, 200}}));
  EXPECT_EQ(InPlaceFiles::split(kWindow, kWindow), (Parts{{kWindow, kWindow}}));
  EXPECT_TRUE(InPlaceFiles::split(5, 0).empty());
}

TEST_F(InPlaceTest, TheBytesAreTheFilesAndEachWindowIsRegisteredOnceWhileHeld) {
  make_file(2 * kWindow + 12345);
  InPlaceFiles files(driver, paths, fds);
  EXPECT_EQ(files.size(0), 2 * kWindow + 12345);
  EXPECT_EQ(*files.at(0, kWindow + 7), static_cast<unsigned char>((kWindow + 7) & 0xff));
  {
    // Two ranges in the first two windows, one across both: each window registered once.
    auto a = files.hold(0, 100, 4096);
    auto b = files.hold(0, kWindow - 10, 20);
    auto c = files.hold(0, 2 * kWindow, 12345);  // the last window, shorter than the others
    ASSERT_TRUE(a && b && c);
    EXPECT_EQ(driver.registrations(), 3u);
    EXPECT_EQ(driver.registered(), 3u);
    EXPECT_EQ(driver.calls_named("host_register"),
              (std::vector<std::string>{"host_register " + std::to_string(kWindow),
                                        "host_register " + std::to_string(kWindow),
                                        "host_register 12345"}));
    b.reset();
    EXPECT_EQ(driver.registered(), 2u);  // the second window had no other holder
    a.reset();
    EXPECT_EQ(driver.registered(), 1u);
  }
  EXPECT_EQ(driver.registered(), 0u);
  EXPECT_EQ(driver.calls_named("host_unregister").size(), 3u);
}

// Many workers holding and letting go of the same windows at once: never two registrations of
// one window (the fake throws), and none left.
TEST_F(InPlaceTest, WorkersSharingWindowsNeverRegisterOneTwice) {
  make_file(4 * kWindow);
  InPlaceFiles files(driver, paths, fds);
  std::vector<std::thread> workers;
  std::atomic<int> failures{0};
  for (int w = 0; w < 8; ++w) {
    workers.emplace_back([&, w] {
      try {
        for (int i = 0; i < 200; ++i) {
          const std::uint64_t at =
              (static_cast<std::uint64_t>(w * 7919 + i * 104729) << 10) % (4 * kWindow - (1 << 20));
          auto h = files.hold(0, at, 1 << 20);
          if (!h) ++failures;
        }
      } catch (const std::exception&) {
        ++failures;
      }
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(driver.registered(), 0u);
  EXPECT_FALSE(files.refused());
}

TEST_F(InPlaceTest, ARefusedRegistrationIsAnEmptyHoldAndNoneIsAskedAgain) {
  make_file(2 * kWindow);
  InPlaceFiles files(driver, paths, fds);
  driver.fail_next("host_register", 2);
  // The range spans two windows: the first registers, the second is refused, and the first is
  // let go again.
  EXPECT_FALSE(files.hold(0, kWindow - 10, 20));
  EXPECT_TRUE(files.refused());
  EXPECT_EQ(driver.registered(), 0u);
  EXPECT_FALSE(files.hold(0, 0, 10));
  EXPECT_EQ(driver.calls_named("host_register").size(), 2u);
}

TEST_F(InPlaceTest, ARangePastTheFilesEndIsADamagedArtifact) {
  make_file(1000);
  make_file(0);  // an empty file maps to nothing and holds nothing
  InPlaceFiles files(driver, paths, fds);
  const Error e = catch_error([&] { (void)files.hold(0, 900, 200); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(std::string(e.what()), "memory tier: " + paths[0].string() +
                                       " ends at byte 1000, before the contents the drain wrote "
                                       "there");
  EXPECT_EQ(catch_error([&] { (void)files.hold(1, 0, 1); }).kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(catch_error([&] { (void)files.hold(2, 0, 1); }).kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(driver.registered(), 0u);
}

}  // namespace
}  // namespace gpusnap::tier
