// Host images end to end on the real test workload with real CRIU: the GPU memory that the
// driver's checkpoint leaves in host memory is stored by gpusnap (not by CRIU), mapped back in
// the source and in every copy, byte for byte.
//
// No GPU here, so StagingDriver plays the part of the driver that matters: on checkpoint it
// maps a new private anonymous region in the process and fills it with "GPU contents" (what
// the real driver does, measured on the H200: docs/gpu-memory.md), on restore it reads the region
// back from the process, checks every byte and unmaps it. The state machine is FakeDriver's.
#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "common/proc.h"
#include "common/syscall_injection.h"
#include "engine/host_images.h"
#include "engine/preload.h"
#include "gpu/fake_driver.h"
#include "gpusnap/artifact.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/restore.h"
#include "testing/harness.h"
#include "testing/staging_driver.h"

namespace gpusnap::testing {
namespace {

using gpu::FakeDriver;
using gpu::ProcessState;

constexpr const char* kGpu = "GPU-0a0a0a0a-1111-2222-3333-444444444444";
// Sum of the sizes of CRIU's page images.
uint64_t criu_page_bytes(const std::filesystem::path& artifact) {
  uint64_t total = 0;
  for (const auto& e : std::filesystem::directory_iterator(artifact / kCriuImageDir)) {
    if (e.path().filename().string().rfind("pages-", 0) == 0) total += e.file_size();
  }
  return total;
}

class Phases final : public Reporter {
 public:
  std::function<void(std::string_view)> on_start;
  std::vector<std::string> names, notes;
  void phase_started(std::string_view name) override {
    names.emplace_back(name);
    if (on_start) on_start(name);
  }
  void phase_finished(std::string_view, double) override {}
  void note(std::string_view text) override { notes.emplace_back(text); }
};

struct CaptureRun {
  CheckpointResult checkpoint;
  RestoreResult restore;
  std::map<pid_t, std::string> outcomes;
  std::vector<std::string> notes, phases;  // the checkpoint's
};

// Checkpoint (leaving the source running) and restore two copies, all through StagingDriver
// (played inside the workload when `in_process`).
CaptureRun checkpoint_and_restore(const TempDir& dir, Workload& source, bool host_images,
                                  uint64_t file_bytes = 0, bool in_process = false,
                                  bool direct = true) {
  FakeDriver fake;
  fake.add_gpu(FakeDriver::make_gpu(kGpu));
  fake.add_process(source.pid());
  fake.set_usage(source.pid(), kGpu, kRegion);
  StagingDriver driver(fake, in_process ? source.port() : 0);

  CheckpointOptions co = capture_options(dir, source, driver);
  co.leave_running = true;
  co.host_images = host_images;
  co.host_image_file_bytes = file_bytes;
  co.direct_host_images = direct;
  Phases cp_phases;
  CaptureRun run;
  run.checkpoint = checkpoint(co, cp_phases);
  EXPECT_EQ(std::count(cp_phases.names.begin(), cp_phases.names.end(), "host-images"),
            host_images ? 1 : 0);

  RestoreOptions ro;
  ro.artifact = dir / "snap";
  ro.driver = &driver;
  ro.helper_binary = gpusnap_bin();
  ro.run_dir = dir / "run";
  ro.replicas = 2;
  ro.timeout = std::chrono::seconds(60);
  ro.publish = {PortPublish::parse(std::to_string(source.port()))};
  Phases rs_phases;
  // The copies' processes become known to the driver when its restore would first see them.
  rs_phases.on_start = [&](std::string_view phase) {
    if (phase != "gpu-restore") return;
    for (pid_t host : copies_of(source.pid())) {
      fake.add_process(host, ProcessState::kCheckpointed);
      fake.set_usage(host, kGpu, kRegion);
    }
  };
  run.restore = restore(ro, rs_phases);
  run.outcomes = driver.outcomes();
  run.notes = cp_phases.notes;
  run.phases = cp_phases.names;
  return run;
}

// The driver found the exact bytes in the source (its gpu-resume) and in both copies, the
// workload works everywhere, and the artifact verifies.
void expect_intact_everywhere(const CaptureRun& run, Workload& source,
                              const std::filesystem::path& artifact) {
  ASSERT_EQ(run.outcomes.size(), 3u);
  for (const auto& [pid, outcome] : run.outcomes) EXPECT_EQ(outcome, "ok") << "pid " << pid;
  EXPECT_EQ(run.outcomes.count(source.pid()), 1u);
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
  ASSERT_EQ(run.restore.copies.size(), 2u);
  for (const auto& c : run.restore.copies) {
    EXPECT_EQ(ask(c.ports[0].host_port, "CHECK").substr(0, 2), "OK");
  }
  EXPECT_TRUE(Artifact::open(artifact).verify().empty());
}

// The test workload with libgpusnap-preload.so, looking for requests where a capture run with
// run_dir `dir/run` leaves them.
Workload preloaded_workload(const TempDir& dir) {
  return Workload(
      dir,
      {"/usr/bin/env", "LD_PRELOAD=" + build_path("libgpusnap-preload.so"),
       "GPUSNAP_PRELOAD_REQUESTS=" + (dir / "run" / "preload").string(), "GPUSNAP_PRELOAD_LOG=1",
       build_path("tests/gpusnap-test-workload"), "--mib", "8"},
      std::chrono::seconds(30));
}

TEST(HostImages, GpuMemoryIsStoredBesideCriuAndMappedBackInEveryCopy) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir, {"--mib", "8", "--threads", "2"});
  CaptureRun run = checkpoint_and_restore(dir, source, true, 80 * kMiB);
  Copies reaper{run.restore.copies};

