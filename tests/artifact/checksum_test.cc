// Chunked checksums and Artifact::verify on a small artifact built by hand: chunk boundaries,
// determinism across thread counts, and the problems verify names.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "artifact/chunk_hash.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap {
namespace {

using namespace gpusnap::testing;  // testing/unit.h
using artifact::ChunkHash;

namespace stdfs = std::filesystem;

constexpr uint64_t kChunk = 4096;

// Flips every bit of the byte at `offset`, in place.
void flip_byte(const stdfs::path& path, uint64_t offset) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(~c));
  ASSERT_TRUE(f.good()) << path;
}

// Deterministic bytes that differ from chunk to chunk (so equal chunks mean equal ranges).
std::string pattern(size_t size, unsigned seed) {
  std::string s(size, '\0');
  uint32_t x = 2463534242u + seed;
  for (auto& c : s) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    c = static_cast<char>(x);
  }
  return s;
}

bool is_hex128(const std::string& s) {
  return s.size() == 32 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

class RecordingReporter : public Reporter {
 public:
  struct Call {
    std::string name;
    uint64_t done;
    uint64_t total;
  };
  void progress(std::string_view name, uint64_t done, uint64_t total) override {
    std::lock_guard lock(mutex);
    calls.push_back({std::string(name), done, total});
  }
  std::mutex mutex;
  std::vector<Call> calls;
};

// Files of sizes 0, 1, chunk-1, chunk, chunk+1 and 3 chunks + 10, one in a nested directory.
// "criu/deep/c" is "criu/b" plus "one": its first chunk equals b's, its second equals one's.
class ChecksumTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root = dir.path() / "snap";
    b = pattern(kChunk, 2);
    write(root / "empty", "");
    write(root / "one", "z");
    write(root / "criu/a", pattern(kChunk - 1, 1));
    write(root / "criu/b", b);
    write(root / "criu/deep/c", b + "z");
    write(root / "criu/pages-1.img", pattern(3 * kChunk + 10, 3));
  }

  const FileRecord& find(const std::vector<FileRecord>& files, const std::string& path) {
    for (const auto& f : files) {
      if (f.path == path) return f;
    }
    ADD_FAILURE() << "no record for " << path;
    static const FileRecord kNone;
    return kNone;
  }

  // Seals the tree into a manifest.json, as the writer does, and opens it.
  Artifact seal() {
    stdfs::remove(root / kManifestName);  // a manifest does not list itself
    Manifest m;
    m.id = "checksum-test";
    m.chunk_bytes = kChunk;
    m.files = checksum_tree(root, kChunk, VerifyOptions{2, nullptr});
    write(root / kManifestName, m.to_json().dump(2));
    return Artifact::open(root);
  }

  TempDir dir;
  stdfs::path root;
  std::string b;
};

TEST_F(ChecksumTest, OneChunkPerChunkBytesAndAtLeastOne) {
  auto files = checksum_tree(root, kChunk, VerifyOptions{1, nullptr});
  std::vector<std::string> paths;
  for (const auto& f : files) paths.push_back(f.path);
  // Sorted, relative, regular files only (no directory records).
  EXPECT_EQ(paths, (std::vector<std::string>{"criu/a", "criu/b", "criu/deep/c", "criu/pages-1.img",
                                             "empty", "one"}));
  struct Want {
    const char* path;
    uint64_t size;
    size_t chunks;
  };
  for (const Want& w : {Want{"empty", 0, 1}, Want{"one", 1, 1}, Want{"criu/a", kChunk - 1, 1},
                        Want{"criu/b", kChunk, 1}, Want{"criu/deep/c", kChunk + 1, 2},
                        Want{"criu/pages-1.img", 3 * kChunk + 10, 4}}) {
    SCOPED_TRACE(w.path);
    const FileRecord& f = find(files, w.path);
    EXPECT_EQ(f.size, w.size);
    ASSERT_EQ(f.chunks.size(), w.chunks);
    for (const auto& c : f.chunks) EXPECT_TRUE(is_hex128(c)) << c;
  }
}

