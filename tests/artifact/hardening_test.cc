// Bad input that reaches gpusnap's readers of untrusted bytes (manifests, JSON, artifact trees)
// and the writer's promises about what it leaves on disk: each case is one that passed, or
// crashed, before it was refused here.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "artifact/validate.h"
#include "artifact/writer.h"
#include "common/fs.h"
#include "common/json.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap {
namespace {

using namespace gpusnap::testing;  // testing/unit.h
namespace stdfs = std::filesystem;
using artifact::ArtifactWriter;
using artifact::WriterOptions;
using nlohmann::json;

TEST(UntrustedJson, RefusesNestingBeyondTheLimitWithoutRecursing) {
  // 160 KB that crashed the agent (a stack overflow in dump()).
  const std::string deep = std::string(80000, '[') + std::string(80000, ']');
  std::string why;
  EXPECT_FALSE(json_text::parse(deep, &why));
  EXPECT_EQ(why, "nested deeper than 64 levels");
  const std::string ok = std::string(64, '[') + std::string(64, ']');
  EXPECT_TRUE(json_text::parse(ok, &why));
  // Brackets inside strings are not nesting.
  EXPECT_TRUE(json_text::parse("{\"a\": \"" + std::string(1000, '[') + "\\\"[\"}", &why));
}

TEST(UntrustedJson, BriefIsBoundedAndValidUtf8) {
  EXPECT_EQ(json_text::brief(json(std::string(200, 'x')), 10), "\"xxxxxxxxx...");
  const std::string shown = json_text::brief(json(std::string("bad \xff byte")));
  EXPECT_EQ(shown, "\"bad \xef\xbf\xbd byte\"");  // U+FFFD
}

TEST(UntrustedFile, ReadsOnlyBoundedRegularFiles) {
  TempDir dir;
  write(dir.path() / "small", "{}");
  write(dir.path() / "big", std::string(2000, ' '));
  ASSERT_EQ(::mkfifo((dir.path() / "fifo").c_str(), 0600), 0);
  stdfs::create_symlink(dir.path() / "small", dir.path() / "link");
  std::string text;
  EXPECT_TRUE(fs::try_read_regular_file(dir.path() / "small", &text, 1000));
  EXPECT_EQ(text, "{}");
  EXPECT_FALSE(fs::try_read_regular_file(dir.path() / "big", &text, 1000));
  EXPECT_EQ(errno, EFBIG);
  EXPECT_FALSE(fs::try_read_regular_file(dir.path() / "fifo", &text, 1000));  // not blocked
  EXPECT_EQ(errno, EINVAL);
  EXPECT_FALSE(fs::try_read_regular_file(dir.path() / "link", &text, 1000));
  EXPECT_EQ(errno, ELOOP);
}

// What gpusnap records durably (journals, the store's records, CRIU's kernel cache) is root's
// alone from its first byte whatever the umask, two writers of one file never meet in one
// temporary file, and a write that fails leaves nothing beside the file.
TEST(DurableFile, IsRootOnlyAtomicAndLeavesNothingBehind) {
  TempDir dir;
  const auto path = dir.path() / "record.json";
  const mode_t old = ::umask(0);
  fs::write_file_durable(path, "first");
  ::umask(old);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  // Writers at once: every write lands whole.
  std::vector<std::string> contents;
  for (int w = 0; w < 4; ++w)
    contents.push_back(std::string(100000 + w, static_cast<char>('a' + w)));
  {
    std::vector<std::jthread> writers;
    for (int w = 0; w < 4; ++w) {
      writers.emplace_back([&, w] {
        for (int i = 0; i < 25; ++i) fs::write_file_durable(path, contents[static_cast<size_t>(w)]);
      });
    }
  }
  std::string text;
  ASSERT_TRUE(fs::try_read_file(path, &text));
  EXPECT_NE(std::find(contents.begin(), contents.end(), text), contents.end());
  // A rename that fails (a folder is in the way): an error, and no temporary file left.
  stdfs::create_directory(dir.path() / "taken");
  write(dir.path() / "taken" / "x", "");
  EXPECT_THROW(fs::write_file_durable(dir.path() / "taken", "data"), Error);
  std::vector<std::string> names;
  for (const auto& e : stdfs::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"record.json", "taken"}));
}