  // The region in files of at most 80 MiB, i.e. whole 64 MiB chunks: 64 + 64 + 64 MiB, its zero
  // quarter left as holes, none of it in CRIU's pages.
  const auto& images = run.checkpoint.manifest.host_images;
  ASSERT_EQ(images.size(), 3u);
  for (size_t i = 0; i < images.size(); ++i) {
    EXPECT_EQ(images[i].end - images[i].start, 64 * kMiB);
    if (i > 0) {
      EXPECT_EQ(images[i].start, images[i - 1].end);
    }
  }
  EXPECT_EQ(images.back().end - images.front().start, kRegion);
  EXPECT_EQ(images.front().start % kHugePage, kRegionSkew);
  uint64_t stored = 0, allocated = 0;
  for (const auto& image : images) {
    EXPECT_EQ(image.pid, source.pid());
    EXPECT_TRUE(image.criu_key.rfind("file[", 0) == 0) << image.criu_key;
    auto file = dir / "snap" / image.file;
    // Each file starts with a hole that puts the region's bytes at the same offset within a
    // 2 MiB page as their address, so that huge pages of the file can be mapped whole.
    EXPECT_EQ(image.file_offset, image.start % kHugePage);
    EXPECT_EQ(std::filesystem::file_size(file), image.file_offset + image.end - image.start);
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0);
    stored += image.stored_bytes;
    allocated += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  EXPECT_EQ(stored, kRegion / 4 * 3);
  // Each zero 4 MiB block of the region holds at least one whole 2 MiB page of its file (the
  // file system may cache in 2 MiB pages, and the skew puts the blocks across their edges):
  // that much at least is a hole.
  const uint64_t zero_blocks = kRegion / (16 * kMiB);
  EXPECT_LE(allocated, kRegion - zero_blocks * kHugePage + 8 * kMiB) << "not sparse";
  EXPECT_LT(criu_page_bytes(dir / "snap"), 64 * kMiB) << "CRIU stored the region too";

  // The checksums recorded for the host images while they were copied are the files' bytes'.
  expect_intact_everywhere(run, source, dir / "snap");
}