TEST_F(ChecksumTest, KnownFilesAreTakenAsGivenOthersAreRead) {
  auto read = checksum_tree(root, kChunk, VerifyOptions{1, nullptr});
  // Recorded by a writer that hashed the bytes itself (records made up so the test can tell).
  std::vector<FileRecord> known = {{"criu/deep/c", kChunk + 1, {"k0", "k1"}},
                                   {"one", 2, {"wrong size: read again"}},
                                   {"criu/b", kChunk, {"x", "wrong chunk count"}}};
  auto files = checksum_tree(root, kChunk, VerifyOptions{1, nullptr}, known);
  EXPECT_EQ(find(files, "criu/deep/c").chunks, (std::vector<std::string>{"k0", "k1"}));
  EXPECT_EQ(find(files, "one").chunks, find(read, "one").chunks);
  EXPECT_EQ(find(files, "criu/b").chunks, find(read, "criu/b").chunks);
}

TEST_F(ChecksumTest, AChunkHashIsTheManifestsChecksumOfThoseBytes) {
  auto files = checksum_tree(root, kChunk, VerifyOptions{1, nullptr});
  ChunkHash hash;
  hash.update("z", 1);
  EXPECT_EQ(hash.hex(), find(files, "one").chunks[0]);
  hash.reset();
  EXPECT_EQ(hash.hex(), find(files, "empty").chunks[0]);
}

TEST_F(ChecksumTest, ChunksCoverTheirOwnByteRange) {
  auto files = checksum_tree(root, kChunk, VerifyOptions{1, nullptr});
  const FileRecord& bf = find(files, "criu/b");
  const FileRecord& cf = find(files, "criu/deep/c");
  const FileRecord& one = find(files, "one");
  ASSERT_EQ(cf.chunks.size(), 2u);
  EXPECT_EQ(cf.chunks[0], bf.chunks[0]);   // bytes 0-4096 are b's bytes
  EXPECT_EQ(cf.chunks[1], one.chunks[0]);  // byte 4096 is "z", like the file "one"
  EXPECT_NE(find(files, "empty").chunks[0], one.chunks[0]);
  const FileRecord& pages = find(files, "criu/pages-1.img");
  for (size_t i = 0; i < pages.chunks.size(); ++i) {
    for (size_t j = i + 1; j < pages.chunks.size(); ++j) {
      EXPECT_NE(pages.chunks[i], pages.chunks[j]) << "chunks " << i << " and " << j;
    }
  }
}

TEST_F(ChecksumTest, DeterministicAcrossRunsAndThreadCounts) {
  auto one_thread = checksum_tree(root, kChunk, VerifyOptions{1, nullptr});
  auto four_threads = checksum_tree(root, kChunk, VerifyOptions{4, nullptr});
  auto all_cores = checksum_tree(root, kChunk, VerifyOptions{0, nullptr});
  auto again = checksum_tree(root, kChunk, VerifyOptions{4, nullptr});
  ASSERT_EQ(one_thread.size(), four_threads.size());
  for (const auto* other : {&four_threads, &all_cores, &again}) {
    ASSERT_EQ(other->size(), one_thread.size());
    for (size_t i = 0; i < one_thread.size(); ++i) {
      EXPECT_EQ((*other)[i].path, one_thread[i].path);
      EXPECT_EQ((*other)[i].size, one_thread[i].size);
      EXPECT_EQ((*other)[i].chunks, one_thread[i].chunks) << one_thread[i].path;
    }
  }
}

TEST_F(ChecksumTest, ChunkSizeChangesTheRecords) {
  auto small = checksum_tree(root, 1024, VerifyOptions{1, nullptr});
  auto big = checksum_tree(root, kChunk, VerifyOptions{1, nullptr});
  EXPECT_EQ(find(small, "criu/pages-1.img").chunks.size(), 13u);  // 12298 bytes / 1024
  EXPECT_EQ(find(small, "criu/b").chunks.size(), 4u);
  // A whole-file chunk does not equal the checksum of its first 1024 bytes.
  EXPECT_NE(find(small, "criu/b").chunks[0], find(big, "criu/b").chunks[0]);
}

TEST_F(ChecksumTest, ProgressEndsWithDoneEqualTotal) {
  RecordingReporter reporter;
  auto files = checksum_tree(root, kChunk, VerifyOptions{1, &reporter});
  uint64_t total = 0;
  for (const auto& f : files) total += f.size;
  ASSERT_FALSE(reporter.calls.empty());
  uint64_t last = 0;
  for (const auto& c : reporter.calls) {
    EXPECT_EQ(c.name, "checksum");
    EXPECT_EQ(c.total, total);
    EXPECT_GE(c.done, last) << "progress went backwards";
    last = c.done;
  }
  EXPECT_EQ(reporter.calls.back().done, total);
}

