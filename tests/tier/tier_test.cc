// The memory tier's logic against the fake driver: allocation bookkeeping, the drain and fill
// order, and every failure path (docs/memory-tier.md). The files are real, in a
// scratch directory; only the GPU is faked, its memory being host memory that the tests write
// and read through the mappings as a kernel would.
#include "tier/memory_tier.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "gpusnap/error.h"
#include "gpusnap/tier_api.h"
#include "testing/unit.h"
#include "tier/fake_tier_driver.h"
#include "tier/layout.h"

namespace gpusnap::tier {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr pid_t kPid = 4242;
const auto kStreamA = reinterpret_cast<Stream>(0xa000);  // NOLINT(performance-no-int-to-ptr)
const auto kStreamB = reinterpret_cast<Stream>(0xb000);  // NOLINT(performance-no-int-to-ptr)

DevicePtr va(void* p) { return reinterpret_cast<DevicePtr>(p); }

std::vector<std::string> files_in(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::size_t index_of(const std::vector<std::string>& calls, const std::string& prefix,
                     bool last = false) {
  std::size_t found = calls.size();
  for (std::size_t i = 0; i < calls.size(); ++i) {
    if (calls[i].rfind(prefix, 0) == 0) {
      found = i;
      if (!last) break;
    }
  }
  return found;
}

class TierTest : public ::testing::Test {
 protected:
  // Three workers with 1 MiB buffers and pieces: several pieces per allocation, several files.
  TierTest() : driver(2, 96 * kMiB), tier(std::make_unique<Tier>(driver, settings(), kPid)) {}

  static TierSettings settings() {
    TierSettings s;
    s.streams = 3;
    s.buffer_bytes = kMiB;
    s.piece_bytes = kMiB;
    return s;
  }

  void* alloc(std::size_t size, int device = 0, Stream stream = kStreamA) {
    void* p = tier->allocate(size, device, stream);
    EXPECT_NE(p, nullptr);
    return p;
  }

  // Bytes that differ per allocation and per position (sizes are multiples of 8).
  static std::vector<std::uint64_t> words(std::size_t size, unsigned seed) {
    std::vector<std::uint64_t> w(size / 8);
    for (std::size_t i = 0; i < w.size(); ++i)
      w[i] = (seed + 1) * 0x9E3779B97F4A7C15ULL ^ (i * 0x100000001B3ULL);
    return w;
  }
  void pattern(void* p, std::size_t size, unsigned seed) {
    const auto w = words(size, seed);
    driver.write(va(p), w.data(), size);
  }
  void expect_pattern(void* p, std::size_t size, unsigned seed) {
    const auto want = words(size, seed);
    std::vector<std::uint64_t> got(size / 8);
    driver.read(va(p), got.data(), size);
    EXPECT_TRUE(got == want) << "contents of " << p << " (" << size << " bytes) differ";
  }

  FakeTierDriver driver;
  TempDir dir;
  std::unique_ptr<Tier> tier;
};

// ---- bookkeeping ---------------------------------------------------------------------------

TEST_F(TierTest, SmallRequestsShareOneSegmentAndAreRoundedTo512Bytes) {
  void* a = alloc(100);
  void* b = alloc(1000);
  EXPECT_EQ(va(b), va(a) + 512);
  EXPECT_EQ(driver.calls_named("create"), (std::vector<std::string>{"create 0 2097152"}));
  const TierStats s = tier->stats();
  EXPECT_EQ(s.segments, 1u);
  EXPECT_EQ(s.live_bytes, 512u + 1024u);
  EXPECT_EQ(s.cached_bytes, 2 * kMiB - 512 - 1024);
}

TEST_F(TierTest, ASegmentIsReservedCreatedMappedAndMadeAccessibleInThatOrder) {
  void* p = alloc(5 * kMiB);
  char where[32];
  std::snprintf(where, sizeof where, "0x%llx", static_cast<unsigned long long>(va(p)));
  EXPECT_EQ(driver.calls(),
            (std::vector<std::string>{"enter_device 0", "granularity 0", "device_uuid 0",
                                      "create 0 20971520", "reserve 20971520",
                                      std::string("map ") + where,
                                      std::string("set_access ") + where + " 0", "leave_device"}));
}

TEST_F(TierTest, LargeRequestsGetASegmentOfTheirOwnRoundedToTheGranularity) {
  void* p = alloc(33 * kMiB + 1);
  EXPECT_EQ(driver.calls_named("create"), (std::vector<std::string>{"create 0 35651584"}));
  // The rest of the segment (1 MiB - 512) is too small to be split off in the large pool.
  EXPECT_EQ(tier->stats().live_bytes, 34 * kMiB);
  tier->free(p);
  EXPECT_EQ(tier->stats().live_bytes, 0u);
}

TEST_F(TierTest, AFreedBlockIsReusedOnTheSameStreamOnly) {
  void* a = alloc(4096, 0, kStreamA);
  tier->free(a);
  void* b = alloc(4096, 0, kStreamB);
  EXPECT_NE(b, a) << "a block freed on one stream must not go to another";
  void* c = alloc(4096, 0, kStreamA);
  EXPECT_EQ(c, a);
  EXPECT_EQ(driver.calls_named("create").size(), 2u);  // one small segment per stream
}

TEST_F(TierTest, FreedNeighboursMergeSoThatALargerRequestFitsAgain) {
  void* a = alloc(512 * 1024);
  void* b = alloc(512 * 1024);
  void* c = alloc(1024 * 1024);  // the rest of the 2 MiB segment
  (void)c;
  EXPECT_EQ(driver.calls_named("create").size(), 1u);
  tier->free(b);
  tier->free(a);
  void* d = alloc(1024 * 1024);
  EXPECT_EQ(d, a) << "a and b merged into one 1 MiB block at a";
  EXPECT_EQ(driver.calls_named("create").size(), 1u);
}

TEST_F(TierTest, ABlockFreedAfterItsCaptureEndedIsNeverReused) {
  driver.set_capturing(kStreamA, true);
  void* g = alloc(8192);
  driver.set_capturing(kStreamA, false);
  tier->free(g);  // PyTorch frees the graph's tensors after the capture; the graph keeps them
  void* p = alloc(8192);
  EXPECT_NE(p, g);
  const TierStats s = tier->stats();
  EXPECT_EQ(s.graph_bytes, 8192u);
  EXPECT_EQ(s.live_bytes, 2 * 8192u);
}

TEST_F(TierTest, ACaptureReusesWhatItFreedItself) {
  driver.set_capturing(kStreamA, true);
  void* a = alloc(8192);
  void* b = alloc(8192);
  tier->free(a);
  tier->free(b);  // merges with a: one 16 KiB block of the capture's pool
  EXPECT_EQ(alloc(16384), a) << "the graph replays in capture order: a and b's memory is free";
  EXPECT_EQ(tier->stats().live_bytes, 16384u);
  EXPECT_EQ(driver.calls_named("create").size(), 1u);
}

TEST_F(TierTest, WhatACaptureFreedIsNeverHandedOutOutsideIt) {
  driver.set_capturing(kStreamA, true);
  void* g = alloc(8192);
  tier->free(g);
  driver.set_capturing(kStreamA, false);
  EXPECT_NE(alloc(8192), g) << "outside any capture";
  driver.set_capturing(kStreamA, true);  // the next capture, with an id of its own
  EXPECT_NE(alloc(8192), g) << "in another capture";
  const TierStats s = tier->stats();
  EXPECT_EQ(s.live_bytes, 2 * 8192u);
  EXPECT_EQ(s.graph_bytes, 2 * 8192u) << "the first capture's free block and the second's";
}

TEST_F(TierTest, AStreamJoinedToACaptureSharesItsPool) {
  driver.set_capturing(kStreamA, true);
  driver.join_capture(kStreamB, kStreamA);
  void* side = alloc(8192, 0, kStreamB);
  tier->free(side);
  EXPECT_EQ(alloc(8192, 0, kStreamB), side);
  EXPECT_EQ(tier->stats().graph_bytes, 8192u);
}

// A serving thread whose first GPU use is a tensor has no CUDA context current: the allocation
// enters the device's context itself and leaves the thread as it found it.
TEST_F(TierTest, AThreadWithNoContextCurrentAllocatesAndFreesGraphBlocks) {
  driver.set_capturing(kStreamA, true);
  void* g = alloc(8192);  // a graph block: freeing it asks about the capture too
  driver.set_capturing(kStreamA, false);
  void* p = nullptr;
  std::string error;
  std::thread t([&] {
    try {
      p = tier->allocate(kMiB, 0, kStreamA);
      tier->free(p);
      tier->free(g);
    } catch (const Error& e) {
      error = e.what();
    }
  });
  t.join();
  EXPECT_EQ(error, "");
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(driver.entered(), 0) << "the thread's context left as it was";
  EXPECT_EQ(tier->stats().graph_bytes, 8192u) << "the graph's block stays live after its capture";
}

TEST_F(TierTest, AFreeThatCannotAskAboutTheCaptureKeepsTheBlockLive) {
  driver.set_capturing(kStreamA, true);
  void* g = alloc(8192);
  driver.fail_next("capture_id");
  EXPECT_EQ(catch_error([&] { tier->free(g); }).kind(), ErrorKind::kGpu);
  EXPECT_EQ(tier->stats().live_bytes, 8192u) << "the graph may still replay into it";
  EXPECT_NE(alloc(8192), g);
}

TEST_F(TierTest, ACaptureTakesFromTheCacheAndNeverGivesItBack) {
  void* cached = alloc(kMiB);
  tier->free(cached);
  EXPECT_EQ(tier->stats().cached_bytes, 2 * kMiB) << "its small segment, whole";
  driver.set_capturing(kStreamA, true);
  void* g = alloc(kMiB);
  EXPECT_EQ(g, cached) << "a capture takes from the cache when its pool has nothing";
  tier->free(g);
  driver.set_capturing(kStreamA, false);
  EXPECT_EQ(tier->stats().graph_bytes, kMiB);
  EXPECT_NE(alloc(kMiB), g);
  // The drain gives back idle segments but not this one: the graph replays into g. Nothing in
  // g is saved (the graph writes it before it reads it); the fill maps it again.
  const TransferReport r = tier->drain(dir.path());
  EXPECT_EQ(r.bytes, kMiB) << "only the block allocated after the capture";
  EXPECT_EQ(driver.reservations(), 1u);
  tier->fill(dir.path(), {});
  pattern(g, kMiB, 3);
  expect_pattern(g, kMiB, 3);
}

TEST_F(TierTest, FreeingWhatTheTierDidNotHandOutIsAnError) {
  void* p = alloc(4096);
  tier->free(p);
  const Error twice = catch_error([&] { tier->free(p); });
  char text[128];
  std::snprintf(text, sizeof text,
                "the memory tier was asked to free 0x%llx, which it did not hand out",
                static_cast<unsigned long long>(va(p)));
  EXPECT_EQ(std::string(twice.what()), text);
  EXPECT_EQ(tier->allocate(0, 0, kStreamA), nullptr);
  tier->free(nullptr);  // as free(NULL): nothing
}

TEST_F(TierTest, OutOfMemoryTrimsTheCacheAndRetriesOnce) {
  void* big = alloc(60 * kMiB);
  tier->free(big);  // cached: the device has 96 MiB, 60 of them in the cache
  driver.clear_calls();
  void* other = alloc(50 * kMiB, 0, kStreamB);
  ASSERT_NE(other, nullptr);
  const auto calls = driver.calls();
  // The first create fails, the device is synchronised, the idle segment returned whole
  // (unmapped, released, its reservation freed), and the create is tried again.
  const std::size_t oom = index_of(calls, "create 0 52428800 out-of-memory");
  const std::size_t sync = index_of(calls, "synchronize 0");
  const std::size_t unmap = index_of(calls, "unmap ");
  const std::size_t freed = index_of(calls, "address_free ");
  const std::size_t retry = index_of(calls, "create 0 52428800", true);
  ASSERT_LT(oom, calls.size());
  EXPECT_LT(oom, sync);
  EXPECT_LT(sync, unmap);
  EXPECT_LT(unmap, freed);
  EXPECT_LT(freed, retry);
  EXPECT_EQ(tier->stats().segments, 1u);
}

TEST_F(TierTest, OutOfMemoryWithNothingCachedIsAClearError) {
  alloc(60 * kMiB);
  const Error e = catch_error([&] { tier->allocate(50 * kMiB, 0, kStreamA); });
  EXPECT_EQ(e.kind(), ErrorKind::kGpu);
  EXPECT_EQ(std::string(e.what()),
            "out of GPU memory: the memory tier could not get 50 MiB more on device 0");
  EXPECT_EQ(e.hint(), "free tensors, or give the workload a GPU with more free memory");
}

TEST_F(TierTest, NoTrimWhileAStreamCapturesAGraph) {
  void* big = alloc(60 * kMiB, 0, kStreamB);
  tier->free(big);
  driver.set_capturing(kStreamA, true);
  driver.clear_calls();
  EXPECT_EQ(catch_error([&] { tier->allocate(50 * kMiB, 0, kStreamA); }).kind(), ErrorKind::kGpu);
  EXPECT_TRUE(driver.calls_named("synchronize").empty()) << "synchronising invalidates a capture";
}

TEST_F(TierTest, AFailedMapGivesBackThePhysicalMemoryAndTheReservation) {
  driver.fail_next("map");
  EXPECT_EQ(catch_error([&] { tier->allocate(4 * kMiB, 0, kStreamA); }).kind(), ErrorKind::kGpu);
  EXPECT_EQ(driver.handles(), 0u);
  EXPECT_EQ(driver.reservations(), 0u);
  EXPECT_EQ(tier->stats().segments, 0u);
}

// ---- drain and fill ------------------------------------------------------------------------

TEST_F(TierTest, DrainThenFillPutsBackEveryLiveByteAtTheSameAddress) {
  void* small = alloc(3000);
  void* medium = alloc(6 * kMiB + 4096);
  void* large = alloc(40 * kMiB);
  void* other_gpu = alloc(3 * kMiB, 1);
  void* freed = alloc(2 * kMiB);
  pattern(small, 3072, 1);
  pattern(medium, 6 * kMiB + 4096, 2);
  pattern(large, 40 * kMiB, 3);
  pattern(other_gpu, 3 * kMiB, 4);
  tier->free(freed);
  driver.clear_calls();  // the allocations' own entries (allocate() enters the device too)

  const TransferReport drained = tier->drain(dir.path());
  EXPECT_EQ(drained.bytes, 3072 + 6 * kMiB + 4096 + 40 * kMiB + 3 * kMiB);
  EXPECT_EQ(drained.files, 3u);
  EXPECT_EQ(tier->state(), TierState::kReleased);
  // Physical memory gone, every reservation of a live segment kept, no pinned buffer or stream
  // left behind (they would enter the snapshot).
  EXPECT_EQ(driver.handles(), 0u);
  EXPECT_EQ(driver.mappings(), 0u);
  EXPECT_EQ(driver.reservations(), 4u);
  EXPECT_EQ(driver.host_allocations(), 0u);
  EXPECT_EQ(driver.streams(), 0u);
  EXPECT_EQ(files_in(dir.path()),
            (std::vector<std::string>{"4242-w0.img", "4242-w1.img", "4242-w2.img", "4242.json",
                                      "4242.layout"}));
  std::uintmax_t on_disk = 0;
  for (int k = 0; k < 3; ++k)
    on_disk += std::filesystem::file_size(dir / ("4242-w" + std::to_string(k) + ".img"));
  EXPECT_EQ(on_disk, drained.bytes);

  const TransferReport filled = tier->fill(dir.path(), {});
  EXPECT_EQ(filled.bytes, drained.bytes);
  // Both ran with a context of the tier's made current, and put back what was there before.
  EXPECT_EQ(driver.calls_named("enter_device"),
            (std::vector<std::string>{"enter_device 0", "enter_device 0"}));
  EXPECT_EQ(driver.entered(), 0);
  EXPECT_EQ(tier->state(), TierState::kServing);
  EXPECT_EQ(driver.host_allocations(), 0u);
  EXPECT_EQ(driver.streams(), 0u);
  expect_pattern(small, 3072, 1);
  expect_pattern(medium, 6 * kMiB + 4096, 2);
  expect_pattern(large, 40 * kMiB, 3);
  expect_pattern(other_gpu, 3 * kMiB, 4);
  // The allocator works on after the round trip, in the same segments.
  EXPECT_EQ(alloc(2 * kMiB), freed);
}

// A fill reads its files in place (tier/in_place.h): every slice copied straight from the
// file's pages, registered a window at a time (the fake refuses a copy across two registrations
// or a second registration of one window), and every window let go once the fill is done. Pieces
// of odd sizes put slices across windows' boundaries; three workers share each file's windows.
TEST_F(TierTest, AFillCopiesEveryByteStraightFromTheFilesPagesAndLetsGoOfThemAll) {
  TierSettings s = settings();
  s.in_place = true;
  tier = std::make_unique<Tier>(driver, s, kPid);
  void* a = alloc(40 * kMiB + 4096);
  void* b = alloc(3 * kMiB + 512);
  void* c = alloc(17 * kMiB, 1);
  pattern(a, 40 * kMiB + 4096, 1);
  pattern(b, 3 * kMiB + 512, 2);
  pattern(c, 17 * kMiB, 3);
  const TransferReport drained = tier->drain(dir.path());
  const TransferReport filled = tier->fill(dir.path(), {});
  EXPECT_EQ(filled.in_place_bytes, drained.bytes);
  EXPECT_GT(driver.registrations(), 0u);
  EXPECT_EQ(driver.registered(), 0u);
  EXPECT_EQ(driver.host_allocations(), 0u);
  expect_pattern(a, 40 * kMiB + 4096, 1);
  expect_pattern(b, 3 * kMiB + 512, 2);
  expect_pattern(c, 17 * kMiB, 3);
}

// Registering the pages caps a fill below what the buffers move (docs/memory-tier.md, "Read in
// place"): a fill reads in place only when asked to.
TEST_F(TierTest, ByDefaultEveryByteGoesThroughThePinnedBuffers) {
  EXPECT_FALSE(TierSettings{}.in_place.has_value());
  void* a = alloc(20 * kMiB + 512);
  pattern(a, 20 * kMiB + 512, 4);
  tier->drain(dir.path());
  EXPECT_EQ(tier->fill(dir.path(), {}).in_place_bytes, 0u);
  EXPECT_EQ(driver.registrations(), 0u);
  expect_pattern(a, 20 * kMiB + 512, 4);
}

// Where the driver will not register a file's pages (no read-only registration on the device,
// or pages it cannot lock), the rest of the fill goes through the buffers, exactly.
TEST_F(TierTest, ARefusedRegistrationSendsTheRestThroughThePinnedBuffers) {
  TierSettings s = settings();
  s.in_place = true;
  tier = std::make_unique<Tier>(driver, s, kPid);
  void* a = alloc(40 * kMiB);
  pattern(a, 40 * kMiB, 5);
  const TransferReport drained = tier->drain(dir.path());
  driver.fail_next("host_register");
  const TransferReport filled = tier->fill(dir.path(), {});
  EXPECT_LT(filled.in_place_bytes, drained.bytes);
  EXPECT_EQ(driver.registered(), 0u);
  expect_pattern(a, 40 * kMiB, 5);
}

// GPUSNAP_TIER_IN_PLACE: "1" or "0" decide for every fill; unset (or anything else), a fill reads
// in place where its files still arrive.
TEST(TierSettings, InPlaceIsGivenByItsVariableOrLeftToTheFill) {
  const char* saved = std::getenv("GPUSNAP_TIER_IN_PLACE");
  const std::string before = saved != nullptr ? saved : "";
  ::unsetenv("GPUSNAP_TIER_IN_PLACE");
  EXPECT_FALSE(TierSettings::from_environment().in_place.has_value());
  ::setenv("GPUSNAP_TIER_IN_PLACE", "1", 1);
  EXPECT_EQ(TierSettings::from_environment().in_place, std::optional<bool>(true));
  ::setenv("GPUSNAP_TIER_IN_PLACE", "0", 1);
  EXPECT_EQ(TierSettings::from_environment().in_place, std::optional<bool>(false));
  ::setenv("GPUSNAP_TIER_IN_PLACE", "yes", 1);
  EXPECT_FALSE(TierSettings::from_environment().in_place.has_value());
  if (saved != nullptr) {
    ::setenv("GPUSNAP_TIER_IN_PLACE", before.c_str(), 1);
  } else {
    ::unsetenv("GPUSNAP_TIER_IN_PLACE");
  }
}

// Pieces are what a worker takes, buffers what one copy moves: pieces larger than the buffers
// go through them a buffer at a time, each copy within its pinned buffer (the fake refuses one
// that is not), each piece's slices one after the other in its worker's file.
TEST_F(TierTest, PiecesLargerThanTheBuffersMoveABufferAtATime) {
  TierSettings s = settings();
  s.streams = 1;  // one file, in the order of the pieces
  s.buffer_bytes = 256 << 10;
  s.piece_bytes = 3 * kMiB;
  tier = std::make_unique<Tier>(driver, s, kPid);
  void* p = alloc(7 * kMiB + 4096);
  pattern(p, 7 * kMiB + 4096, 5);
  auto copy_sizes = [&](const std::string& name) {
    std::vector<std::size_t> sizes;
    for (const auto& call : driver.calls_named(name)) {
      sizes.push_back(std::stoull(call.substr(call.rfind(' ') + 1)));
    }
    return sizes;
  };
  auto largest = [](const std::vector<std::size_t>& v) {
    return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
  };
  driver.clear_calls();
  tier->drain(dir.path());
  const auto out = copy_sizes("copy_to_host");
  EXPECT_EQ(out.size(), 12u + 12u + 5u);  // 3 MiB, 3 MiB, 1 MiB + 4 KiB in 256 KiB slices
  EXPECT_EQ(largest(out), std::size_t{256} << 10);
  const TierLayout layout = read_layout(dir / "4242.layout");
  ASSERT_EQ(layout.pieces.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(layout.pieces[i].size, i < 2 ? 3 * kMiB : kMiB + 4096) << i;
    EXPECT_EQ(layout.pieces[i].offset, i * 3 * kMiB) << i;
    EXPECT_EQ(layout.pieces[i].file, 0u) << i;
  }
  driver.clear_calls();
  tier->fill(dir.path(), {});
  const auto in = copy_sizes("copy_to_device");
  EXPECT_EQ(in.size(), out.size());
  EXPECT_EQ(largest(in), std::size_t{256} << 10);
  expect_pattern(p, 7 * kMiB + 4096, 5);
}

TEST_F(TierTest, TheIndexListsTheFilesAndTheBytesPerGpu) {
  // One worker: which worker takes which piece is otherwise up to the threads.
  TierSettings one = settings();
  one.streams = 1;
  tier = std::make_unique<Tier>(driver, one, kPid);
  pattern(alloc(3 * kMiB), 3 * kMiB, 1);
  pattern(alloc(kMiB, 1), kMiB, 2);
  tier->drain(dir.path());
  std::ifstream in(dir / "4242.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "{\"format\":\"gpusnap-tier\",\"version\":1,\"pid\":4242,\"bytes\":4194304,"
                  "\"files\":[{\"path\":\"4242-w0.img\",\"size\":4194304}],"
                  "\"gpus\":[{\"uuid\":\"GPU-fake-0\",\"bytes\":3145728},"
                  "{\"uuid\":\"GPU-fake-1\",\"bytes\":1048576}]}\n");
}

TEST_F(TierTest, DrainSynchronisesFirstCopiesEverythingThenReleasesKeepingReservations) {
  void* a = alloc(5 * kMiB);
  void* b = alloc(30 * kMiB);
  void* idle = alloc(30 * kMiB, 0, kStreamB);
  tier->free(idle);  // a wholly free segment: trimmed, not saved
  driver.clear_calls();
  tier->drain(dir.path());
  const auto calls = driver.calls();
  const std::size_t last_sync = index_of(calls, "synchronize", true);
  const std::size_t first_copy = index_of(calls, "copy_to_host");
  const std::size_t last_copy = index_of(calls, "copy_to_host", true);
  const std::size_t first_unmap_after_copies = [&] {
    for (std::size_t i = last_copy; i < calls.size(); ++i) {
      if (calls[i].rfind("unmap", 0) == 0) return i;
    }
    return calls.size();
  }();
  EXPECT_LT(last_sync, first_copy);
  EXPECT_LT(last_copy, first_unmap_after_copies);
  // Before the copies, only the idle segment went, whole, reservation included.
  EXPECT_EQ(driver.calls_named("address_free").size(), 1u);
  EXPECT_EQ(driver.calls_named("copy_to_host").size(), 35u);  // 1 MiB pieces
  // After them, the two live segments: unmapped and released, reservations kept.
  EXPECT_EQ(driver.calls_named("unmap").size(), 3u);
  EXPECT_EQ(driver.calls_named("release").size(), 3u);
  EXPECT_EQ(driver.reservations(), 2u);
  (void)a;
  (void)b;
}

TEST_F(TierTest, AFailedCopyDuringTheDrainReleasesNothingAndLeavesNoFile) {
  void* p = alloc(10 * kMiB);
  pattern(p, 10 * kMiB, 7);
  driver.fail_next("copy_to_host", 4);
  const Error e = catch_error([&] { tier->drain(dir.path()); });
  EXPECT_EQ(std::string(e.what()), "copy_to_host failed: CUDA_ERROR_UNKNOWN (fake driver)");
  EXPECT_EQ(tier->state(), TierState::kServing);
  EXPECT_TRUE(driver.calls_named("unmap").empty());
  EXPECT_TRUE(files_in(dir.path()).empty());
  EXPECT_EQ(driver.entered(), 0);
  EXPECT_EQ(driver.host_allocations(), 0u);
  EXPECT_EQ(driver.streams(), 0u);
  expect_pattern(p, 10 * kMiB, 7);
  // And the next drain works.
  tier->drain(dir.path());
  tier->fill({}, {});
  expect_pattern(p, 10 * kMiB, 7);
}

TEST_F(TierTest, AFileThatCannotBeCreatedFailsTheDrainBeforeAnyCopy) {
  pattern(alloc(4 * kMiB), 4 * kMiB, 1);
  gpusnap::testing::write(dir / "4242-w1.img", "somebody else's");
  const Error e = catch_error([&] { tier->drain(dir.path()); });
  EXPECT_EQ(std::string(e.what()),
            "memory tier: cannot create " + (dir / "4242-w1.img").string() + ": File exists");
  EXPECT_TRUE(driver.calls_named("copy_to_host").empty());
  EXPECT_EQ(files_in(dir.path()), (std::vector<std::string>{"4242-w1.img"}));
  EXPECT_EQ(tier->state(), TierState::kServing);
}

TEST_F(TierTest, DrainIntoAMissingFolderFailsAndKeepsServing) {
  pattern(alloc(kMiB), kMiB, 1);
  const Error e = catch_error([&] { tier->drain(dir / "gone"); });
  EXPECT_EQ(std::string(e.what()), "memory tier: cannot create " +
                                       (dir / "gone" / "4242-w0.img").string() +
                                       ": No such file or directory");
  EXPECT_EQ(tier->state(), TierState::kServing);
}

TEST_F(TierTest, AFailedReleaseMapsBackWhatWasReleasedAndKeepsServing) {
  void* a = alloc(4 * kMiB);
  void* b = alloc(30 * kMiB);
  pattern(a, 4 * kMiB, 1);
  pattern(b, 30 * kMiB, 2);
  driver.fail_next("unmap", 2);  // the second segment's release fails
  const Error e = catch_error([&] { tier->drain(dir.path()); });
  EXPECT_EQ(
      std::string(e.what()),
      "memory tier: releasing GPU memory failed: unmap failed: CUDA_ERROR_UNKNOWN (fake driver)");
  EXPECT_EQ(tier->state(), TierState::kServing);
  expect_pattern(a, 4 * kMiB, 1);   // released, then filled back from the files
  expect_pattern(b, 30 * kMiB, 2);  // never released
  EXPECT_TRUE(files_in(dir.path()).empty());
}

// ---- the GPU threads' stacks ----------------------------------------------------------------

TEST_F(TierTest, TheDrainFreesEachDevicesStackLastAndTheFillPutsItsSizeBackFirst) {
  void* a = alloc(4 * kMiB, 0);
  void* b = alloc(4 * kMiB, 1);
  pattern(a, 4 * kMiB, 1);
  pattern(b, 4 * kMiB, 2);
  driver.set_stack_limit(1, 4096);  // as the driver does when a kernel needs a larger stack
  driver.clear_calls();
  tier->drain(dir.path());
  auto calls = driver.calls();
  EXPECT_LT(index_of(calls, "release", true), index_of(calls, "set_stack_limit"))
      << "the stacks go only once the memory is safely in the files and released";
  EXPECT_EQ(driver.calls_named("set_stack_limit"),
            (std::vector<std::string>{"set_stack_limit 0 0", "set_stack_limit 1 0"}));
  EXPECT_EQ(driver.stack_limit(0), 0u);
  EXPECT_EQ(driver.stack_limit(1), 0u);

  driver.clear_calls();
  tier->fill(dir.path(), {});
  calls = driver.calls();
  EXPECT_EQ(driver.calls_named("set_stack_limit"),
            (std::vector<std::string>{"set_stack_limit 0 1024", "set_stack_limit 1 4096"}));
  EXPECT_LT(index_of(calls, "set_stack_limit", true), index_of(calls, "map"))
      << "the sizes come back before any memory, so that a failure leaves the tier drained";
  EXPECT_EQ(driver.stack_limit(0), 1024u);
  EXPECT_EQ(driver.stack_limit(1), 4096u);
  expect_pattern(a, 4 * kMiB, 1);
  expect_pattern(b, 4 * kMiB, 2);

  // The next capture starts from the sizes as they are then.
  driver.set_stack_limit(0, 2048);
  TempDir again;
  tier->drain(again.path());
  driver.clear_calls();
  tier->fill({}, {});
  EXPECT_EQ(driver.calls_named("set_stack_limit"),
            (std::vector<std::string>{"set_stack_limit 0 2048", "set_stack_limit 1 4096"}));
}

TEST_F(TierTest, AStackTheDriverWillNotFreeIsKeptAndTheDrainStands) {
  void* p = alloc(4 * kMiB);
  pattern(p, 4 * kMiB, 5);
  driver.fail_next("set_stack_limit");
  const TransferReport r = tier->drain(dir.path());
  EXPECT_EQ(r.bytes, 4 * kMiB);
  EXPECT_EQ(tier->state(), TierState::kReleased);
  EXPECT_EQ(driver.mappings(), 0u);
  EXPECT_EQ(driver.stack_limit(0), 1024u);
  driver.clear_calls();
  tier->fill(dir.path(), {});
  EXPECT_TRUE(driver.calls_named("set_stack_limit").empty()) << "nothing was changed to put back";
  expect_pattern(p, 4 * kMiB, 5);
}

TEST_F(TierTest, AStackTheDriverWillNotPutBackRefusesTheFillBeforeAnyMemoryAndARetryWorks) {
  void* p = alloc(4 * kMiB);
  pattern(p, 4 * kMiB, 6);
  tier->drain(dir.path());
  driver.fail_next("set_stack_limit");
  const Error e = catch_error([&] { tier->fill(dir.path(), {}); });
  EXPECT_EQ(e.kind(), ErrorKind::kGpu);
  EXPECT_EQ(std::string(e.what()),
            "memory tier: putting back the 1024-byte stack of the GPU threads on device 0 failed: "
            "set_stack_limit failed: CUDA_ERROR_UNKNOWN (fake driver)");
  EXPECT_EQ(tier->state(), TierState::kReleased);
  EXPECT_EQ(driver.mappings(), 0u) << "a copy never serves without what its graphs need";
  EXPECT_EQ(driver.handles(), 0u);
  tier->fill(dir.path(), {});
  EXPECT_EQ(driver.stack_limit(0), 1024u);
  expect_pattern(p, 4 * kMiB, 6);
}

TEST_F(TierTest, AllocatingWhileDrainedIsRefused) {
  alloc(kMiB);
  tier->drain(dir.path());
  const Error e = catch_error([&] { tier->allocate(kMiB, 0, kStreamA); });
  EXPECT_EQ(std::string(e.what()),
            "the memory tier is drained: no GPU memory until the workload is resumed");
  const Error again = catch_error([&] { tier->drain(dir.path()); });
  EXPECT_EQ(std::string(again.what()),
            "the memory tier is already drained into " + dir.path().string());
}

TEST_F(TierTest, FillWhileServingDoesNothing) {
  alloc(kMiB);
  driver.clear_calls();
  EXPECT_EQ(tier->fill(dir.path(), {}).bytes, 0u);
  EXPECT_TRUE(driver.calls().empty());
}

TEST_F(TierTest, AFillOutOfMemoryReleasesWhatItMappedAndCanBeRetried) {
  void* a = alloc(24 * kMiB);
  void* b = alloc(24 * kMiB);
  pattern(a, 24 * kMiB, 1);
  pattern(b, 24 * kMiB, 2);
  tier->drain(dir.path());
  // Someone else took the GPU meanwhile: only one segment fits.
  Handle squatter = 0;
  ASSERT_TRUE(driver.create(0, 60 * kMiB, &squatter));
  const Error e = catch_error([&] { tier->fill(dir.path(), {}); });
  EXPECT_EQ(e.kind(), ErrorKind::kGpu);
  EXPECT_TRUE(Contains(e.what(),
                       "out of GPU memory: the memory tier could not get back 24 MiB on device 0"));
  EXPECT_EQ(tier->state(), TierState::kReleased);
  EXPECT_EQ(driver.mappings(), 0u) << "a copy never serves with memory it did not fill";
  EXPECT_EQ(driver.handles(), 1u);  // the squatter's only
  driver.release(squatter);
  tier->fill(dir.path(), {});
  expect_pattern(a, 24 * kMiB, 1);
  expect_pattern(b, 24 * kMiB, 2);
}

TEST_F(TierTest, AFailedCopyDuringTheFillReleasesEverythingItMapped) {
  void* p = alloc(8 * kMiB);
  pattern(p, 8 * kMiB, 3);
  tier->drain(dir.path());
  driver.fail_next("copy_to_device", 5);
  EXPECT_EQ(catch_error([&] { tier->fill(dir.path(), {}); }).kind(), ErrorKind::kGpu);
  EXPECT_EQ(tier->state(), TierState::kReleased);
  EXPECT_EQ(driver.mappings(), 0u);
  EXPECT_EQ(driver.handles(), 0u);
  EXPECT_EQ(driver.host_allocations(), 0u);
  EXPECT_EQ(driver.streams(), 0u);
  EXPECT_EQ(driver.registered(), 0u);  // no window outlives the fill
  tier->fill(dir.path(), {});
  expect_pattern(p, 8 * kMiB, 3);
}

TEST_F(TierTest, AShortFileRefusesTheFill) {
  pattern(alloc(6 * kMiB), 6 * kMiB, 1);
  tier->drain(dir.path());
  // Cut the largest file in the middle of a piece.
  std::string largest;
  std::uintmax_t size = 0;
  for (const auto& name : files_in(dir.path())) {
    if (name.ends_with(".img") && std::filesystem::file_size(dir / name) > size) {
      largest = name;
      size = std::filesystem::file_size(dir / name);
    }
  }
  std::filesystem::resize_file(dir / largest, size - kMiB / 2);
  const Error e = catch_error([&] { tier->fill(dir.path(), {}); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(std::string(e.what()), "memory tier: " + (dir / largest).string() + " ends at byte " +
                                       std::to_string(size - kMiB / 2) +
                                       ", before the contents the drain wrote there");
  EXPECT_EQ(driver.mappings(), 0u);
}

TEST_F(TierTest, AMissingFileRefusesTheFillBeforeAnyCopy) {
  pattern(alloc(kMiB), kMiB, 1);
  tier->drain(dir.path());
  std::filesystem::remove(dir / "4242-w0.img");
  const Error e = catch_error([&] { tier->fill(dir.path(), {}); });
  EXPECT_EQ(std::string(e.what()), "memory tier: cannot open " + (dir / "4242-w0.img").string() +
                                       ": No such file or directory");
  EXPECT_TRUE(driver.calls_named("copy_to_device").empty());
  EXPECT_EQ(driver.mappings(), 0u);
}

TEST_F(TierTest, FillReadsFromAnotherFolderWhenToldSoAsACopyDoes) {
  void* p = alloc(3 * kMiB);
  pattern(p, 3 * kMiB, 9);
  tier->drain(dir.path());
  TempDir artifact;
  for (const auto& name : files_in(dir.path())) {
    std::filesystem::rename(dir / name, artifact / name);
  }
  tier->fill(artifact.path(), {});
  expect_pattern(p, 3 * kMiB, 9);
}

TEST_F(TierTest, AFillOntoAnotherGpuNeedsTheGpuMapToSaySo) {
  void* p = alloc(3 * kMiB);
  pattern(p, 3 * kMiB, 5);
  tier->drain(dir.path());
  driver.set_uuid(0, "GPU-new");  // the driver's restore moved device 0 to another GPU
  driver.clear_calls();
  const Error e = catch_error([&] { tier->fill(dir.path(), {}); });
  EXPECT_EQ(e.kind(), ErrorKind::kIncompatible);
  EXPECT_EQ(std::string(e.what()),
            "memory tier: device 0 is GPU-new, but its memory was captured on GPU-fake-0");
  EXPECT_TRUE(driver.calls_named("create").empty());
  const Error wrong = catch_error([&] { tier->fill(dir.path(), {{"GPU-fake-0", "GPU-other"}}); });
  EXPECT_EQ(std::string(wrong.what()),
            "memory tier: device 0 is GPU-new, but its memory was captured on GPU-fake-0 and "
            "mapped to GPU-other");
  tier->fill(dir.path(), {{"GPU-fake-0", "GPU-new"}, {"GPU-fake-1", "GPU-fake-1"}});
  expect_pattern(p, 3 * kMiB, 5);
  // The next capture records where the memory is now.
  TempDir next;
  tier->drain(next.path());
  std::ifstream in(next / "4242.json");
  const std::string index((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(Contains(index, "\"gpus\":[{\"uuid\":\"GPU-new\",\"bytes\":3145728}]"));
}

TEST_F(TierTest, AGraphsBlocksAreDrainedAndFilledLikeAnyOther) {
  driver.set_capturing(kStreamA, true);
  void* g = alloc(kMiB);
  driver.set_capturing(kStreamA, false);
  pattern(g, kMiB, 8);
  tier->free(g);
  tier->drain(dir.path());
  tier->fill(dir.path(), {});
  expect_pattern(g, kMiB, 8);
}

TEST_F(TierTest, DrainingNothingWritesOnlyTheIndexAndAnEmptyLayout) {
  void* p = alloc(kMiB);
  tier->free(p);
  const TransferReport r = tier->drain(dir.path());
  EXPECT_EQ(r.bytes, 0u);
  EXPECT_EQ(files_in(dir.path()), (std::vector<std::string>{"4242.json", "4242.layout"}));
  const TierLayout layout = read_layout(dir / "4242.layout");
  EXPECT_TRUE(layout.segments.empty());
  EXPECT_TRUE(layout.pieces.empty());
  EXPECT_EQ(driver.reservations(), 0u);
  tier->fill(dir.path(), {});
  EXPECT_EQ(tier->state(), TierState::kServing);
}

TEST_F(TierTest, DestroyingTheTierReturnsEverything) {
  alloc(kMiB);
  alloc(30 * kMiB, 1);
  tier.reset();
  EXPECT_EQ(driver.handles(), 0u);
  EXPECT_EQ(driver.mappings(), 0u);
  EXPECT_EQ(driver.reservations(), 0u);
}

// ---- the shared library --------------------------------------------------------------------

#ifndef GPUSNAP_TIER_LIBRARY
#error "GPUSNAP_TIER_LIBRARY must name the built libgpusnap-tier.so"
#endif

TEST(TierLibrary, ExportsTheCInterfaceAndNothingOfItsCxxRuntime) {
  void* lib = ::dlopen(GPUSNAP_TIER_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << ::dlerror();
  for (const char* name :
       {"tier_malloc", "tier_free", "gpusnap_tier_drain", "gpusnap_tier_fill", "gpusnap_tier_state",
        "gpusnap_tier_live_bytes", "gpusnap_tier_last_error"}) {
    EXPECT_NE(::dlsym(lib, name), nullptr) << name;
  }
  // std::terminate and operator new live inside it, hidden: PyTorch's own must not bind to them.
  EXPECT_EQ(::dlsym(lib, "_ZSt9terminatev"), nullptr);
  EXPECT_EQ(::dlsym(lib, "_Znwm"), nullptr);
  ::dlclose(lib);
}

TEST(TierLibrary, WithoutTheDriverAllocationFailsAndSaysWhy) {
  if (::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD) != nullptr ||
      std::filesystem::exists("/dev/nvidiactl")) {
    GTEST_SKIP() << "skipped: this host has the NVIDIA driver";
  }
  void* lib = ::dlopen(GPUSNAP_TIER_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << ::dlerror();
  auto malloc_fn = reinterpret_cast<decltype(&tier_malloc)>(::dlsym(lib, "tier_malloc"));
  auto last_error =
      reinterpret_cast<decltype(&gpusnap_tier_last_error)>(::dlsym(lib, "gpusnap_tier_last_error"));
  auto state = reinterpret_cast<decltype(&gpusnap_tier_state)>(::dlsym(lib, "gpusnap_tier_state"));
  auto drain = reinterpret_cast<decltype(&gpusnap_tier_drain)>(::dlsym(lib, "gpusnap_tier_drain"));
  auto fill = reinterpret_cast<decltype(&gpusnap_tier_fill)>(::dlsym(lib, "gpusnap_tier_fill"));
  EXPECT_EQ(malloc_fn(1024, 0, nullptr), nullptr);
  char text[256];
  last_error(text, sizeof text);
  EXPECT_TRUE(Contains(text, "memory tier: cannot load the NVIDIA driver: libcuda.so.1: "));
  EXPECT_EQ(state(), GPUSNAP_TIER_UNUSED);
  // Nothing allocated: a drain and a fill have nothing to do, and succeed.
  TempDir dir;
  EXPECT_EQ(drain(dir.path().c_str(), text, sizeof text), 0) << text;
  EXPECT_EQ(fill(nullptr, nullptr, text, sizeof text), 0) << text;
  EXPECT_EQ(drain("", text, sizeof text), 1);
  EXPECT_EQ(std::string(text), "memory tier: no folder to drain into");
  EXPECT_EQ(fill(nullptr, "GPU-a", text, sizeof text), 1);
  EXPECT_EQ(std::string(text), "memory tier: bad GPU map entry \"GPU-a\"");
  ::dlclose(lib);
}

}  // namespace
}  // namespace gpusnap::tier