TEST(HostImages, ByDefaultARegionIsOneFile) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir, {"--mib", "8"});
  CaptureRun run = checkpoint_and_restore(dir, source, true);
  Copies reaper{run.restore.copies};
  ASSERT_EQ(run.checkpoint.manifest.host_images.size(), 1u);
  EXPECT_EQ(
      run.checkpoint.manifest.host_images[0].end - run.checkpoint.manifest.host_images[0].start,
      kRegion);
  ASSERT_EQ(run.outcomes.size(), 3u);
  for (const auto& [pid, outcome] : run.outcomes) EXPECT_EQ(outcome, "ok") << "pid " << pid;
}

TEST(HostImages, WithoutThemCriuStoresTheSameBytes) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir, {"--mib", "8"});
  CaptureRun run = checkpoint_and_restore(dir, source, false);
  Copies reaper{run.restore.copies};

  EXPECT_TRUE(run.checkpoint.manifest.host_images.empty());
  EXPECT_FALSE(std::filesystem::exists(dir / "snap" / engine::kHostImageDir));
  EXPECT_GE(criu_page_bytes(dir / "snap"), kRegion / 4 * 3);
  ASSERT_EQ(run.outcomes.size(), 3u);
  for (const auto& [pid, outcome] : run.outcomes) EXPECT_EQ(outcome, "ok") << "pid " << pid;
  for (const auto& c : run.restore.copies) {
    EXPECT_EQ(ask(c.ports[0].host_port, "CHECK").substr(0, 2), "OK");
  }
}

TEST(HostImages, WithThePreloadLibraryTheDriverWritesStraightIntoTheArtifact) {
  SKIP_WITHOUT_CRIU();
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root";
  TempDir dir;
  Workload source = preloaded_workload(dir);
  CaptureRun run = checkpoint_and_restore(dir, source, true, 0, /*in_process=*/true);
  Copies reaper{run.restore.copies};

  // One image, the driver's whole region, written by the driver's own copy: 2 MiB-aligned at
  // offset 0 of its file (the library placed it), zero blocks counted out of stored_bytes.
  const auto& images = run.checkpoint.manifest.host_images;
  ASSERT_EQ(images.size(), 1u);
  const auto& image = images.front();
  EXPECT_EQ(image.end - image.start, kLibraryRegion);
  EXPECT_EQ(image.start % kHugePage, 0u);
  EXPECT_EQ(image.file_offset, 0u);
  EXPECT_EQ(image.stored_bytes, kLibraryRegion / 4 * 3);
  std::ostringstream name;
  name << engine::kHostImageDir << "/" << source.pid() << "-" << std::hex << image.start << ".img";
  EXPECT_EQ(image.file, name.str());
  EXPECT_EQ(std::filesystem::file_size(dir / "snap" / image.file), kLibraryRegion);
  EXPECT_NE(std::find_if(run.notes.begin(), run.notes.end(),
                         [](const std::string& n) {
                           return n.find("written into the artifact by the driver's checkpoint "
                                         "itself") != std::string::npos;
                         }),
            run.notes.end())
      << ::testing::PrintToString(run.notes) << fs::read_file(dir / "workload.log");
  EXPECT_EQ(std::count(run.phases.begin(), run.phases.end(), "host-images-hash"), 1);
  EXPECT_LT(criu_page_bytes(dir / "snap"), 64 * kMiB) << "CRIU stored the region too";
  // No request is left behind; the library made the region private itself (no ptrace), and
  // its watcher is gone.
  EXPECT_TRUE(std::filesystem::is_empty(dir / "run" / "preload"));
  EXPECT_NE(fs::read_file(dir / "workload.log")
                .find("made the driver's memory private from inside the process"),
            std::string::npos)
      << fs::read_file(dir / "workload.log");
  EXPECT_FALSE(engine::has_thread_named(source.pid(), engine::kRemapThreadName));

  // The source's region is now a private mapping of the artifact's file: what the source
  // writes there (the driver's restore reads it, then unmaps it) never reaches the artifact.
  // The artifact verifies against the checksums hashed beside the dump.
  expect_intact_everywhere(run, source, dir / "snap");
}