TEST_F(ChecksumTest, VerifyProgressReachesTotalWithManyThreads) {
  Artifact a = seal();
  RecordingReporter reporter;
  EXPECT_TRUE(a.verify(VerifyOptions{4, &reporter}).empty());
  // verify reads every file under the root, the manifest included.
  uint64_t total = stdfs::file_size(root / kManifestName) + a.manifest().total_bytes();
  ASSERT_FALSE(reporter.calls.empty());
  uint64_t last = 0;
  for (const auto& c : reporter.calls) {
    EXPECT_EQ(c.total, total);
    EXPECT_LE(c.done, total);
    EXPECT_GE(c.done, last) << "progress went backwards";
    last = c.done;
  }
  EXPECT_EQ(reporter.calls.back().done, total) << "the last report is done == total";
}

TEST_F(ChecksumTest, ProgressNeverGoesBackwardsWithManyThreads) {
  // Many small chunks over many threads: reports race each other unless they are ordered.
  write(root / "criu/pages-2.img", pattern(1 << 20, 4));
  for (int round = 0; round < 20; ++round) {
    RecordingReporter reporter;
    auto files = checksum_tree(root, 512, VerifyOptions{8, &reporter});
    uint64_t total = 0;
    for (const auto& f : files) total += f.size;
    ASSERT_FALSE(reporter.calls.empty());
    uint64_t last = 0;
    for (const auto& c : reporter.calls) {
      ASSERT_GE(c.done, last) << "round " << round << ": progress went backwards";
      ASSERT_EQ(c.total, total);
      last = c.done;
    }
    EXPECT_EQ(reporter.calls.back().done, total);
  }
}

TEST(ChecksumTreeTest, OnlyEmptyFilesStillReportsTheEnd) {
  TempDir dir;
  write(dir.path() / "a", "");
  write(dir.path() / "sub/b", "");
  RecordingReporter reporter;
  auto files = checksum_tree(dir.path(), kChunk, VerifyOptions{2, &reporter});
  ASSERT_EQ(files.size(), 2u);
  ASSERT_EQ(reporter.calls.size(), 1u);
  EXPECT_EQ(reporter.calls[0].name, "checksum");
  EXPECT_EQ(reporter.calls[0].done, 0u);
  EXPECT_EQ(reporter.calls[0].total, 0u);
}

TEST(ChecksumTreeTest, EmptyTreeReportsTheEnd) {
  TempDir dir;
  RecordingReporter reporter;
  EXPECT_TRUE(checksum_tree(dir.path(), kChunk, VerifyOptions{0, &reporter}).empty());
  ASSERT_EQ(reporter.calls.size(), 1u);
  EXPECT_EQ(reporter.calls[0].done, 0u);
  EXPECT_EQ(reporter.calls[0].total, 0u);
}

TEST(ChecksumTreeTest, MissingRootIsAnErrorNotAFilesystemError) {
  TempDir dir;
  const stdfs::path missing = dir.path() / "nope";
  try {
    checksum_tree(missing, kChunk);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_EQ(std::string(e.what()),
              "cannot list the files of " + missing.string() + ": No such file or directory");
    EXPECT_FALSE(e.hint().empty());
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a gpusnap::Error: " << e.what();
  }
}

