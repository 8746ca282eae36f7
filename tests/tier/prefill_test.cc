// The fill done ahead (tier/prefill.h) and its handover (tier/handover.h, Tier::adopt) against
// the fake driver, whose exported memory a second handle reaches as the driver's does across
// processes: the drain's layout, a prefill that makes and fills the memory from the files, the
// tier taking it over without copying a byte, and every refusal leaving the tier to fill by
// itself. The layout reader's checks on damaged files too.
#include "tier/in_place.h"
#include "tier/prefill.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/fd.h"
#include "common/fs.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "testing/unit.h"
#include "tier/fake_tier_driver.h"
#include "tier/handover.h"
#include "tier/layout.h"
#include "tier/memory_tier.h"

namespace gpusnap::tier {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr pid_t kPid = 4343;

DevicePtr va(void* p) { return reinterpret_cast<DevicePtr>(p); }

class PrefillTest : public ::testing::Test {
 protected:
  PrefillTest() : driver(2, 128 * kMiB), tier(driver, settings(), kPid) {}

  static TierSettings settings() {
    TierSettings s;
    s.streams = 3;
    s.buffer_bytes = kMiB;
    s.piece_bytes = kMiB;
    return s;
  }

  // Three allocations with their own bytes, drained into `dir`.
  void fill_and_drain() {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      blocks.push_back(tier.allocate(sizes[i], 0, nullptr));
      const auto w = words(sizes[i], static_cast<unsigned>(i));
      driver.write(va(blocks[i]), w.data(), sizes[i]);
    }
    tier.drain(dir.path());
  }
  static std::vector<std::uint64_t> words(std::size_t size, unsigned seed) {
    std::vector<std::uint64_t> w(size / 8);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = (seed + 7) * 0x9E3779B97F4A7C15ULL ^ i;
    return w;
  }
  void expect_contents() {
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      std::vector<std::uint64_t> got(sizes[i] / 8);
      driver.read(va(blocks[i]), got.data(), sizes[i]);
      EXPECT_TRUE(got == words(sizes[i], static_cast<unsigned>(i))) << "block " << i;
    }
  }
  std::vector<std::string> files(const TierLayout& layout) const {
    std::vector<std::string> names;
    for (std::size_t k = 0; k < layout.files; ++k) {
      names.push_back(std::to_string(kPid) + "-w" + std::to_string(k) + ".img");
    }
    return names;
  }
  // Of an arriving artifact in place, of one all there through the buffers: the default
  // (TierSettings::in_place unset).
  std::unique_ptr<Prefill> prefill_on(int device, ArrivingFiles* arriving = nullptr) {
    TierLayout layout = read_layout(dir / (std::to_string(kPid) + ".layout"));
    auto names = files(layout);
    return std::make_unique<Prefill>(driver, settings(), std::move(layout), dir.path(), names,
                                     device, 0, arriving);
  }
  // Serves one handover of `prefill` on the socket, as gpusnap-tier-prefill does.
  std::future<bool> serve(Prefill& prefill) {
    listener = listen_for_handover(socket());
    return std::async(std::launch::async, [this, &prefill] {
      common::UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      return conn.get() >= 0 && prefill.hand_over(conn.get());
    });
  }
  std::filesystem::path socket() const { return sockets / (std::to_string(kPid) + ".sock"); }

  FakeTierDriver driver;
  Tier tier;
  TempDir dir;
  TempDir sockets;
  common::UniqueFd listener;
  const std::vector<std::size_t> sizes = {3 * kMiB + 4096, 40 * kMiB, 8192};
  std::vector<void*> blocks;
};

TEST_F(PrefillTest, TheTierTakesOverWhatThePrefillFilledAndCopiesNothing) {
  fill_and_drain();
  auto prefill = prefill_on(0);
  const TransferReport filled = prefill->fill();
  EXPECT_EQ(filled.bytes, 3 * kMiB + 4096 + 40 * kMiB + 8192);
  auto taken = serve(*prefill);
  driver.clear_calls();
  const std::size_t adopted = tier.adopt(socket(), std::chrono::seconds(5));
  EXPECT_TRUE(taken.get());
  EXPECT_EQ(adopted, tier.stats().reserved_bytes);
  EXPECT_EQ(tier.state(), TierState::kReleased);  // until fill() returns it to serving
  tier.fill(dir.path(), {});
  EXPECT_EQ(tier.state(), TierState::kServing);
  EXPECT_TRUE(driver.calls_named("copy_to_device").empty());
  EXPECT_TRUE(driver.calls_named("create").empty());
  EXPECT_EQ(driver.calls_named("import_fd").size(), 3u);
  // The prefill lets go of its own handles and mappings; the tier's keep the memory.
  prefill.reset();
  expect_contents();
  EXPECT_EQ(driver.used(0), tier.stats().reserved_bytes);
  // And the next capture drains the adopted memory as any other.
  TempDir again;
  tier.drain(again.path());
  EXPECT_EQ(driver.handles(), 0u);
  tier.fill(again.path(), {});
  expect_contents();
}