TEST(HostImages, TheCopyingPathStaysSelectableForAPreloadedWorkload) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source = preloaded_workload(dir);
  CaptureRun run = checkpoint_and_restore(dir, source, true, 0, /*in_process=*/true,
                                          /*direct=*/false);
  Copies reaper{run.restore.copies};
  const auto& images = run.checkpoint.manifest.host_images;
  ASSERT_EQ(images.size(), 1u);
  // Copied after the call: the file starts with the hole that aligns it, zero blocks are holes.
  EXPECT_EQ(images[0].file_offset, images[0].start % kHugePage);
  EXPECT_EQ(images[0].stored_bytes, kLibraryRegion / 4 * 3);
  EXPECT_EQ(images[0].file.rfind(
                std::string(engine::kHostImageDir) + "/" + std::to_string(source.pid()) + "-", 0),
            0u);
  EXPECT_EQ(std::count(run.phases.begin(), run.phases.end(), "host-images-hash"), 0);
  ASSERT_EQ(run.outcomes.size(), 3u);
  for (const auto& [pid, outcome] : run.outcomes) EXPECT_EQ(outcome, "ok") << "pid " << pid;
  EXPECT_TRUE(Artifact::open(dir / "snap").verify().empty());
}

// The process's mapping of a host image file, if it has one.
std::optional<common::Mapping> host_image_mapping(pid_t pid) {
  for (const auto& m : common::read_mappings(pid)) {
    if (m.path.find("/host-images/") != std::string::npos) return m;
  }
  return std::nullopt;
}

// In a forked child: captures the preloaded workload on the direct path with the fake driver,
// reporting to `reporter` (which may kill this process), then exits with 3.
[[noreturn]] void capture_in_this_process(const TempDir& dir, const Workload& source,
                                          Reporter& reporter) {
  FakeDriver fake;
  fake.add_gpu(FakeDriver::make_gpu(kGpu));
  fake.add_process(source.pid());
  fake.set_usage(source.pid(), kGpu, kLibraryRegion);
  StagingDriver driver(fake, source.port());
  try {
    checkpoint(capture_options(dir, source, driver), reporter);
  } catch (...) {  // NOLINT(bugprone-empty-catch): the parent checks what was left
  }
  ::_exit(3);
}

TEST(HostImages, ACaptureKilledOnTheDirectPathLeavesTheWorkloadItsMemoryAndNoArtifact) {
  SKIP_WITHOUT_CRIU();
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root";
  // After the driver's call (its memory in a shared mapping of the artifact's file), after the
  // remap (mapped privately, hashing under way), and while waiting for the hash.
  for (const std::string phase : {"host-images", "dump", "host-images-hash"}) {
    SCOPED_TRACE(phase);
    TempDir dir;
    Workload source = preloaded_workload(dir);
    // The capture in a process of its own, killed there; the guardian outlives it.
    pid_t capture = ::fork();
    if (capture == 0) {
      KillAt reporter(phase);
      capture_in_this_process(dir, source, reporter);  // the phase never came
    }
    int status = 0;
    ASSERT_EQ(::waitpid(capture, &status, 0), capture);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;

    // The guardian removes the staging directory and takes back any request: nothing visible.
    auto staging_left = [&] {
      for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
        if (e.path().filename().string().rfind(".snap.staging-", 0) == 0) return true;
      }
      return false;
    };
    EXPECT_TRUE(eventually([&] { return !staging_left(); }));
    EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
    std::error_code ec;
    EXPECT_TRUE(!std::filesystem::exists(dir / "run" / "preload") ||
                std::filesystem::is_empty(dir / "run" / "preload", ec));
    // The workload keeps the driver's bytes (what the driver's restore reads back), now from a
    // file that is in no artifact, and works on.
    const auto region = host_image_mapping(source.pid());
    ASSERT_TRUE(region.has_value());
    EXPECT_NE(region->path.find("(deleted)"), std::string::npos) << region->path;
    EXPECT_EQ(StagingDriver::check_region(source.pid(), region->start, kLibraryRegion), "ok");
    EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
  }
}