TEST(FullDisk, IsTheEnvironmentsFaultWithAHint) {
  // /dev/full answers every write with ENOSPC, as a full filesystem writing the manifest did
  // (exit 1, no hint).
  Error e = catch_error([] { fs::write_file("/dev/full", "{}"); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_STREQ(e.what(), "write /dev/full: No space left on device");
  EXPECT_EQ(e.hint(), "free some space on that filesystem, or write elsewhere");
}

// A real artifact (written by ArtifactWriter), then forged one field at a time.
class ForgedArtifactTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root = dir.path() / "snap";
    {
      ArtifactWriter w(root);
      write(w.criu_dir() / "pages-1.img", std::string(10000, 'p'));
      write(w.staging() / "host-images/4242-1000.img", std::string(8192, 'h'));
      manifest.id = "forged";
      manifest.chunk_bytes = 4096;
      manifest.host_images = {
          {4242, 0x1000, 0x3000, "host-images/4242-1000.img", 0, "file[1:2]", 8192}};
      w.seal(manifest, phases);
      w.commit(manifest, phases);
    }
    doc = manifest.to_json();
  }

  // Writes `doc` as the manifest and returns the error of opening the artifact.
  Error open_error() {
    stdfs::permissions(root / kManifestName, stdfs::perms::owner_write, stdfs::perm_options::add);
    write(root / kManifestName, doc.dump(2));
    return catch_error([&] { Artifact::open(root); });
  }

  TempDir dir;
  Reporter reporter;
  Phases phases{reporter};
  stdfs::path root;
  Manifest manifest;
  json doc;
};

TEST_F(ForgedArtifactTest, IntactOneOpensAndVerifies) {
  auto a = Artifact::open(root);
  EXPECT_TRUE(a.verify().empty());
}

TEST_F(ForgedArtifactTest, HostImagePathOutsideTheArtifactIsRefused) {
  for (const std::string path : {"../../../../../../etc/shadow", "/etc/shadow"}) {
    doc["host_images"][0]["file"] = path;
    Error e = open_error();
    EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
    EXPECT_EQ(std::string(e.what()),
              "manifest lists an unsafe path '" + path + "' for a host image");
  }
}

TEST_F(ForgedArtifactTest, HostImageNotAmongTheFilesIsRefused) {
  doc["host_images"][0]["file"] = "criu/other.img";
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "manifest names the host image 'criu/other.img', which is not among "
                         "its files");
}

TEST_F(ForgedArtifactTest, HostImageRangeBeyondItsFileIsRefused) {
  doc["host_images"][0]["end"] = 0x1000 + 8192 + 4096;
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(),
               "manifest maps host image 'host-images/4242-1000.img' beyond the end of the file");
}

TEST_F(ForgedArtifactTest, TinyChunkSizeIsRefused) {
  // chunk_bytes 1 made verify run 2 minutes and die of bad_alloc at 12 GB.
  doc["checksum"]["chunk_bytes"] = 1;
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(),
               "manifest has a checksum chunk size of 1 bytes, outside 4096 to 4294967296");
}

TEST_F(ForgedArtifactTest, ChunkCountThatDoesNotMatchTheSizeIsRefused) {
  doc["files"][0]["size"] = 1ull << 40;  // criu/pages-1.img: 3 checksums for 1 TiB
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "manifest lists 3 checksums for criu/pages-1.img, whose size makes "
                         "268435456 chunks");
}

TEST_F(ForgedArtifactTest, FileListedTwiceIsRefused) {
  doc["files"].push_back(doc["files"][0]);
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "manifest lists the file 'criu/pages-1.img' twice");
}

TEST_F(ForgedArtifactTest, ListedFileThatIsASymlinkIsRefused) {
  stdfs::remove(root / "criu/pages-1.img");
  stdfs::create_symlink("/etc/passwd", root / "criu/pages-1.img");
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "artifact file criu/pages-1.img is not a regular file");
}

TEST_F(ForgedArtifactTest, ListedFileBehindASymlinkedDirectoryIsRefused) {
  // criu/ replaced by a symlink to a copy outside the artifact.
  stdfs::copy(root / "criu", dir.path() / "outside");
  stdfs::remove_all(root / "criu");
  stdfs::create_symlink(dir.path() / "outside", root / "criu");
  Error e = open_error();
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_STREQ(e.what(), "artifact file criu/pages-1.img lies outside the artifact");
}

TEST_F(ForgedArtifactTest, VerifyReportsUnexpectedEntries) {
  stdfs::create_directory(root / "criu/extra-dir");
  ASSERT_EQ(::mkfifo((root / "criu/fifo").c_str(), 0600), 0);
  stdfs::create_directory_symlink("/etc", root / "criu/etc");
  auto problems = Artifact::open(root).verify();
  std::vector<std::string> seen;
  for (const auto& p : problems) seen.push_back(p.path + ": " + p.problem);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<std::string>{"criu/etc: a symlink, not a regular file",
                                            "criu/extra-dir: unexpected directory",
                                            "criu/fifo: a FIFO, not a regular file"}));
}

