// Restore overlapping its pull (store/stream.h), in-process, on a GPU-shaped snapshot: the real
// test workload captured with real CRIU and host images (StagingDriver plays the driver, no GPU
// here), pushed to a real docker-registry, then restored from the registry while its host
// images still arrive. The transfer is slowed (--max-rate) so that "still arrive" is certain.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/restore.h"
#include "store/plain_artifact.h"
#include "store/registry_fixture.h"
#include "store/stream.h"
#include "store/transfer.h"
#include "testing/harness.h"
#include "testing/staging_driver.h"

namespace gpusnap::testing {
namespace {

namespace sfs = std::filesystem;
constexpr const char* kGpu = "GPU-0a0a0a0a-1111-2222-3333-444444444444";

// The phases a restore started, and the pull's last progress at the start of criu-restore.
class Watch final : public Reporter {
 public:
  explicit Watch(gpu::FakeDriver& fake, pid_t source) : fake_(fake), source_(source) {}
  void phase_started(std::string_view name) override {
    names.emplace_back(name);
    if (name == "criu-restore") fetched_at_criu_restore = fetched.load();
    // The copies' processes become known to the driver when its restore would first see them.
    if (name != "gpu-restore") return;
    committed_at_gpu_restore = !committed_path.empty() && sfs::exists(committed_path);
    for (pid_t host : copies_of(source_)) {
      fake_.add_process(host, gpu::ProcessState::kCheckpointed);
      fake_.set_usage(host, kGpu, kRegion);
    }
  }
  std::vector<std::string> names;
  std::atomic<uint64_t> fetched{0};
  uint64_t fetched_at_criu_restore = 0;
  sfs::path committed_path;  // the pull's output: there once it committed
  bool committed_at_gpu_restore = false;

 private:
  gpu::FakeDriver& fake_;
  pid_t source_;
};

// The pull's progress, from its thread.
class PullProgress final : public Reporter {
 public:
  explicit PullProgress(Watch& watch) : watch_(watch) {}
  void progress(std::string_view, uint64_t done, uint64_t total) override {
    watch_.fetched = done;
    total_ = total;
  }
  std::atomic<uint64_t> total_{0};

 private:
  Watch& watch_;
};

struct Fixture {
  TempDir dir;
  Workload source{dir, {"--mib", "8"}};
  gpu::FakeDriver fake;
  StagingDriver driver{fake};
  std::optional<LocalRegistry> registry;
  std::string ref;

  Fixture() {
    fake.add_gpu(gpu::FakeDriver::make_gpu(kGpu));
    fake.add_process(source.pid());
    fake.set_usage(source.pid(), kGpu, kRegion);
    CheckpointOptions co = capture_options(dir, source, driver);
    co.leave_running = true;
    Reporter quiet;
    checkpoint(co, quiet);
    registry.emplace(dir, LocalRegistry::Options{});
    ref = registry->ref("gpu/snap:v1");
    store::TransferOptions to;
    to.registry.plain_http = true;
    store::push(dir / "snap", store::OciRef::parse(ref), to, quiet);
  }

  store::PullOptions pull_options() const {
    store::PullOptions o;
    o.transfer.registry.plain_http = true;
    o.transfer.registry.max_rate = 48ull << 20;  // ~3 s for the host image's 144 MiB
    o.transfer.jobs = 2;
    o.output = dir / "pulled";
    o.cache = dir / "cache";
    return o;
  }

