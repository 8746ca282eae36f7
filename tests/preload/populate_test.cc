// libgpusnap-preload.so in real processes: a probe maps memory under the library and reports
// what it got; the library's own log line says what it did.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/subprocess.h"
#include "testing/unit.h"

namespace gpusnap::testing {
namespace {

// The build tree, found from this test binary (build/tests/).
std::string built(const std::string& relative) {
  auto exe = std::filesystem::read_symlink("/proc/self/exe");
  return (exe.parent_path().parent_path() / relative).string();
}

struct Probe {
  std::string out;  // the probe's report line
  std::string err;  // everything else it printed: the library's log lines
  int status = -1;
};

Probe probe(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
            bool preload = true) {
  std::vector<std::string> argv = {"/usr/bin/env", "GPUSNAP_PRELOAD_LOG=1"};
  if (preload) argv.push_back("LD_PRELOAD=" + built("libgpusnap-preload.so"));
  argv.insert(argv.end(), env.begin(), env.end());
  argv.push_back(built("tests/populate_probe"));
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = common::run_capture(argv, std::chrono::seconds(60));
  Probe p;
  p.status = r.status.ok() ? 0 : 1;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    (line.rfind("rss_kib=", 0) == 0 ? p.out : p.err) += line + "\n";
  }
  return p;
}

// `key`'s value in the report ("rss_kib=N huge_advised=B zero=B errno=E").
std::string value(const std::string& report, const std::string& key) {
  auto at = report.find(key + "=");
  if (at == std::string::npos) return {};
  auto start = at + key.size() + 1;
  auto end = report.find_first_of(" \n", start);
  return report.substr(start, end - start);
}

TEST(Preload, PopulatesALargePrivateMappingWithThreadsAndHugePageAdvice) {
  auto p = probe({"512", "private", "populate"}, {"GPUSNAP_PRELOAD_THREADS=4"});
  ASSERT_EQ(p.status, 0) << p.err;
  // What MAP_POPULATE promises: all of it resident, all of it zero.
  EXPECT_GE(std::stol(value(p.out, "rss_kib")), 512L << 10) << p.out;
  EXPECT_EQ(value(p.out, "zero"), "1") << p.out;
  EXPECT_EQ(value(p.out, "huge_advised"), "1") << p.out;
  EXPECT_EQ(value(p.out, "errno"), "0") << p.out;
  // 512 MiB is 8 slices of 64 MiB: four threads, as many as asked.
  EXPECT_NE(p.err.find("gpusnap-preload: populated 512 MiB in "), std::string::npos) << p.err;
  EXPECT_NE(p.err.find("with 4 threads, huge pages asked\n"), std::string::npos) << p.err;
}

TEST(Preload, ForTheDriversThreadItPopulatesAheadAndNeverOverwritesWhatTheDriverWrote) {
  // The probe names itself as the driver's thread does, and writes over the first quarter of the
  // mapping as soon as mmap returns, while the helpers are populating.
  for (int round = 0; round < 3; ++round) {
    auto p = probe({"1024", "private", "populate", "driver"}, {"GPUSNAP_PRELOAD_THREADS=4"});
    ASSERT_EQ(p.status, 0) << p.err;
    EXPECT_EQ(value(p.out, "pattern"), "1") << p.out;  // no helper wrote over the copy
    EXPECT_EQ(value(p.out, "zero"), "1") << p.out;     // the rest: populated, still zero
    EXPECT_GE(std::stol(value(p.out, "rss_kib")), 1024L << 10) << p.out;
    EXPECT_EQ(value(p.out, "huge_advised"), "1") << p.out;
    EXPECT_NE(p.err.find("gpusnap-preload: populated 1024 MiB in "), std::string::npos) << p.err;
    EXPECT_NE(p.err.find("with 4 threads, huge pages asked, ahead of the driver's copy"),
              std::string::npos)
        << p.err;
  }
}

TEST(Preload, HugePagesCanBeLeftOut) {
  auto p = probe({"512", "private", "populate"}, {"GPUSNAP_PRELOAD_HUGE_PAGES=0"});
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_GE(std::stol(value(p.out, "rss_kib")), 512L << 10) << p.out;
  EXPECT_EQ(value(p.out, "huge_advised"), "0") << p.out;
  EXPECT_NE(p.err.find("gpusnap-preload: populated 512 MiB"), std::string::npos) << p.err;
  EXPECT_EQ(p.err.find("huge pages asked"), std::string::npos) << p.err;
}

TEST(Preload, LeavesEveryOtherMappingAsItWas) {
  // Too small to be the driver's region: the kernel's own populate.
  auto small = probe({"64", "private", "populate"});
  ASSERT_EQ(small.status, 0) << small.err;
  EXPECT_GE(std::stol(value(small.out, "rss_kib")), 64L << 10) << small.out;
  EXPECT_EQ(value(small.out, "huge_advised"), "0") << small.out;
  // Shared memory is not the driver's region either.
  auto shared = probe({"512", "shared", "populate"});
  ASSERT_EQ(shared.status, 0) << shared.err;
  EXPECT_EQ(value(shared.out, "huge_advised"), "0") << shared.out;
  // Without MAP_POPULATE nothing is faulted in: the mapping stays as lazy as it was asked.
  auto lazy = probe({"512", "private", "lazy"});
  ASSERT_EQ(lazy.status, 0) << lazy.err;
  EXPECT_EQ(value(lazy.out, "rss_kib"), "0") << lazy.out;
  EXPECT_EQ(value(lazy.out, "huge_advised"), "0") << lazy.out;
  for (const auto* p : {&small, &shared, &lazy}) {
    EXPECT_EQ(p->err.find("gpusnap-preload"), std::string::npos) << p->err;
  }
}

TEST(Preload, NoThreadsTurnsItOff) {
  auto p = probe({"512", "private", "populate"}, {"GPUSNAP_PRELOAD_THREADS=0"});
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_GE(std::stol(value(p.out, "rss_kib")), 512L << 10) << p.out;  // the kernel's populate
  EXPECT_EQ(value(p.out, "huge_advised"), "0") << p.out;
  EXPECT_EQ(p.err.find("gpusnap-preload"), std::string::npos) << p.err;
}

TEST(Preload, WithoutTheLibraryTheProbeSeesTheKernelsPopulate) {
  // The control for the tests above: the same request, no library.
  auto p = probe({"512", "private", "populate"}, {}, /*preload=*/false);
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_GE(std::stol(value(p.out, "rss_kib")), 512L << 10) << p.out;
  EXPECT_EQ(value(p.out, "huge_advised"), "0") << p.out;
  EXPECT_EQ(p.err.find("gpusnap-preload"), std::string::npos) << p.err;
}

// A requests directory and an empty file for the driver's memory, as gpusnap prepares them.
struct Request {
  TempDir dir;
  std::filesystem::path requests = dir / "requests";
  std::filesystem::path file = dir / "image";
  Request() {
    std::filesystem::create_directory(requests);
    std::ofstream(file).close();
  }
  std::vector<std::string> env(const std::vector<std::string>& more = {}) const {
    std::vector<std::string> e = {"GPUSNAP_PRELOAD_THREADS=4",
                                  "GPUSNAP_PRELOAD_REQUESTS=" + requests.string(),
                                  "PROBE_REQUEST=" + file.string()};
    e.insert(e.end(), more.begin(), more.end());
    return e;
  }
  // The byte at `offset` of the file.
  int byte_at(uint64_t offset) const {
    std::ifstream in(file, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(offset));
    return in.get();
  }
};

// The library honours only root's requests (gpusnap runs as root): skip where tests do not.
#define SKIP_UNLESS_ROOT() \
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root"

TEST(PreloadRequest, TheDriversMemoryGoesStraightIntoTheRequestedFile) {
  SKIP_UNLESS_ROOT();
  Request r;
  auto p = probe({"512", "private", "populate", "driver"}, r.env());
  ASSERT_EQ(p.status, 0) << p.err;
  // A shared mapping of the file, on a 2 MiB boundary at offset 0, taken once.
  EXPECT_EQ(value(p.out, "shared"), "1") << p.out << p.err;
  EXPECT_EQ(value(p.out, "aligned"), "1") << p.out;
  EXPECT_EQ(value(p.out, "request_left"), "0") << p.out;
  // Populated ahead as before, and what the driver wrote is in the file, the rest zero.
  EXPECT_EQ(value(p.out, "pattern"), "1") << p.out;
  EXPECT_EQ(value(p.out, "zero"), "1") << p.out;
  EXPECT_GE(std::stol(value(p.out, "rss_kib")), 512L << 10) << p.out;
  EXPECT_NE(p.err.find("the driver's memory goes straight into " + r.file.string()),
            std::string::npos)
      << p.err;
  EXPECT_NE(p.err.find("ahead of the driver's copy"), std::string::npos) << p.err;
  EXPECT_EQ(std::filesystem::file_size(r.file), 512ull << 20);
  EXPECT_EQ(r.byte_at(0), 0xab);
  EXPECT_EQ(r.byte_at((128ull << 20) - 1), 0xab);
  EXPECT_EQ(r.byte_at(128ull << 20), 0);
  EXPECT_EQ(r.byte_at((512ull << 20) - 1), 0);
}

TEST(PreloadRequest, OnlyTheDriversThreadTakesIt) {
  SKIP_UNLESS_ROOT();
  Request r;
  // The workload's own large mapping while a request waits: anonymous memory, as it asked.
  auto p = probe({"512", "private", "populate"}, r.env());
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_EQ(value(p.out, "shared"), "0") << p.out;
  EXPECT_EQ(value(p.out, "request_left"), "1") << p.out;
  EXPECT_EQ(value(p.out, "zero"), "1") << p.out;
  EXPECT_EQ(std::filesystem::file_size(r.file), 0u);
}

TEST(PreloadRequest, AStaleRequestIsRemovedAndIgnored) {
  SKIP_UNLESS_ROOT();
  Request r;
  // Left by a gpusnap that died before the driver's call.
  auto p = probe({"512", "private", "populate", "driver"}, r.env({"PROBE_REQUEST_AGE=120"}));
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_EQ(value(p.out, "shared"), "0") << p.out;
  EXPECT_EQ(value(p.out, "request_left"), "0") << p.out;
  EXPECT_EQ(value(p.out, "pattern"), "1") << p.out;
  EXPECT_EQ(value(p.out, "zero"), "1") << p.out;
  EXPECT_NE(p.err.find("ignored a stale or malformed request"), std::string::npos) << p.err;
  EXPECT_EQ(std::filesystem::file_size(r.file), 0u);
}

TEST(PreloadRequest, AFileThatIsNotEmptyIsNeverWritten) {
  SKIP_UNLESS_ROOT();
  Request r;
  std::ofstream(r.file) << "someone else's data";
  auto p = probe({"512", "private", "populate", "driver"}, r.env());
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_EQ(value(p.out, "shared"), "0") << p.out;
  EXPECT_EQ(value(p.out, "pattern"), "1") << p.out;
  std::ifstream in(r.file);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "someone else's data");
}

TEST(PreloadRequest, AStoreWithoutRoomForTheWholeMappingIsNotUsed) {
  SKIP_UNLESS_ROOT();
  Request r;
  auto small = r.dir / "small";
  std::filesystem::create_directory(small);
  ASSERT_EQ(::mount("gpusnap-test", small.c_str(), "tmpfs", 0, "size=64m"), 0);
  r.file = small / "image";
  std::ofstream(r.file).close();
  // A write into a full store through a shared mapping would be a SIGBUS in the driver.
  auto p = probe({"512", "private", "populate", "driver"}, r.env());
  ::umount2(small.c_str(), MNT_DETACH);
  ASSERT_EQ(p.status, 0) << p.err;
  EXPECT_EQ(value(p.out, "shared"), "0") << p.out;
  EXPECT_EQ(value(p.out, "pattern"), "1") << p.out;
  EXPECT_EQ(value(p.out, "zero"), "1") << p.out;
  EXPECT_NE(p.err.find("no room for the driver's memory"), std::string::npos) << p.err;
}

}  // namespace
}  // namespace gpusnap::testing
