// Host images end to end on the real test workload with real CRIU: the GPU memory that the
// driver's checkpoint leaves in host memory is stored by gpusnap (not by CRIU), mapped back in
// the source and in every copy, byte for byte.
//
// No GPU here, so StagingDriver plays the part of the driver that matters: on checkpoint it
// maps a new private anonymous region in the process and fills it with "GPU contents" (what
// the real driver does, measured on the H200: docs/design.md), on restore it reads the region
// back from the process, checks every byte and unmaps it. The state machine is FakeDriver's.
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>

#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "common/proc.h"
#include "common/remote.h"
#include "engine/host_images.h"
#include "gpu/fake_driver.h"
#include "gpusnap/artifact.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/restore.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

using gpu::FakeDriver;
using gpu::ProcessState;

constexpr const char* kGpu = "GPU-0a0a0a0a-1111-2222-3333-444444444444";
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kRegion = 192 * kMiB;
constexpr uint64_t kHugePage = 2 * kMiB;
// Where the real driver's region started within a 2 MiB page on the H200 (0x7f7ab85db000):
// not on a boundary, which gpusnap's files must make up for.
constexpr uint64_t kRegionSkew = 0x1db000;

// The word at `index` of the region: every fourth 4 MiB block is zero (a hole in the image;
// blocks this large stay holes even where the file system caches files in large folios).
uint64_t word_at(uint64_t index) {
  if ((index * 8 / (4 * kMiB)) % 4 == 3) return 0;
  uint64_t z = index + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 27);
}

class StagingDriver final : public gpu::Driver {
 public:
  explicit StagingDriver(FakeDriver& fake) : fake_(fake) {}

  bool available() const override { return fake_.available(); }
  std::string reason() const override { return fake_.reason(); }
  gpu::DriverFacts facts() override { return fake_.facts(); }
  std::vector<gpu::ProcessGpuUsage> usage() override { return fake_.usage(); }
  bool uses_gpu(pid_t pid) override { return fake_.uses_gpu(pid); }
  ProcessState state(pid_t pid) override { return fake_.state(pid); }
  void lock(pid_t pid, std::chrono::milliseconds t) override { fake_.lock(pid, t); }
  void unlock(pid_t pid) override { fake_.unlock(pid); }

  void checkpoint(pid_t pid) override {
    fake_.checkpoint(pid);
    RemoteThread thread(pid);
    // A region that starts kRegionSkew past a 2 MiB boundary, as the driver's did.
    long room = thread.syscall(SYS_mmap, 0, kRegion + 2 * kHugePage, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS, static_cast<uint64_t>(-1), 0);
    ASSERT_GT(room, 0);
    uint64_t base = static_cast<uint64_t>(room);
    uint64_t start = (base + kHugePage - 1) / kHugePage * kHugePage + kRegionSkew;
    if (start > base) thread.syscall(SYS_munmap, base, start - base);
    thread.syscall(SYS_munmap, start + kRegion, base + kRegion + 2 * kHugePage - start - kRegion);
    long at = static_cast<long>(start);
    std::vector<uint64_t> words(kMiB / 8);
    for (uint64_t off = 0; off < kRegion; off += kMiB) {
      for (uint64_t i = 0; i < words.size(); ++i) words[i] = word_at(off / 8 + i);
      thread.write_memory(static_cast<uint64_t>(at) + off, words.data(), kMiB);
    }
    std::lock_guard<std::mutex> g(mutex_);
    region_ = static_cast<uint64_t>(at);
  }

  void restore(pid_t pid, const std::vector<gpu::GpuPair>& pairs) override {
    uint64_t region;
    {
      std::lock_guard<std::mutex> g(mutex_);
      region = region_;  // a copy has the source's address space layout
    }
    std::string outcome = check_region(pid, region);
    {
      RemoteThread thread(pid);
      thread.syscall(SYS_munmap, region, kRegion);
    }
    std::lock_guard<std::mutex> g(mutex_);
    outcomes_[pid] = outcome;
    fake_.restore(pid, pairs);
  }

  std::map<pid_t, std::string> outcomes() const {
    std::lock_guard<std::mutex> g(mutex_);
    return outcomes_;
  }

 private:
  // "ok", or what differs.
  static std::string check_region(pid_t pid, uint64_t region) {
    std::vector<uint64_t> words(kMiB / 8);
    for (uint64_t off = 0; off < kRegion; off += kMiB) {
      iovec local{words.data(), kMiB};
      iovec remote{reinterpret_cast<void*>(region + off), kMiB};
      if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(kMiB)) {
        return "cannot read the region at offset " + std::to_string(off);
      }
      for (uint64_t i = 0; i < words.size(); ++i) {
        if (words[i] != word_at(off / 8 + i)) {
          return "byte " + std::to_string(off + i * 8) + " differs";
        }
      }
    }
    return "ok";
  }

  FakeDriver& fake_;
  mutable std::mutex mutex_;
  uint64_t region_ = 0;
  std::map<pid_t, std::string> outcomes_;
};

// Sum of the sizes of CRIU's page images.
uint64_t criu_page_bytes(const std::filesystem::path& artifact) {
  uint64_t total = 0;
  for (const auto& e : std::filesystem::directory_iterator(artifact / kCriuImageDir)) {
    if (e.path().filename().string().rfind("pages-", 0) == 0) total += e.file_size();
  }
  return total;
}

// Copies' processes: host pid of every process one PID namespace down whose inner pid is `ns`.
std::vector<pid_t> copies_of(pid_t ns) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    pid_t pid = std::atoi(e.path().filename().c_str());
    if (pid <= 0) continue;
    try {
      auto p = proc::read_process(pid);
      if (p.nspid.size() == 2 && p.nspid[1] == ns && p.state != 'Z') out.push_back(pid);
    } catch (const std::exception&) {
    }
  }
  return out;
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
};

// Checkpoint (leaving the source running) and restore two copies, all through StagingDriver.
CaptureRun checkpoint_and_restore(const TempDir& dir, Workload& source, bool host_images,
                                  uint64_t file_bytes = 0) {
  FakeDriver fake;
  fake.add_gpu(FakeDriver::make_gpu(kGpu));
  fake.add_process(source.pid());
  fake.set_usage(source.pid(), kGpu, kRegion);
  StagingDriver driver(fake);

  CheckpointOptions co;
  co.pid = source.pid();
  co.output = dir / "snap";
  co.driver = &driver;
  co.helper_binary = gpusnap_bin();
  co.run_dir = dir / "run";
  co.leave_running = true;
  co.host_images = host_images;
  co.host_image_file_bytes = file_bytes;
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
  return run;
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

  // The driver found the exact bytes in the source (gpu-resume) and in both copies.
  ASSERT_EQ(run.outcomes.size(), 3u);
  for (const auto& [pid, outcome] : run.outcomes) EXPECT_EQ(outcome, "ok") << "pid " << pid;
  EXPECT_EQ(run.outcomes.count(source.pid()), 1u);

  // The workload itself is intact everywhere, and the artifact verifies: the checksums recorded
  // for the host images while they were copied are those of the files' bytes.
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
  ASSERT_EQ(run.restore.copies.size(), 2u);
  for (const auto& c : run.restore.copies) {
    EXPECT_EQ(ask(c.ports[0].host_port, "CHECK").substr(0, 2), "OK");
  }
  EXPECT_TRUE(Artifact::open(dir / "snap").verify().empty());
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