  RestoreOptions restore_options(ArrivingArtifact& arriving) {
    RestoreOptions ro;
    ro.arriving = &arriving;
    ro.driver = &driver;
    ro.helper_binary = gpusnap_bin();
    ro.run_dir = dir / "run";
    ro.timeout = std::chrono::seconds(60);
    ro.publish = {PortPublish::parse(std::to_string(source.port()))};
    return ro;
  }
};

TEST(StoreOverlap, CriuRestoresWhileTheHostImagesArriveAndTheCopyHasEveryByte) {
  SKIP_WITHOUT_CRIU();
  GPUSNAP_SKIP_IF_BLOCKED(LocalRegistry::blocker());
  Fixture f;
  ASSERT_EQ(Artifact::open(f.dir / "snap").manifest().host_images.size(), 1u);
  Watch watch(f.fake, f.source.pid());
  watch.committed_path = f.dir / "pulled";
  PullProgress progress(watch);
  store::StreamingPull pull(store::OciRef::parse(f.ref), f.pull_options(), progress);
  RestoreResult r = restore(f.restore_options(pull), watch);
  Copies reaper{r.copies};

  // CRIU's restore began with most of the GPU memory still on its way.
  EXPECT_GT(progress.total_.load(), kRegion / 2);
  EXPECT_LT(watch.fetched_at_criu_restore, progress.total_.load() / 2)
      << ::testing::PrintToString(watch.names);
  // The driver's restore comes once every file but the tier's drain files is there (this
  // snapshot has none), before the pull commits.
  const auto at = [&](const char* phase) {
    return std::find(watch.names.begin(), watch.names.end(), phase) - watch.names.begin();
  };
  const std::vector<const char*> order = {"await-criu-images", "criu-restore",
                                          "await-host-images", "verify",
                                          "gpu-restore",       "await-artifact"};
  for (size_t i = 0; i < order.size(); ++i) {
    EXPECT_LT(at(order[i]), static_cast<ptrdiff_t>(watch.names.size())) << order[i];
    if (i > 0) {
      EXPECT_LT(at(order[i - 1]), at(order[i])) << order[i];
    }
  }
  EXPECT_FALSE(watch.committed_at_gpu_restore) << "the driver waited for the pull's commit";
  // The driver's restore found every byte of the region in the copy, the copy serves, and the
  // artifact is committed under its name, exactly as captured.
  // (The source's own, from the capture's gpu-resume, and the copy's.)
  const auto outcomes = f.driver.outcomes();
  ASSERT_EQ(outcomes.size(), 2u);
  for (const auto& [pid, outcome] : outcomes) EXPECT_EQ(outcome, "ok") << "pid " << pid;
  ASSERT_EQ(r.copies.size(), 1u);
  EXPECT_EQ(ask(r.copies[0].ports[0].host_port, "CHECK").substr(0, 2), "OK");
  EXPECT_TRUE(Artifact::open(f.dir / "pulled").verify().empty());
  EXPECT_EQ(pull.result().chunks_from_cache, 0u);
}

// The wait before the driver's restore leaves out the tier's drain files, the bulk of a tier
// snapshot, which only the tier's fill reads: they go on arriving after it returns.
TEST(StoreOverlap, TheHostImagesAreAwaitedWithoutTheTiersDrainFiles) {
  GPUSNAP_SKIP_IF_BLOCKED(LocalRegistry::blocker());
  TempDir dir;
  const sfs::path art = dir / "snap";
  std::mt19937_64 random(7);
  const auto noise = [&](uint64_t bytes) {
    std::string s(bytes, '\0');
    for (size_t i = 0; i + 8 <= s.size(); i += 8) {
      const uint64_t v = random();
      std::memcpy(s.data() + i, &v, 8);
    }
    return s;
  };
  sfs::create_directories(art / "criu");
  sfs::create_directories(art / "host-images");
  sfs::create_directories(art / "tier");
  fs::write_file(art / "criu" / "pages-1.img", noise(1 << 20));
  fs::write_file(art / "host-images" / "7-0.img", noise(2 << 20));
  fs::write_file(art / "tier" / "7.json", "{}");
  const std::string drain = "tier/7-w0.img";
  fs::write_file(art / drain, noise(48 << 20));  // ~3 s at the rate below
  write_plain_manifest(art);
  LocalRegistry registry(dir, {});
  const std::string ref = registry.ref("tier/snap:v1");
  store::TransferOptions to;
  to.registry.plain_http = true;
  Reporter quiet;
  store::push(art, store::OciRef::parse(ref), to, quiet);

  store::PullOptions o;
  o.transfer.registry.plain_http = true;
  o.transfer.registry.max_rate = 16ull << 20;
  o.transfer.jobs = 2;
  o.output = dir / "pulled";
  o.cache = dir / "cache";
  store::StreamingPull pull(store::OciRef::parse(ref), o, quiet);
  pull.await_host_images();
  std::map<std::string, uint64_t> written;
  std::mutex mu;
  pull.watch([&](const std::string& path, uint64_t bytes) {
    std::lock_guard lock(mu);
    written[path] = bytes;
  });
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(written["host-images/7-0.img"], 2u << 20);
    EXPECT_EQ(written["criu/pages-1.img"], 1u << 20);
    EXPECT_LT(written[drain], 48u << 20) << "the wait took the drain file too";
  }
  const sfs::path done = pull.complete();
  EXPECT_TRUE(Artifact::open(done).verify().empty());
}

TEST(StoreOverlap, ACorruptHostImageChunkRefusesTheRestoreAndLeavesNoCopy) {
  SKIP_WITHOUT_CRIU();
  GPUSNAP_SKIP_IF_BLOCKED(LocalRegistry::blocker());
  Fixture f;
  // The host image's last chunk, damaged in the registry's storage: it arrives after CRIU's
  // restore has begun.
  store::TransferOptions to;
  to.registry.plain_http = true;
  const auto snap = store::read_remote(store::OciRef::parse(f.ref), to);
  std::string victim;
  for (const auto& file : snap.layout.files) {
    if (file.path.starts_with("host-images/")) victim = file.extents.back().digest;
  }
  ASSERT_FALSE(victim.empty());
  {
    std::fstream blob(f.registry->blob_data(victim),
                      std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(blob.good());
    blob.seekp(4096);
    blob.put('\x5a');
  }

  Watch watch(f.fake, f.source.pid());
  PullProgress progress(watch);
  std::optional<Error> failure;
  {
    store::StreamingPull pull(store::OciRef::parse(f.ref), f.pull_options(), progress);
    try {
      restore(f.restore_options(pull), watch);
    } catch (const Error& e) {
      failure = e;
    }
  }
  ASSERT_TRUE(failure.has_value()) << "the restore went on";
  EXPECT_EQ(failure->kind(), ErrorKind::kBadArtifact) << failure->what();
  EXPECT_NE(std::string(failure->what()).find(victim + " from registry"), std::string::npos)
      << failure->what();
  // The copy was started (CRIU restored it) and is gone; the GPU state never reached it; nothing
  // of the pull is at its path or in a staging directory beside it.
  EXPECT_NE(std::find(watch.names.begin(), watch.names.end(), "criu-restore"), watch.names.end());
  EXPECT_TRUE(
      eventually([&] { return copies_of(f.source.pid()).empty(); }, std::chrono::seconds(10)));
  EXPECT_EQ(f.driver.outcomes().size(), 1u) << "the driver restored more than the source";
  EXPECT_FALSE(sfs::exists(f.dir / "pulled"));
  for (const auto& e : sfs::directory_iterator(f.dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".pulled"), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace gpusnap::testing