TEST_F(ForgedArtifactTest, ManifestLargerThanTheBoundIsRefused) {
  stdfs::resize_file(root / kManifestName, artifact::kMaxManifestBytes + 1);
  Error e = catch_error([&] { Artifact::open(root); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(std::string(e.what()),
            "manifest.json in " + root.string() + " is larger than 64.0 MiB");
}

TEST_F(ForgedArtifactTest, DeeplyNestedManifestIsRefused) {
  stdfs::permissions(root / kManifestName, stdfs::perms::owner_write, stdfs::perm_options::add);
  write(root / kManifestName, std::string(100000, '[') + std::string(100000, ']'));
  Error e = catch_error([&] { Artifact::open(root); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(std::string(e.what()), "manifest.json in " + root.string() + " is not valid JSON");
}

// What the writer leaves: root-only, whatever the umask.
class ArtifactModeTest : public ::testing::Test {
 protected:
  // Writes and commits an artifact under umask 022 and returns every entry's mode.
  std::vector<std::pair<std::string, mode_t>> modes_of_new_artifact(WriterOptions options) {
    const mode_t old = ::umask(022);
    const auto root = dir.path() / "snap";
    {
      ArtifactWriter w(root, options);
      struct stat st {};
      EXPECT_EQ(::stat(w.staging().c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 07777, 0700u) << "the staging directory, from its first instant";
      write(w.criu_dir() / "pages-1.img", "secret");
      Manifest m;
      m.chunk_bytes = 4096;
      w.seal(m, phases);
      w.commit(m, phases);
    }
    ::umask(old);
    std::vector<std::pair<std::string, mode_t>> modes;
    for (const auto& p : {stdfs::path(), stdfs::path("criu"), stdfs::path("criu/pages-1.img"),
                          stdfs::path(kManifestName)}) {
      struct stat st {};
      EXPECT_EQ(::stat((root / p).c_str(), &st), 0);
      modes.emplace_back(p.string(), st.st_mode & 07777);
    }
    return modes;
  }

  TempDir dir;
  Reporter reporter;
  Phases phases{reporter};
};

TEST_F(ArtifactModeTest, RootOnlyWhateverTheUmask) {
  using Modes = std::vector<std::pair<std::string, mode_t>>;
  EXPECT_EQ(
      modes_of_new_artifact({}),
      (Modes{{"", 0700}, {"criu", 0700}, {"criu/pages-1.img", 0600}, {"manifest.json", 0600}}));
}

TEST_F(ArtifactModeTest, AGroupMayBeGrantedRead) {
  using Modes = std::vector<std::pair<std::string, mode_t>>;
  EXPECT_EQ(
      modes_of_new_artifact({.group = 65534, .run_dir = {}}),
      (Modes{{"", 0750}, {"criu", 0750}, {"criu/pages-1.img", 0640}, {"manifest.json", 0640}}));
  struct stat st {};
  ASSERT_EQ(::stat((dir.path() / "snap/criu/pages-1.img").c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, 65534u);
}

TEST(ArtifactWriterOutput, DanglingSymlinkAtTheOutputIsRefusedAtOnce) {
  TempDir dir;
  stdfs::create_symlink(dir.path() / "nowhere", dir.path() / "snap");
  Error e = catch_error([&] { ArtifactWriter w(dir.path() / "snap"); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_EQ(std::string(e.what()), "output " + (dir.path() / "snap").string() + " already exists");
}

TEST(ArtifactWriterOutput, OutputUnderProcIsAUsageError) {
  Error e = catch_error([&] { ArtifactWriter w("/proc/x"); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_EQ(std::string(e.what()), "cannot create an artifact in /proc: No such file or directory");
  EXPECT_EQ(e.hint(), "choose an -o path in a writable directory of an ordinary filesystem");
}

TEST(ArtifactWriterOutput, StagingOfAKilledWriterIsFoundThroughItsRecord) {
  TempDir dir;
  const auto run_dir = dir.path() / "run";
  const auto out = dir.path() / "out";
  stdfs::create_directories(out);
  // A live writer's staging and record are left alone.
  std::optional<ArtifactWriter> live;
  live.emplace(out / "other", WriterOptions{.group = std::nullopt, .run_dir = run_dir});
  // What a gpusnap killed right after its mkdir leaves: its record and its staging directory.
  const pid_t dead = dead_pid();
  const auto staged = out / (".snap.staging-" + std::to_string(dead) + "-abcdef12");
  stdfs::create_directories(staged / "criu");
  stdfs::create_directories(run_dir / "staging");
  write(run_dir / "staging" / (std::to_string(dead) + "-0000aaaa"), out.string());

  auto log = ArtifactWriter::remove_abandoned_staging(run_dir);
  EXPECT_EQ(log,
            std::vector<std::string>{"removed the staging directory " + staged.string() +
                                     " of a killed gpusnap (pid " + std::to_string(dead) + ")"});
  EXPECT_FALSE(stdfs::exists(staged));
  EXPECT_TRUE(stdfs::is_directory(live->staging()));
  live.reset();
  EXPECT_TRUE(stdfs::is_empty(run_dir / "staging")) << "records go with their writers";
}

}  // namespace
}  // namespace gpusnap