// Stops its own process (SIGKILL) `delay` after the phase named starts.
class KillDuring final : public Reporter {
 public:
  KillDuring(std::string phase, std::chrono::microseconds delay)
      : phase_(std::move(phase)), delay_(delay) {}
  void phase_started(std::string_view name) override {
    if (name != phase_) return;
    std::thread([delay = delay_] {
      std::this_thread::sleep_for(delay);
      ::raise(SIGKILL);
    }).detach();
  }
  void phase_finished(std::string_view, double) override {}
  void note(std::string_view) override {}

 private:
  std::string phase_;
  std::chrono::microseconds delay_;
};

// The moment that used to be unguarded: gpusnap killed while the region is being made private
// (it stopped a thread of the workload with ptrace then, and a kill left that thread broken).
// Kills spread over the `host-images` phase, from its start to past its end.
TEST(HostImages, ACaptureKilledWhileTheRegionIsMadePrivateLeavesTheWorkloadWorking) {
  SKIP_WITHOUT_CRIU();
  if (::geteuid() != 0) GTEST_SKIP() << "skipped: needs root";
  int killed = 0;
  for (int delay_us : {0, 100, 300, 600, 1000, 2000, 4000, 8000}) {
    SCOPED_TRACE("kill " + std::to_string(delay_us) + " us into host-images");
    TempDir dir;
    Workload source = preloaded_workload(dir);
    pid_t capture = ::fork();
    if (capture == 0) {
      KillDuring reporter("host-images", std::chrono::microseconds(delay_us));
      capture_in_this_process(dir, source, reporter);  // finished (or failed) before the kill
    }
    int status = 0;
    ASSERT_EQ(::waitpid(capture, &status, 0), capture);
    const bool was_killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    if (was_killed) ++killed;
    // Whatever the moment: nothing half-made visible, no watcher left waiting in the workload,
    // and the workload holds the driver's bytes and answers.
    EXPECT_TRUE(eventually([&] {
      for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
        if (e.path().filename().string().rfind(".snap.staging-", 0) == 0) return false;
      }
      return true;
    }));
    if (was_killed) {
      EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
    }
    EXPECT_TRUE(eventually(
        [&] { return !engine::has_thread_named(source.pid(), engine::kRemapThreadName); }));
    const auto region = host_image_mapping(source.pid());
    ASSERT_TRUE(region.has_value());
    EXPECT_EQ(StagingDriver::check_region(source.pid(), region->start, kLibraryRegion), "ok");
    EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
  }
  std::printf("host images: %d of 8 captures killed during or after the remap's phase\n", killed);
  EXPECT_GE(killed, 4) << "the kills did not reach the phase";
}

// Real tmpfs mounts: the check behind the note that recommends a huge-page artifact store.
TEST(HostImageStore, ATmpfsWithoutHugePagesIsToldApartFromOneWith) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  auto small = dir / "small", huge = dir / "huge", plain = dir / "plain";
  for (const auto& d : {small, huge, plain}) std::filesystem::create_directories(d);
  ASSERT_EQ(::mount("gpusnap-test", small.c_str(), "tmpfs", 0, "size=4m"), 0);
  ASSERT_EQ(::mount("gpusnap-test", huge.c_str(), "tmpfs", 0, "size=4m,huge=within_size"), 0);
  std::filesystem::create_directories(huge / "nested");
  EXPECT_TRUE(engine::on_tmpfs_without_huge_pages(small));
  EXPECT_FALSE(engine::on_tmpfs_without_huge_pages(huge / "nested"));
  // Not a tmpfs at all (where the test's own directory is not one): no note.
  struct statfs st {};
  ASSERT_EQ(::statfs(plain.c_str(), &st), 0);
  if (st.f_type != TMPFS_MAGIC) {
    EXPECT_FALSE(engine::on_tmpfs_without_huge_pages(plain));
  }
  ::umount2(small.c_str(), MNT_DETACH);
  ::umount2(huge.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace gpusnap::testing