// A run folder deeper than a socket address holds (107 bytes: a bench's run folder on the GPU
// machine was 108 with its socket) still hands the memory over: the socket is reached through
// its folder.
TEST_F(PrefillTest, TheTierTakesOverThroughASocketDeeperThanAnAddressHolds) {
  fill_and_drain();
  auto prefill = prefill_on(0);
  prefill->fill();
  const std::filesystem::path deep =
      sockets / std::string(60, 'r') / "prefill" / std::string(40, 'c') / "copy-0";
  std::filesystem::create_directories(deep);
  const std::filesystem::path sock = deep / (std::to_string(kPid) + ".sock");
  ASSERT_GT(sock.string().size(), 108u);
  listener = listen_for_handover(sock);
  auto taken = std::async(std::launch::async, [this, &prefill] {
    common::UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    return conn.get() >= 0 && prefill->hand_over(conn.get());
  });
  driver.clear_calls();
  const std::size_t adopted = tier.adopt(sock, std::chrono::seconds(5));
  EXPECT_TRUE(taken.get());
  EXPECT_EQ(adopted, tier.stats().reserved_bytes);
  EXPECT_TRUE(std::filesystem::is_socket(sock));
  tier.fill(dir.path(), {});
  EXPECT_TRUE(driver.calls_named("copy_to_device").empty());
  prefill.reset();
  expect_contents();
}

// The prefill makes the memory on a thread of its own while its workers copy: every copy goes to
// memory already mapped and opened (the fake throws on any other), and a layout whose pieces are
// not in address order is filled as well.
TEST_F(PrefillTest, EveryPieceIsCopiedIntoMemoryAlreadyMappedWhileTheRestIsMade) {
  fill_and_drain();
  const auto path = dir / (std::to_string(kPid) + ".layout");
  TierLayout layout = read_layout(path);
  std::reverse(layout.pieces.begin(), layout.pieces.end());
  write_layout(path, layout);
  // Rounds to give the maker and the workers many interleavings; the fake throws at a copy into
  // memory not yet mapped or opened.
  for (int round = 0; round < 20; ++round) {
    driver.clear_calls();
    const TransferReport filled = prefill_on(0)->fill();
    EXPECT_EQ(filled.bytes, 3 * kMiB + 4096 + 40 * kMiB + 8192);
    EXPECT_EQ(driver.calls_named("create_shareable").size(), 3u);
    EXPECT_EQ(driver.entered(), 0);
  }
  EXPECT_EQ(driver.mappings(), 0u);  // each round's prefill let go of what it made
  auto prefill = prefill_on(0);
  prefill->fill();
  auto taken = serve(*prefill);
  tier.adopt(socket(), std::chrono::seconds(5));
  EXPECT_TRUE(taken.get());
  prefill.reset();
  tier.fill(dir.path(), {});
  expect_contents();
}