TEST(ChecksumTreeTest, RootThatIsAFileIsAnError) {
  TempDir dir;
  write(dir.path() / "file", "x");
  try {
    checksum_tree(dir.path() / "file", kChunk);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_NE(std::string(e.what()).find("Not a directory"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a gpusnap::Error: " << e.what();
  }
}

TEST_F(ChecksumTest, VerifyFindsNothingInIntactArtifact) {
  Artifact a = seal();
  EXPECT_TRUE(a.verify(VerifyOptions{1, nullptr}).empty());
  EXPECT_TRUE(a.verify(VerifyOptions{4, nullptr}).empty());
  EXPECT_TRUE(a.verify().empty());
}

TEST_F(ChecksumTest, VerifyNamesFileAndChunkOfFlippedByte) {
  struct Case {
    const char* path;
    uint64_t offset;
    const char* range;
  };
  for (const Case& c : {Case{"criu/pages-1.img", 5000, "4096-8192"},
                        Case{"criu/pages-1.img", 3 * kChunk + 9, "12288-12298"},
                        Case{"criu/deep/c", 4096, "4096-4097"}, Case{"criu/a", 0, "0-4095"},
                        Case{"one", 0, "0-1"}}) {
    SCOPED_TRACE(std::string(c.path) + " @" + std::to_string(c.offset));
    Artifact a = seal();
    flip_byte(root / c.path, c.offset);
    auto problems = a.verify(VerifyOptions{4, nullptr});
    ASSERT_EQ(problems.size(), 1u);
    EXPECT_EQ(problems[0].path, c.path);
    EXPECT_EQ(problems[0].problem, std::string("checksum mismatch in bytes ") + c.range)
        << "one problem per damaged chunk, naming the chunk's range";
    flip_byte(root / c.path, c.offset);  // repair for the next case
    EXPECT_TRUE(a.verify().empty());
  }
}

TEST_F(ChecksumTest, VerifyNamesEveryDamagedChunk) {
  Artifact a = seal();
  flip_byte(root / "criu/pages-1.img", 1);
  flip_byte(root / "criu/pages-1.img", 3 * kChunk);
  auto problems = a.verify(VerifyOptions{2, nullptr});
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_EQ(problems[0].path, "criu/pages-1.img");
  EXPECT_EQ(problems[0].problem, "checksum mismatch in bytes 0-4096");
  EXPECT_EQ(problems[1].problem, "checksum mismatch in bytes 12288-12298");
}

TEST_F(ChecksumTest, VerifyReportsUnlistedFile) {
  Artifact a = seal();
  write(root / "criu/extra.img", "smuggled");
  auto problems = a.verify();
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "criu/extra.img");
  EXPECT_EQ(problems[0].problem, "not listed in the manifest");
}

TEST_F(ChecksumTest, VerifyReportsFileRemovedAfterOpen) {
  Artifact a = seal();  // open() itself refuses a missing file: remove it afterwards
  stdfs::remove(root / "criu/deep/c");
  auto problems = a.verify();
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "criu/deep/c");
  EXPECT_EQ(problems[0].problem, "missing");
}

TEST_F(ChecksumTest, VerifyReportsSizeChangedAfterOpen) {
  Artifact a = seal();
  stdfs::resize_file(root / "criu/b", kChunk - 96);
  {
    std::ofstream out(root / "criu/a", std::ios::binary | std::ios::app);
    out << "++";
  }
  auto problems = a.verify();
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_EQ(problems[0].path, "criu/a");
  EXPECT_EQ(problems[0].problem, "size 4097, expected 4095");
  EXPECT_EQ(problems[1].path, "criu/b");
  EXPECT_EQ(problems[1].problem, "size 4000, expected 4096");
}

}  // namespace
// A scope leaves a file's bytes to the caller (deferred: its size is still checked) or checks
// some files alone (only: nothing else, not even what is unlisted); compare() checks sums that
// someone else computed as they read the file, by the same rules.
TEST_F(ChecksumTest, VerifyInAScopeAndSumsComparedFromElsewhere) {
  Artifact a = seal();
  const auto intact = checksum_tree(root, kChunk, VerifyOptions{1, nullptr});
  flip_byte(root / "criu/pages-1.img", kChunk + 1);
  write(root / "criu/extra.img", "smuggled");
  VerifyScope deferred;
  deferred.deferred = {"criu/pages-1.img"};
  auto problems = a.verify({}, deferred);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "criu/extra.img");
  VerifyScope only;
  only.only = {"criu/pages-1.img"};
  problems = a.verify({}, only);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].problem, "checksum mismatch in bytes 4096-8192");
  stdfs::resize_file(root / "criu/pages-1.img", kChunk);
  problems = a.verify({}, deferred);
  ASSERT_EQ(problems.size(), 2u);  // the unlisted file, and the deferred one's size
  EXPECT_EQ(problems[1].problem, "size 4096, expected 12298");

  EXPECT_TRUE(a.compare(find(intact, "criu/pages-1.img")).empty());
  auto read_wrong = find(intact, "criu/pages-1.img");
  read_wrong.chunks[2] = std::string(32, '0');
  problems = a.compare(read_wrong);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].problem, "checksum mismatch in bytes 8192-12288");
  read_wrong.size = 1;
  EXPECT_EQ(a.compare(read_wrong).at(0).problem, "size 1, expected 12298");
  EXPECT_EQ(a.compare(FileRecord{"criu/none", 1, {}}).at(0).problem, "not listed in the manifest");
}

}  // namespace gpusnap
