// ArtifactWriter: an artifact appears under its final name only when complete; anything else
// leaves no trace, and stale staging directories of dead writers are swept.
#include "artifact/writer.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <limits.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "gpusnap/phases.h"
#include "testing/unit.h"

namespace gpusnap {
namespace {

using namespace gpusnap::testing;  // testing/unit.h
using artifact::ArtifactWriter;

namespace stdfs = std::filesystem;

std::vector<std::string> entries(const stdfs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : stdfs::directory_iterator(dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

class WriterTest : public ::testing::Test {
 protected:
  TempDir dir;
  Reporter reporter;
  Phases phases{reporter};
};

TEST_F(WriterTest, RefusesExistingOutput) {
  stdfs::create_directory(dir.path() / "snap");
  Error e = catch_error([&] { ArtifactWriter w(dir.path() / "snap"); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_EQ(std::string(e.what()), "output " + (dir.path() / "snap").string() + " already exists");
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"snap"}) << "no staging dir left";
}

TEST_F(WriterTest, RefusesExistingFileAsOutput) {
  write(dir.path() / "snap", "x");
  Error e = catch_error([&] { ArtifactWriter w(dir.path() / "snap"); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_TRUE(Contains(e.what(), "already exists"));
}

TEST_F(WriterTest, RefusesMissingParentDirectory) {
  Error e = catch_error([&] { ArtifactWriter w(dir.path() / "no/such/snap"); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  EXPECT_EQ(std::string(e.what()),
            "output directory " + (dir.path() / "no/such").string() + " does not exist");
  EXPECT_FALSE(stdfs::exists(dir.path() / "no"));
}

TEST_F(WriterTest, StagingIsHiddenBesideTheFinalPath) {
  ArtifactWriter w(dir.path() / "snap");
  EXPECT_EQ(w.final_path(), dir.path() / "snap");
  EXPECT_EQ(w.staging().parent_path(), dir.path());
  const std::string name = w.staging().filename();
  const std::string prefix = ".snap.staging-" + std::to_string(::getpid()) + "-";
  EXPECT_EQ(name.rfind(prefix, 0), 0u) << name;
  EXPECT_EQ(name.size(), prefix.size() + 8) << name;
  EXPECT_TRUE(stdfs::is_directory(w.staging()));
  EXPECT_EQ(w.criu_dir(), w.staging() / "criu");
  EXPECT_TRUE(stdfs::is_directory(w.criu_dir()));
  EXPECT_FALSE(stdfs::exists(w.final_path()));
}

TEST_F(WriterTest, TrailingSlashNamesTheSameArtifact) {
  ArtifactWriter w((dir.path() / "snap").string() + "/");
  EXPECT_EQ(w.final_path(), dir.path() / "snap");
  EXPECT_EQ(w.staging().parent_path(), dir.path());
}

TEST_F(WriterTest, TwoWritersForOneNameStageSeparately) {
  ArtifactWriter a(dir.path() / "snap");
  ArtifactWriter b(dir.path() / "snap");
  EXPECT_NE(a.staging(), b.staging());
  EXPECT_TRUE(stdfs::is_directory(a.staging()));
  EXPECT_TRUE(stdfs::is_directory(b.staging()));
}

TEST_F(WriterTest, DestroyedWithoutCommitLeavesNothing) {
  stdfs::path staging;
  {
    ArtifactWriter w(dir.path() / "snap");
    staging = w.staging();
    write(w.criu_dir() / "pages-1.img", std::string(10000, 'p'));
    Manifest m;
    m.chunk_bytes = 4096;
    w.seal(m, phases);  // sealed but never committed
  }
  EXPECT_FALSE(stdfs::exists(staging));
  EXPECT_FALSE(stdfs::exists(dir.path() / "snap"));
  EXPECT_TRUE(entries(dir.path()).empty());
}

TEST_F(WriterTest, SealAndCommitProduceAVerifiedArtifact) {
  const auto final_path = dir.path() / "snap";
  stdfs::path staging;
  Manifest m;
  m.id = "writer-test";
  m.chunk_bytes = 4096;
  {
    ArtifactWriter w(final_path);
    staging = w.staging();
    write(w.criu_dir() / "pages-1.img", std::string(10000, 'p'));
    write(w.criu_dir() / "core-1.img", "core");
    write(w.staging() / "dump.log", "");
    w.seal(m, phases);
    ASSERT_EQ(m.files.size(), 3u);
    EXPECT_EQ(m.files[0].path, "criu/core-1.img");
    EXPECT_EQ(m.files[1].path, "criu/pages-1.img");
    EXPECT_EQ(m.files[1].size, 10000u);
    EXPECT_EQ(m.files[1].chunks.size(), 3u);
    EXPECT_EQ(m.files[2].path, "dump.log");
    EXPECT_FALSE(stdfs::exists(final_path)) << "sealing does not publish";
    w.commit(m, phases);
    EXPECT_TRUE(stdfs::is_directory(final_path));
    EXPECT_FALSE(stdfs::exists(staging));
  }
  // The committed artifact outlives its writer.
  EXPECT_TRUE(stdfs::is_directory(final_path));
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"snap"});
  EXPECT_EQ(entries(final_path), (std::vector<std::string>{"criu", "dump.log", "manifest.json"}));

  Artifact a = Artifact::open(final_path);
  EXPECT_EQ(a.manifest().id, "writer-test");
  EXPECT_EQ(a.manifest().to_json(), m.to_json());
  EXPECT_TRUE(a.verify().empty());

  ASSERT_EQ(phases.timings().size(), 2u);
  EXPECT_EQ(phases.timings()[0].name, "checksum");
  EXPECT_EQ(phases.timings()[1].name, "commit");
}

TEST_F(WriterTest, CommitRefusesOutputThatAppearedMeanwhile) {
  const auto final_path = dir.path() / "snap";
  stdfs::path staging;
  {
    ArtifactWriter w(final_path);
    staging = w.staging();
    Manifest m;
    w.seal(m, phases);
    stdfs::create_directory(final_path);  // another checkpoint won the race
    write(final_path / "theirs", "kept");
    Error e = catch_error([&] { w.commit(m, phases); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage);
    EXPECT_EQ(std::string(e.what()), "output " + final_path.string() + " appeared meanwhile");
  }
  EXPECT_FALSE(stdfs::exists(staging));
  EXPECT_EQ(entries(final_path), std::vector<std::string>{"theirs"});
}

TEST_F(WriterTest, RemoveStaleStagingRemovesOnlyDeadWritersDirectories) {
  const pid_t dead = dead_pid();
  const std::string stale = ".snap.staging-" + std::to_string(dead) + "-abcd";
  const std::string live = ".snap.staging-" + std::to_string(::getpid()) + "-abcd";
  const std::string unhidden = "snap.staging-" + std::to_string(dead) + "-abcd";
  for (const auto& name : {stale, live, unhidden, std::string(".cache"), std::string("snap")}) {
    stdfs::create_directory(dir.path() / name);
    write(dir.path() / name / "file", "x");
  }
  ArtifactWriter::remove_stale_staging(dir.path());
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{".cache", live, "snap", unhidden}));
}

// Takes LOCK_EX|LOCK_NB on a directory through a new open file description, as a writer in
// another process (or PID namespace) would see it.
bool lockable(const stdfs::path& path) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  return fd && ::flock(fd.get(), LOCK_EX | LOCK_NB) == 0;
}

TEST_F(WriterTest, WriterHoldsTheLockOfItsStagingUntilDestroyed) {
  stdfs::path staging;
  {
    ArtifactWriter w(dir.path() / "snap");
    staging = w.staging();
    EXPECT_FALSE(lockable(staging)) << "a live writer's staging directory must be locked";
  }
  EXPECT_FALSE(stdfs::exists(staging));
}

TEST_F(WriterTest, CommittedArtifactIsNotLockedAfterTheWriter) {
  const auto final_path = dir.path() / "snap";
  {
    ArtifactWriter w(final_path);
    Manifest m;
    w.seal(m, phases);
    w.commit(m, phases);
  }
  EXPECT_TRUE(lockable(final_path));
}

TEST_F(WriterTest, RemoveStaleStagingSparesLockedDirectoryOfAnOwnerItCannotSee) {
  // The owner's pid is not visible here (as for a writer in another container sharing the
  // volume), but the directory is locked: it is in use and must stay.
  const auto staging = dir.path() / (".snap.staging-" + std::to_string(dead_pid()) + "-beef");
  stdfs::create_directories(staging / "criu");
  {
    common::UniqueFd held(::open(staging.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    ASSERT_TRUE(held);
    ASSERT_EQ(::flock(held.get(), LOCK_EX), 0);
    ArtifactWriter::remove_stale_staging(dir.path());
    EXPECT_TRUE(stdfs::is_directory(staging / "criu"));
    ArtifactWriter w(dir.path() / "other");  // a new writer's sweep spares it too
    EXPECT_TRUE(stdfs::is_directory(staging / "criu"));
  }
  // Its owner is gone (lock released): now it is stale.
  ArtifactWriter::remove_stale_staging(dir.path());
  EXPECT_FALSE(stdfs::exists(staging));
}

TEST_F(WriterTest, RemoveStaleStagingSkipsStagingNamedSymlink) {
  const auto target = dir.path() / "target";
  stdfs::create_directory(target);
  write(target / "file", "x");
  const auto link = dir.path() / (".snap.staging-" + std::to_string(dead_pid()) + "-1ink");
  stdfs::create_directory_symlink(target, link);
  ArtifactWriter::remove_stale_staging(dir.path());
  EXPECT_TRUE(stdfs::exists(target / "file"));
}

TEST_F(WriterTest, FailureToCreateCriuDirLeavesNoStaging) {
  // A parent path so long that the staging directory fits within PATH_MAX but its criu/
  // subdirectory does not: creating criu/ fails with ENAMETOOLONG.
  stdfs::path parent = dir.path();
  const std::string name = "s";
  const size_t staging_component =
      1 + name.size() + 9 + std::to_string(::getpid()).size() + 1 + 8;  // .s.staging-PID-XXXXXXXX
  const size_t want_parent = PATH_MAX - 3 - 1 - staging_component;      // staging: PATH_MAX - 3
  while (parent.string().size() < want_parent) {
    size_t left = want_parent - parent.string().size() - 1;
    parent /= std::string(std::min<size_t>(left, 200), 'd');
  }
  ASSERT_EQ(parent.string().size(), want_parent);
  stdfs::create_directories(parent);
  Error e = catch_error([&] { ArtifactWriter w(parent / name); });
  EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  EXPECT_TRUE(Contains(e.what(), "/criu: ")) << e.what();
  EXPECT_TRUE(entries(parent).empty()) << "the staging directory was left behind";
}

TEST_F(WriterTest, RemoveStaleStagingNeverThrows) {
  EXPECT_NO_THROW(ArtifactWriter::remove_stale_staging(dir.path() / "missing"));
}

TEST_F(WriterTest, NewWriterSweepsStaleStaging) {
  const auto stale = dir.path() / (".old.staging-" + std::to_string(dead_pid()) + "-ffff");
  stdfs::create_directories(stale / "criu");
  ArtifactWriter w(dir.path() / "snap");
  EXPECT_FALSE(stdfs::exists(stale));
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{w.staging().filename()});
}

}  // namespace
}  // namespace gpusnap
