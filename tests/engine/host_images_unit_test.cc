// Which memory becomes a host image: the ranges the driver's checkpoint mapped, nothing else.
#include <gtest/gtest.h>

#include <vector>

#include "engine/host_images.h"

namespace gpusnap::engine {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

common::Mapping anon(uint64_t start, uint64_t end, std::string perms = "rw-p") {
  return {start, end, std::move(perms), 0, ""};
}

TEST(HostImageRanges, ANewRegionIsFound) {
  std::vector<common::Mapping> before = {anon(0x1000, 0x2000),
                                         {0x400000, 0x500000, "r-xp", 0, "/bin/x"}};
  std::vector<common::Mapping> after = before;
  after.push_back(anon(0x7f0000000000, 0x7f0000000000 + 256 * kMiB));
  auto ranges = new_anonymous_ranges(before, after, 64 * kMiB);
  ASSERT_EQ(ranges.size(), 1u);
  EXPECT_EQ(ranges[0], (Range{0x7f0000000000, 0x7f0000000000 + 256 * kMiB}));
}

TEST(HostImageRanges, OnlyTheGrowthOfAMergedRegionIsFound) {
  // The kernel merges a new anonymous region with an adjacent one of the same flags.
  const uint64_t base = 0x7f0000000000;
  std::vector<common::Mapping> before = {anon(base, base + 4 * kMiB)};
  std::vector<common::Mapping> after = {anon(base - 128 * kMiB, base + 4 * kMiB + 128 * kMiB)};
  auto ranges = new_anonymous_ranges(before, after, 64 * kMiB);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0], (Range{base - 128 * kMiB, base}));
  EXPECT_EQ(ranges[1], (Range{base + 4 * kMiB, base + 4 * kMiB + 128 * kMiB}));
}

TEST(HostImageRanges, SmallSharedFileAndReadOnlyMemoryIsLeftToCriu) {
  const uint64_t base = 0x7f0000000000;
  std::vector<common::Mapping> after = {
      anon(base, base + 16 * kMiB),                                          // too small
      anon(base + 1024 * kMiB, base + 1280 * kMiB, "rw-s"),                  // shared
      {base + 2048 * kMiB, base + 2304 * kMiB, "rw-p", 0, "/data/weights"},  // a file
      anon(base + 3072 * kMiB, base + 3328 * kMiB, "r--p"),                  // read-only
  };
  EXPECT_TRUE(new_anonymous_ranges({}, after, 64 * kMiB).empty());
}

TEST(HostImageRanges, NothingNewMeansNothing) {
  std::vector<common::Mapping> maps = {anon(0x7f0000000000, 0x7f0000000000 + 512 * kMiB)};
  EXPECT_TRUE(new_anonymous_ranges(maps, maps, 64 * kMiB).empty());
}

TEST(HostImageZeroBlocks, OnlyAllZeroIsZero) {
  std::vector<unsigned char> block(64 * 1024 + 13, 0);
  EXPECT_TRUE(all_zero(block.data(), block.size()));
  for (size_t at : {size_t{0}, size_t{63}, size_t{64}, block.size() - 1}) {
    block[at] = 1;
    EXPECT_FALSE(all_zero(block.data(), block.size())) << at;
    block[at] = 0;
  }
}

// Lines as /proc/self/mountinfo writes them (the H200 machine's /dev/shm among them).
constexpr const char* kMountinfo =
    "21 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "22 21 0:5 / /dev rw,relatime shared:2 - devtmpfs devtmpfs rw,size=65984560k\n"
    "23 22 0:20 / /dev/shm rw,relatime shared:3 - tmpfs tmpfs rw,size=131981020k\n"
    "40 21 0:35 / /run/snap\\040store rw,relatime shared:9 - tmpfs store "
    "rw,size=104857600k,huge=within_size\n"
    "41 23 0:36 / /dev/shm rw,relatime shared:10 - tmpfs tmpfs rw,size=1024k,huge=always\n";

TEST(HostImageStore, TheMountHoldingAPathIsTheLongestPrefixAndTheLastOnTop) {
  EXPECT_EQ(mount_options_of("/var/tmp/a", kMountinfo), "rw");
  EXPECT_EQ(mount_options_of("/dev/null", kMountinfo), "rw,size=65984560k");
  EXPECT_EQ(mount_options_of("/dev/shm/snap", kMountinfo), "rw,size=1024k,huge=always");
  EXPECT_EQ(mount_options_of("/dev/shmx", kMountinfo), "rw,size=65984560k");  // not /dev/shm
  EXPECT_EQ(mount_options_of("/run/snap store/x", kMountinfo),
            "rw,size=104857600k,huge=within_size");
  EXPECT_EQ(mount_options_of("/run/snap", kMountinfo), "rw");
}

TEST(HostImageStore, OnlyHugeOptionsThatGivePagesCount) {
  EXPECT_TRUE(tmpfs_gives_huge_pages("rw,huge=within_size"));
  EXPECT_TRUE(tmpfs_gives_huge_pages("rw,huge=always,size=1k"));
  EXPECT_TRUE(tmpfs_gives_huge_pages("huge=advise"));
  EXPECT_FALSE(tmpfs_gives_huge_pages("rw,huge=never"));
  EXPECT_FALSE(tmpfs_gives_huge_pages("rw,size=131981020k"));
  EXPECT_FALSE(tmpfs_gives_huge_pages(""));
}

}  // namespace
}  // namespace gpusnap::engine