// Making the memory fails half-way (out of GPU memory on the second segment): the workers
// waiting for it stop, the error says why, and the prefill has released everything it made.
TEST_F(PrefillTest, OutOfMemoryWhileMakingStopsTheCopiesAndReleasesEverything) {
  fill_and_drain();
  const std::size_t handles = driver.handles();
  const std::size_t reservations = driver.reservations();
  auto prefill = prefill_on(0);
  driver.fail_next("create_shareable", 2);
  try {
    prefill->fill();
    ADD_FAILURE() << "a prefill without memory succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kGpu);
    EXPECT_NE(std::string(e.what()).find("out of GPU memory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(driver.handles(), handles);
  EXPECT_EQ(driver.mappings(), 0u);
  EXPECT_EQ(driver.reservations(), reservations);
  EXPECT_EQ(driver.host_allocations(), 0u);
  EXPECT_EQ(driver.entered(), 0);
  tier.fill(dir.path(), {});  // the copy fills by itself
  expect_contents();
}

// A copy fails while the memory is still being made: the making stops, the copy's error is the
// one reported, and nothing the prefill made is left.
TEST_F(PrefillTest, ACopyThatFailsStopsTheMakingAndReleasesEverything) {
  fill_and_drain();
  const std::size_t handles = driver.handles();
  auto prefill = prefill_on(0);
  driver.fail_next("copy_to_device", 1);
  EXPECT_THROW(prefill->fill(), Error);
  EXPECT_EQ(driver.handles(), handles);
  EXPECT_EQ(driver.mappings(), 0u);
  EXPECT_EQ(driver.host_allocations(), 0u);
  EXPECT_EQ(driver.entered(), 0);
}

// With the artifact's chunk size, the prefill checksums each file as it reads it: the sums are
// what the artifact's own checksums of those files say, and a file its pieces do not cover from
// the first byte is not claimed.
TEST_F(PrefillTest, TheSumsOfWhatItReadIsTheArtifactsChecksumOfEachFile) {
  fill_and_drain();
  TierLayout layout = read_layout(dir / (std::to_string(kPid) + ".layout"));
  const auto names = files(layout);
  ASSERT_GE(names.size(), 2u);
  const auto records = checksum_tree(dir.path(), kMiB);
  auto record_of = [&](const std::string& name) -> const FileRecord* {
    for (const auto& r : records) {
      if (r.path == name) return &r;
    }
    return nullptr;
  };
  Prefill prefill(driver, settings(), layout, dir.path(), names, 0, kMiB);
  prefill.fill();
  ASSERT_EQ(prefill.sums().size(), names.size());
  for (const auto& sums : prefill.sums()) {
    SCOPED_TRACE(sums.name);
    const FileRecord* want = record_of(sums.name);
    ASSERT_NE(want, nullptr);
    EXPECT_TRUE(sums.complete);
    EXPECT_EQ(sums.size, want->size);
    EXPECT_EQ(sums.chunks, want->chunks);
  }
  // The first piece of file 0 left out of the layout: file 0 is not read from its first byte.
  const auto first = std::find_if(layout.pieces.begin(), layout.pieces.end(),
                                  [](const FilePiece& p) { return p.file == 0 && p.offset == 0; });
  ASSERT_NE(first, layout.pieces.end());
  layout.pieces.erase(first);
  Prefill partial(driver, settings(), layout, dir.path(), names, 0, kMiB);
  partial.fill();
  EXPECT_FALSE(partial.sums().at(0).complete);
  EXPECT_TRUE(partial.sums().at(1).complete);
}

// A layout comes from the artifact: its pieces may be larger than the prefill's buffers (the
// workload drained with other settings, or a damaged layout). The prefill moves each a buffer at
// a time, never past one (the fake refuses a copy that leaves its pinned buffer), checksums the
// files whole, and the tier that drained them takes the memory over with every byte in place.
TEST_F(PrefillTest, PiecesLargerThanItsBuffersAreMovedABufferAtATime) {
  TierSettings whole_pieces = settings();
  whole_pieces.piece_bytes = 64 * kMiB;
  Tier drained(driver, whole_pieces, kPid);
  void* block = drained.allocate(40 * kMiB, 0, nullptr);
  const auto w = words(40 * kMiB, 9);
  driver.write(va(block), w.data(), 40 * kMiB);
  drained.drain(dir.path());
  const TierLayout layout = read_layout(dir / (std::to_string(kPid) + ".layout"));
  ASSERT_EQ(layout.pieces.size(), 1u);
  ASSERT_EQ(layout.pieces[0].size, 40 * kMiB);

  TierSettings small = settings();
  small.buffer_bytes = 256 << 10;
  driver.clear_calls();
  Prefill prefill(driver, small, layout, dir.path(), files(layout), 0, kMiB);
  prefill.fill();
  const auto copies = driver.calls_named("copy_to_device");
  EXPECT_EQ(copies.size(), 160u);  // 40 MiB in 256 KiB
  for (const auto& call : copies) {
    EXPECT_EQ(call.substr(call.rfind(' ') + 1), std::to_string(256 << 10)) << call;
  }
  const auto records = checksum_tree(dir.path(), kMiB);
  const auto want = std::find_if(records.begin(), records.end(), [&](const FileRecord& r) {
    return r.path == files(layout).at(0);
  });
  ASSERT_NE(want, records.end());
  ASSERT_EQ(prefill.sums().size(), 1u);
  EXPECT_TRUE(prefill.sums()[0].complete);
  EXPECT_EQ(prefill.sums()[0].chunks, want->chunks);

  auto taken = serve(prefill);
  drained.adopt(socket(), std::chrono::seconds(5));
  EXPECT_TRUE(taken.get());
  drained.fill(dir.path(), {});
  std::vector<std::uint64_t> got(40 * kMiB / 8);
  driver.read(va(block), got.data(), 40 * kMiB);
  EXPECT_TRUE(got == w);
}

TEST_F(PrefillTest, MemoryOnAnotherDeviceIsRefusedAndTheFillDoesItAll) {
  fill_and_drain();
  auto prefill = prefill_on(1);
  prefill->fill();
  auto taken = serve(*prefill);
  EXPECT_THROW(tier.adopt(socket(), std::chrono::seconds(5)), Error);
  EXPECT_FALSE(taken.get());             // the prefill hears the refusal
  EXPECT_EQ(driver.mappings(), 1u * 3);  // the prefill's own three; none of the tier's
  prefill.reset();
  EXPECT_EQ(driver.mappings(), 0u);
  tier.fill(dir.path(), {});
  expect_contents();
}

TEST_F(PrefillTest, NoPrefillOrOneThatEndsEarlyLeavesTheTierDrainedForTheFill) {
  fill_and_drain();
  EXPECT_THROW(tier.adopt(socket(), std::chrono::seconds(1)), Error);  // nothing listens
  listener = listen_for_handover(socket());
  auto hang_up = std::async(std::launch::async, [this] {
    common::UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  });
  EXPECT_THROW(tier.adopt(socket(), std::chrono::seconds(5)), Error);
  hang_up.get();
  EXPECT_EQ(tier.state(), TierState::kReleased);
  EXPECT_EQ(driver.mappings(), 0u);
  tier.fill(dir.path(), {});
  expect_contents();
}

TEST_F(PrefillTest, AnOfferForOtherSegmentsIsRefused) {
  fill_and_drain();
  listener = listen_for_handover(socket());
  auto liar = std::async(std::launch::async, [this] {
    common::UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    std::vector<OfferedSegment> offer;
    offer.push_back({0x1000, 2 * kMiB, common::UniqueFd(::dup(0))});
    send_offer(conn.get(), offer);
    return receive_answer(conn.get());
  });
  EXPECT_THROW(tier.adopt(socket(), std::chrono::seconds(5)), Error);
  EXPECT_FALSE(liar.get());
  tier.fill(dir.path(), {});
  expect_contents();
}

TEST_F(PrefillTest, ADamagedLayoutIsABadArtifact) {
  fill_and_drain();
  const auto path = dir / (std::to_string(kPid) + ".layout");
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto expect_refused = [&](std::string damaged, const std::string& why) {
    const auto bad = dir / "bad.layout";
    std::ofstream(bad, std::ios::binary | std::ios::trunc) << damaged;
    try {
      read_layout(bad);
      ADD_FAILURE() << "accepted a layout with " << why;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact) << why;
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  expect_refused("XXXXXXXX" + bytes.substr(8), "no magic");
  expect_refused(bytes.substr(0, bytes.size() - 8), "counts that do not match");
  std::string moved = bytes;
  // The first piece's address (after the header and the segments) moved far past its segment.
  const TierLayout layout = read_layout(path);
  const std::size_t first_piece = 32 + layout.segments.size() * 24;
  const std::uint64_t far = 0x10;
  std::memcpy(moved.data() + first_piece, &far, sizeof far);
  expect_refused(moved, "a piece out of range");
  expect_refused(std::string(72ull << 20, '\0'), "not a layout file of at most 64 MiB");
}

// An artifact still arriving (a pull the restore overlaps, tier/arrival.h): the drain files
// exist at their sizes, all zeros, and their bytes are written a MiB at a time while the fill
// runs, each step told on the feed only once written. Every byte the copy takes over is the
// drained one: the fill read nothing before it was there.
TEST_F(PrefillTest, OfAnArtifactStillArrivingReadsEachByteOnlyOnceItIsThere) {
  fill_and_drain();
  const TierLayout layout = read_layout(dir / (std::to_string(kPid) + ".layout"));
  const auto names = files(layout);
  std::vector<std::string> contents;
  std::vector<std::uint64_t> sizes;
  for (const auto& name : names) {
    std::string bytes;
    ASSERT_TRUE(fs::try_read_file(dir / name, &bytes));
    contents.push_back(bytes);
    sizes.push_back(bytes.size());
    write(dir / name, std::string(bytes.size(), '\0'));
  }
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  common::UniqueFd ours(pair[0]);
  ArrivingFiles arriving(common::UniqueFd(pair[1]), names, sizes);
  std::size_t registered_early = 0;
  std::thread pull([&] {
    for (std::size_t done = 0;; done += kMiB) {
      if (done == kMiB) {
        // Each file's first MiB is there, no window of any file whole (every file is over a
        // MiB): the fill reads in place, and registers a window only once every byte of it is
        // final (the fake's registration keeps what the pages held then).
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        registered_early = driver.registrations();
      }
      bool more = false;
      for (std::size_t f = 0; f < names.size(); ++f) {
        if (done >= contents[f].size()) continue;
        const std::size_t n = std::min(kMiB, contents[f].size() - done);
        std::fstream out(dir / names[f], std::ios::in | std::ios::out | std::ios::binary);
        out.seekp(static_cast<std::streamoff>(done));
        out.write(contents[f].data() + done, static_cast<std::streamsize>(n));
        out.close();
        const std::string line = names[f] + " " + std::to_string(done + n) + "\n";
        ASSERT_EQ(::write(ours.get(), line.data(), line.size()), static_cast<ssize_t>(line.size()));
        more = true;
      }
      if (!more) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  auto prefill = prefill_on(0, &arriving);
  const TransferReport filled = prefill->fill();
  pull.join();
  EXPECT_EQ(filled.bytes, 3 * kMiB + 4096 + 40 * kMiB + 8192);
  EXPECT_EQ(filled.in_place_bytes, filled.bytes);
  EXPECT_EQ(registered_early, 0u);
  for (const auto& name : names) EXPECT_GT(std::filesystem::file_size(dir / name), kMiB) << name;
  auto taken = serve(*prefill);
  tier.adopt(socket(), std::chrono::seconds(5));
  EXPECT_TRUE(taken.get());
  tier.fill(dir.path(), {});
  expect_contents();
}

// The feed ends (gpusnap's pull stopped, or gpusnap is gone) before a file is whole: the fill
// fails naming the file, and releases what it made; the copy then fills by itself, or is not
// restored at all.
TEST_F(PrefillTest, OfAnArtifactThatStopsArrivingFailsAndReleasesItsMemory) {
  fill_and_drain();
  const TierLayout layout = read_layout(dir / (std::to_string(kPid) + ".layout"));
  const auto names = files(layout);
  std::vector<std::uint64_t> sizes;
  for (const auto& name : names) sizes.push_back(std::filesystem::file_size(dir / name));
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  {
    common::UniqueFd ours(pair[0]);
    const std::string line = names[0] + " 4096\n";
    ASSERT_EQ(::write(ours.get(), line.data(), line.size()), static_cast<ssize_t>(line.size()));
  }
  ArrivingFiles arriving(common::UniqueFd(pair[1]), names, sizes);
  const std::size_t before = driver.handles();
  auto prefill = prefill_on(0, &arriving);
  const Error e = catch_error([&] { prefill->fill(); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_TRUE(Contains(e.what(), "did not arrive")) << e.what();
  EXPECT_EQ(driver.handles(), before);
}

TEST(ArrivalLines, AreAFileOfTheProcessAndAPrefixWithinItsSize) {
  const std::vector<std::string> names = {"7-w0.img", "7-w1.img"};
  const std::vector<std::uint64_t> sizes = {100, 200};
  EXPECT_EQ(parse_arrival_line("7-w1.img 200", names, sizes),
            std::make_optional(std::make_pair(std::size_t{1}, std::uint64_t{200})));
  EXPECT_EQ(parse_arrival_line("7-w0.img 0", names, sizes),
            std::make_optional(std::make_pair(std::size_t{0}, std::uint64_t{0})));
  EXPECT_FALSE(parse_arrival_line("7-w0.img 101", names, sizes));  // past its end
  EXPECT_FALSE(parse_arrival_line("8-w0.img 1", names, sizes));    // another process's
  EXPECT_FALSE(parse_arrival_line("7-w0.img", names, sizes));
  EXPECT_FALSE(parse_arrival_line("7-w0.img -1", names, sizes));
  EXPECT_FALSE(parse_arrival_line("7-w0.img 1x", names, sizes));
  EXPECT_FALSE(parse_arrival_line("7-w0.img ", names, sizes));
  EXPECT_FALSE(parse_arrival_line("7-w0.img 99999999999999999999999", names, sizes));
  EXPECT_FALSE(parse_arrival_line("7-w0.img 1 2", names, sizes));
  EXPECT_FALSE(parse_arrival_line(std::string(300, '7') + " 1", names, sizes));
}

}  // namespace
}  // namespace gpusnap::tier
