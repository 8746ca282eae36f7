// Containers, with real runc containers: a busybox root filesystem made here holds the test
// workload (and its libraries); the built gpusnap is bind-mounted read-only at /bin/gpusnap.
// The source container runs `gpusnap init -- gpusnap-test-workload ...`; it is captured, and
// the snapshot is restored into a second container started as `gpusnap init --placeholder`.
// The workload proves from inside the placeholder's network namespace that its memory came
// from the snapshot, while the source keeps serving.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "engine/python_site.h"
#include "gpu/fake_driver.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/restore.h"
#include "testing/containers.h"
#include "testing/harness.h"
#include "testing/staging_driver.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
namespace stdfs = std::filesystem;

// Phase names and notes of an in-process capture or restore.
class Recorder final : public Reporter {
 public:
  std::vector<std::string> names, notes;
  std::function<void(std::string_view)> on_start;
  void phase_started(std::string_view name) override {
    names.emplace_back(name);
    if (on_start) on_start(name);
  }
  void phase_finished(std::string_view, double) override {}
  void note(std::string_view text) override { notes.emplace_back(text); }
};

// The GPU of the tests whose driver's part StagingDriver plays (testing/staging_driver.h).
constexpr const char* kStagedGpu = "GPU-0a0a0a0a-1111-2222-3333-444444444444";

class ContainerTest : public ::testing::Test {
 protected:
  stdfs::path bundle(const std::string& name, const std::vector<std::string>& args) {
    return make_bundle(dir_ / name, args);
  }
  std::unique_ptr<Container> start(const std::string& id, const stdfs::path& bundle) {
    auto c = std::make_unique<Container>(runtime_root(), prefix_ + id, bundle);
    EXPECT_TRUE(c->started()) << "runc run " << id;
    return c;
  }
  std::string runtime_root() const { return (dir_ / "runc").string(); }
  std::vector<std::string> runc_flags(const std::string& flag, const Container& c) const {
    return {flag, c.id(), "--runtime-root", runtime_root()};
  }
  CliResult checkpoint(const Container& c, const stdfs::path& out) {
    auto args = runc_flags("--container", c);
    args.insert(args.begin(), "checkpoint");
    for (const auto& a : {"-o", out.c_str(), "--leave-running", "--json"}) args.push_back(a);
    return gpusnap(args);
  }
  CliResult restore(const stdfs::path& snap, const Container& c) {
    auto args = runc_flags("--into-container", c);
    args.insert(args.begin(), {"restore", snap.string()});
    for (const auto& a :
         {std::string("--run-dir"), (dir_ / "run").string(), std::string("--json")}) {
      args.push_back(a);
    }
    return gpusnap(args);
  }
  // The message of a --json error document.
  static std::string error_message(const CliResult& r) {
    try {
      return json::parse(r.out).at("error").at("message").get<std::string>();
    } catch (const json::exception&) {
      return "(no JSON error: " + r.out + r.err + ")";
    }
  }
  std::string describe(const Container& c) const {
    return "container " + c.id() + " (runc root " + runtime_root() + ")";
  }

  // Restores `snap` in-process into `placeholder` through the capture's StagingDriver; the
  // copy's process becomes known to `fake` (checkpointed, `bytes` of kStagedGpu) when the
  // driver's restore would first see it. Returns that process (0: the restore never got there).
  pid_t restore_through(const stdfs::path& snap, const Container& placeholder, gpu::Driver& driver,
                        gpu::FakeDriver& fake, uint64_t bytes) {
    RestoreOptions ro;
    ro.artifact = snap;
    ro.driver = &driver;
    ro.helper_binary = gpusnap_bin();
    ro.run_dir = dir_ / "run";
    ro.timeout = std::chrono::seconds(60);
    ro.into_container = ContainerRef{placeholder.id(), runtime_root()};
    Recorder phases;
    pid_t restored = 0;
    phases.on_start = [&](std::string_view phase) {
      if (phase != "gpu-restore") return;
      const auto kids = proc::children(placeholder.pid());
      ASSERT_EQ(kids.size(), 1u);
      restored = kids.front();
      fake.add_process(restored, gpu::ProcessState::kCheckpointed);
      fake.set_usage(restored, kStagedGpu, bytes);
    };
    gpusnap::restore(ro, phases);
    return restored;
  }

  TempDir dir_;
  // Container ids are global to the runtime root; a prefix keeps a rerun clear of leftovers.
  std::string prefix_ = "gpusnap-test-" + fs::random_id().substr(0, 6) + "-";
};

TEST_F(ContainerTest, CaptureRestoresIntoAPlaceholderWhileTheSourceRuns) {
  SKIP_WITHOUT_RUNC();
  auto source = start("source", bundle("source", shimmed_workload()));
  ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }))
      << "the workload did not answer in its container";
  ASSERT_EQ(ask_in(source->pid(), "INCR"), "1");
  auto info = ask_in(source->pid(), "INFO");
  std::string seed = field(info, "seed");
  ASSERT_FALSE(seed.empty()) << info;

  // `gpusnap init` started the workload with the preload library found beside it (/bin here,
  // as /opt/gpusnap/bin on a node).
  auto source_tree = proc::read_tree(source->pid());
  ASSERT_GE(source_tree.size(), 2u);
  EXPECT_TRUE(maps_file(source_tree[1].pid, "libgpusnap-preload.so"));

  auto snap = dir_ / "snap";
  auto cp = checkpoint(*source, snap);
  ASSERT_EQ(cp.exit_code, 0) << cp.out << cp.err;
  auto cp_doc = json::parse(cp.out);
  EXPECT_EQ(cp_doc.at("container"), source->id());
  EXPECT_EQ(cp_doc.at("processes").get<int>(), 2);  // the workload and its child, not the shim
  // The manifest speaks of the container's pids and of the files the workload maps.
  auto manifest = json::parse(fs::read_file(snap / "manifest.json"));
  EXPECT_EQ(std::to_string(manifest.at("processes")[0].at("pid").get<int>()), field(info, "pid"));
  EXPECT_EQ(manifest.at("processes")[0].at("ppid").get<int>(), 1);
  EXPECT_EQ(manifest.at("container").at("id"), source->id());
  bool has_workload = false;
  for (const auto& f : manifest.at("container").at("rootfs_files")) {
    has_workload |= f.at("path") == "/bin/gpusnap-test-workload";
  }
  EXPECT_TRUE(has_workload) << manifest.at("container").dump();

  auto placeholder = start("placeholder", bundle("placeholder", placeholder_args()));
  auto rs = restore(snap, *placeholder);
  ASSERT_EQ(rs.exit_code, 0) << rs.out << rs.err;
  // The restored workload lives in the placeholder's namespaces, as the placeholder's child.
  auto restored = restored_into(rs.out, placeholder->pid());
  // CRIU mapped the library again, from the placeholder's /bin.
  EXPECT_TRUE(maps_file(restored, "libgpusnap-preload.so"));

  auto copy_info = ask_in(placeholder->pid(), "INFO");
  EXPECT_EQ(field(copy_info, "seed"), seed) << "memory did not come from the snapshot";
  EXPECT_EQ(field(copy_info, "pid"), field(info, "pid"));
  EXPECT_EQ(ask_in(placeholder->pid(), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask_in(placeholder->pid(), "INCR"), "2");  // from the snapshot's 1, on its own

  EXPECT_EQ(ask_in(source->pid(), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask_in(source->pid(), "INCR"), "2");

  // The placeholder passes SIGTERM on to the restored workload, which exits 0, and the
  // container ends with it.
  ASSERT_EQ(::kill(placeholder->pid(), SIGTERM), 0);
  EXPECT_TRUE(eventually([&] { return placeholder->state().value("status", "") == "stopped"; }));
  EXPECT_EQ(source->state().value("status", ""), "running");
}

TEST_F(ContainerTest, RefusesWhatItCannotCaptureOrRestoreInto) {
  SKIP_WITHOUT_RUNC();
  auto source = start("source", bundle("source", shimmed_workload()));
  auto placeholder = start("placeholder", bundle("placeholder", placeholder_args()));
  ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }));

  // No such container.
  auto missing = gpusnap({"checkpoint", "--container", prefix_ + "nosuch", "--runtime-root",
                          runtime_root(), "-o", (dir_ / "x").string(), "--json"});
  EXPECT_EQ(missing.exit_code, 3);
  EXPECT_EQ(error_message(missing),
            "container " + prefix_ + "nosuch (runc root " + runtime_root() + ") does not exist");
  // A container whose PID 1 is not the shim.
  auto not_shim = checkpoint(*placeholder, dir_ / "x");
  EXPECT_EQ(not_shim.exit_code, 6);
  EXPECT_EQ(error_message(not_shim), describe(*placeholder) + ": its PID 1 (pid " +
                                         std::to_string(placeholder->pid()) +
                                         ") is not the gpusnap shim");
  EXPECT_FALSE(stdfs::exists(dir_ / "x"));

  auto snap = dir_ / "snap";
  ASSERT_EQ(checkpoint(*source, snap).exit_code, 0);
  // A target that is not a placeholder.
  auto not_placeholder = restore(snap, *source);
  EXPECT_EQ(not_placeholder.exit_code, 2);
  EXPECT_EQ(error_message(not_placeholder), describe(*source) + ": its PID 1 (pid " +
                                                std::to_string(source->pid()) +
                                                ") is not a gpusnap placeholder");
  // A snapshot of a host process tree.
  Workload host(dir_, {"--mib", "4", "--children", "0"});
  auto host_snap = dir_ / "host-snap";
  ASSERT_EQ(gpusnap({"checkpoint", "--pid", std::to_string(host.pid()), "-o", host_snap.string(),
                     "--leave-running"})
                .exit_code,
            0);
  auto host_id = json::parse(fs::read_file(host_snap / "manifest.json")).at("id");
  auto not_container = restore(host_snap, *placeholder);
  EXPECT_EQ(not_container.exit_code, 2);
  EXPECT_EQ(error_message(not_container),
            "artifact " + host_id.get<std::string>() + " was not captured from a container");
  // A placeholder from another image: its workload binary differs.
  auto other = bundle("other", placeholder_args());
  std::ofstream(other / "rootfs/bin/gpusnap-test-workload", std::ios::app) << "x";
  auto other_placeholder = start("other", other);
  auto mismatch = restore(snap, *other_placeholder);
  EXPECT_EQ(mismatch.exit_code, 5);
  auto size = stdfs::file_size(build_path("tests/gpusnap-test-workload"));
  EXPECT_EQ(error_message(mismatch),
            describe(*other_placeholder) +
                "'s root filesystem differs from the captured container's: it has another "
                "/bin/gpusnap-test-workload (" +
                std::to_string(size + 1) + " bytes, captured " + std::to_string(size) + ")");
  EXPECT_TRUE(proc::children(other_placeholder->pid()).empty());
  // Same size, another build: executables and libraries are told apart by their build-id.
  auto rebuilt = bundle("rebuilt", placeholder_args());
  {
    const auto binary = rebuilt / "rootfs/bin/gpusnap-test-workload";
    std::string bytes = fs::read_file(binary);
    const std::string header("\x04\0\0\0\x14\0\0\0\x03\0\0\0GNU\0", 16);
    const auto at = bytes.find(header);
    ASSERT_NE(at, std::string::npos) << "no GNU build-id note in the test workload";
    bytes[at + header.size()] ^= 1;
    std::ofstream(binary, std::ios::binary | std::ios::trunc) << bytes;
  }
  auto rebuilt_placeholder = start("rebuilt", rebuilt);
  auto other_build = restore(snap, *rebuilt_placeholder);
  EXPECT_EQ(other_build.exit_code, 5);
  EXPECT_EQ(error_message(other_build),
            describe(*rebuilt_placeholder) +
                "'s root filesystem differs from the captured container's: it has another "
                "/bin/gpusnap-test-workload (same size, other build-id)");

  // Every refusal left the placeholder waiting: it takes the snapshot now, and only once.
  ASSERT_EQ(restore(snap, *placeholder).exit_code, 0);
  EXPECT_EQ(field(ask_in(placeholder->pid(), "CHECK"), "seed"),
            field(ask_in(source->pid(), "CHECK"), "seed"));
  auto busy = restore(snap, *placeholder);
  EXPECT_EQ(busy.exit_code, 2);
  EXPECT_EQ(error_message(busy), describe(*placeholder) +
                                     ": the placeholder is not waiting, it already runs a "
                                     "restored workload");
  EXPECT_EQ(source->state().value("status", ""), "running");
}

TEST_F(ContainerTest, HandshakeWorkloadPausesAndResumesInThePlaceholderWithItsContext) {
  SKIP_WITHOUT_RUNC();
  auto source = start(
      "source", bundle("source", {"/bin/gpusnap", "init", "--", "/bin/handshake-worker", "--port",
                                  std::to_string(kContainerPort), "--cache-mib", "64"}));
  ASSERT_TRUE(
      eventually([&] { return !field(ask_in(source->pid(), "INFO"), "restored").empty(); }));
  ASSERT_EQ(ask_in(source->pid(), "INCR"), "1");

  auto snap = dir_ / "snap";
  auto cp = checkpoint(*source, snap);
  ASSERT_EQ(cp.exit_code, 0) << cp.out << cp.err;
  EXPECT_TRUE(json::parse(cp.out).at("handshake").get<bool>());
  // The manifest names the directory as the workload does, in its own root.
  auto manifest = json::parse(fs::read_file(snap / "manifest.json"));
  EXPECT_EQ(manifest.at("handshake").at("control_dir"), "/control");
  // The source was paused for the capture and resumed as itself, its cache back.
  auto info = ask_in(source->pid(), "INFO");
  EXPECT_EQ(field(info, "restored"), "0") << info;
  EXPECT_EQ(field(info, "cache_mib"), "64") << info;

  auto placeholder = start("placeholder", bundle("placeholder", placeholder_args()));
  auto args = runc_flags("--into-container", *placeholder);
  args.insert(args.begin(), {"restore", snap.string(), "--set", "greeting=hello", "--run-dir",
                             (dir_ / "run").string(), "--json"});
  auto rs = gpusnap(args);
  ASSERT_EQ(rs.exit_code, 0) << rs.out << rs.err;
  EXPECT_TRUE(json::parse(rs.out).at("handshake").get<bool>());
  // RESUMED came before restore returned: the copy serves with its own context at once.
  auto copy_info = ask_in(placeholder->pid(), "INFO");
  EXPECT_EQ(field(copy_info, "restored"), "1") << copy_info;
  EXPECT_EQ(field(copy_info, "greeting"), "hello") << copy_info;
  EXPECT_EQ(field(copy_info, "cache_mib"), "64") << copy_info;
  EXPECT_EQ(ask_in(placeholder->pid(), "INCR"), "2");
  EXPECT_EQ(ask_in(source->pid(), "INCR"), "2");
}

// Whether `path` is a mount point in the mount namespace of process `pid`.
bool mounted_in(pid_t pid, const std::string& path) {
  std::ifstream mountinfo("/proc/" + std::to_string(pid) + "/mountinfo");
  for (std::string line; std::getline(mountinfo, line);) {
    std::istringstream in(line);
    std::string id, parent, dev, root, point;
    in >> id >> parent >> dev >> root >> point;
    if (point == path) return true;
  }
  return false;
}

// A workload with a memory tier in a container sees its own mounts only: gpusnap mounts the
// tier's folder into the container's handshake directory for the pause and the resume, and the
// artifact's tier folder into the placeholder's for the copy's resume; no volume of the
// container is at the host's path. The stand-in tier (tests/workload/tier_standin.py: host
// memory, files as libgpusnap-tier.so names them) drains and fills through those mounts.
TEST_F(ContainerTest, MemoryTierDrainsAndFillsThroughAMountInTheHandshakeDirectory) {
  SKIP_WITHOUT_RUNC();
  const std::string port = std::to_string(kContainerPort);
  auto source = start(
      "source", make_python_bundle(dir_ / "source",
                                   {kPythonBundleGpusnap, "init", "--", "/usr/bin/python3",
                                    "/tests/tier_standin.py", "--mib", "16", "--port", port}));
  ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "CHECK") == "OK"; }))
      << "the workload did not answer in its container";
  const std::string mount_point = "/control/.gpusnap-tier";

  auto snap = dir_ / "snap";
  auto cp = checkpoint(*source, snap);
  ASSERT_EQ(cp.exit_code, 0) << cp.out << cp.err;
  // The source drained into the mount and, running on, filled back from it.
  auto info = ask_in(source->pid(), "INFO");
  EXPECT_EQ(field(info, "drains"), "1") << info;
  EXPECT_EQ(field(info, "fills"), "1") << info;
  EXPECT_EQ(field(info, "tier_dir"), mount_point) << info;
  EXPECT_EQ(ask_in(source->pid(), "CHECK"), "OK");
  // Its files are the artifact's, listed and checksummed.
  const std::string pid = field(info, "pid");
  const std::string image = "tier/" + pid + "-w0.img";
  ASSERT_TRUE(stdfs::exists(snap / image)) << info;
  EXPECT_EQ(stdfs::file_size(snap / image), 16u << 20);
  bool listed = false;
  const json manifest = json::parse(fs::read_file(snap / "manifest.json"));  // the loop refers in
  for (const auto& f : manifest.at("files")) {
    listed |= f.at("path") == image;
  }
  EXPECT_TRUE(listed);
  // The mount went with the resume, and its mount point with it.
  const auto source_root = "/proc/" + std::to_string(source->pid()) + "/root";
  EXPECT_FALSE(mounted_in(source->pid(), mount_point));
  EXPECT_FALSE(stdfs::exists(source_root + mount_point));

  auto placeholder = start(
      "placeholder",
      make_python_bundle(dir_ / "placeholder", {kPythonBundleGpusnap, "init", "--placeholder"}));
  auto rs = restore(snap, *placeholder);
  ASSERT_EQ(rs.exit_code, 0) << rs.out << rs.err;
  restored_into(rs.out, placeholder->pid());
  // The copy filled from the artifact, through the mount, before it answered RESUMED.
  auto copy_info = ask_in(placeholder->pid(), "INFO");
  EXPECT_EQ(field(copy_info, "restored"), "1") << copy_info;
  EXPECT_EQ(field(copy_info, "tier_dir"), mount_point) << copy_info;
  EXPECT_EQ(field(copy_info, "fills"), "1") << copy_info;  // captured before the source's fill
  EXPECT_EQ(ask_in(placeholder->pid(), "CHECK"), "OK");
  EXPECT_FALSE(mounted_in(placeholder->pid(), mount_point));
  EXPECT_FALSE(
      stdfs::exists("/proc/" + std::to_string(placeholder->pid()) + "/root" + mount_point));
  EXPECT_EQ(ask_in(source->pid(), "CHECK"), "OK");
}

// `gpusnap init --memory-tier`: a Python workload in a container that speaks the handshake and
// never calls use_memory_tier() gets the tier at its `import torch` (PyTorch's stand-in here),
// through the site folder beside the container's gpusnap (/gpusnap/python, as a node's
// /opt/gpusnap/bin/python) and the real libgpusnap-tier.so beside the preload library; the
// container is then captured through the handshake. The GPU test of the same route outside a
// container is MemoryTier.GpusnapRunInstallsTheTierWithoutTheOneLine.
TEST_F(ContainerTest, InitWithMemoryTierInstallsTheTierWhenThePythonWorkloadImportsTorch) {
  SKIP_WITHOUT_RUNC();
  const auto data = dir_ / "data";
  stdfs::create_directories(data);
  const auto bundle_dir =
      make_python_bundle(dir_ / "source",
                         {kPythonBundleGpusnap, "init", "--memory-tier", "--", "/usr/bin/python3",
                          "/tests/tier_site_probe.py", "--report", "/data/report.json"},
                         false, data);
  // The stand-in on the container's own PYTHONPATH, after the tests folder's place in it.
  auto config = json::parse(fs::read_file(bundle_dir / "config.json"));
  for (auto& e : config["process"]["env"]) {
    if (e == "PYTHONPATH=/tests") e = "PYTHONPATH=/tests/torch_standin:/tests";
  }
  config["process"]["env"].push_back("TORCH_STANDIN_LOG=/data/torch.log");
  fs::write_file(bundle_dir / "config.json", config.dump(2));
  auto source = start("source", bundle_dir);
  const auto report_path = data / "report.json";
  ASSERT_TRUE(eventually([&] { return stdfs::exists(report_path); }))
      << "the workload wrote no report in its container";
  const json report = json::parse(fs::read_file(report_path));
  EXPECT_EQ(report["PYTHONPATH"], "/gpusnap/python:/tests/torch_standin:/tests");
  EXPECT_EQ(report["GPUSNAP_MEMORY_TIER"], "1");
  // Installed once, after torch's own code ran, with the library beside the preload library.
  EXPECT_EQ(report["torch_log"],
            json({"import-begin", "import-end",
                  "allocator /gpusnap/libgpusnap-tier.so tier_malloc tier_free",
                  "change_current_allocator"}));
  EXPECT_EQ(report["tier_path"], "/gpusnap/libgpusnap-tier.so");
  EXPECT_EQ(report["handshake_file"], "/gpusnap/python/gpusnap_handshake.py");

  auto cp = checkpoint(*source, dir_ / "snap");
  ASSERT_EQ(cp.exit_code, 0) << cp.out << cp.err;
  EXPECT_TRUE(json::parse(cp.out).at("handshake").get<bool>()) << cp.out;
}

// A CUDA process in a container: the driver's host copy of its GPU memory (played by
// StagingDriver, testing/staging_driver.h) goes into host images through a read-only mount of the
// staging folder in the container's /tmp, not through CRIU's pages, and the copy in the
// placeholder maps them back. Before, a process in another mount namespace could not open the
// files, and that memory went through CRIU's pages (16 GiB: 18.6 s of capture on the H200).
TEST_F(ContainerTest, HostImagesOfAContainersProcessGoThroughAMountInItsTmp) {
  SKIP_WITHOUT_RUNC();
  auto source = start("source", bundle("source", shimmed_workload()));
  ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }));
  const auto children = proc::children(source->pid());
  ASSERT_EQ(children.size(), 1u);
  const pid_t workload = children.front();
  gpu::FakeDriver fake;
  fake.add_gpu(gpu::FakeDriver::make_gpu(kStagedGpu));
  fake.add_process(workload);
  fake.set_usage(workload, kStagedGpu, kRegion);
  StagingDriver driver(fake);

  CheckpointOptions co;
  co.container = ContainerRef{source->id(), runtime_root()};
  co.output = dir_ / "snap";
  co.driver = &driver;
  co.helper_binary = gpusnap_bin();
  co.run_dir = dir_ / "run";
  co.leave_running = true;
  Recorder cp_phases;
  const CheckpointResult cp = gpusnap::checkpoint(co, cp_phases);  // not the fixture's
  const auto& images = cp.manifest.host_images;
  ASSERT_FALSE(images.empty()) << ::testing::PrintToString(cp_phases.notes);
  uint64_t imaged = 0;
  for (const auto& image : images) {
    EXPECT_TRUE(image.criu_key.rfind("file[", 0) == 0) << image.criu_key;
    imaged += image.end - image.start;
  }
  EXPECT_EQ(imaged, kRegion);
  uint64_t pages = 0;
  for (const auto& e : stdfs::directory_iterator(co.output / kCriuImageDir)) {
    if (e.path().filename().string().rfind("pages-", 0) == 0) pages += e.file_size();
  }
  EXPECT_LT(pages, 64 * kMiB) << "CRIU stored the region too";
  // The source got its memory back from the files (the driver's resume read every byte), and
  // the mount went with the capture.
  EXPECT_EQ(driver.outcomes()[workload], "ok");
  EXPECT_EQ(ask_in(source->pid(), "CHECK").substr(0, 2), "OK");
  EXPECT_FALSE(mounted_in(source->pid(), "/tmp/.gpusnap-host-images"));

  auto placeholder = start("placeholder", bundle("placeholder", placeholder_args()));
  const pid_t restored = restore_through(co.output, *placeholder, driver, fake, kRegion);
  ASSERT_NE(restored, 0);
  EXPECT_EQ(driver.outcomes()[restored], "ok");  // every byte, from the artifact's files
  EXPECT_EQ(ask_in(placeholder->pid(), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask_in(source->pid(), "CHECK").substr(0, 2), "OK");
}

// The driver's checkpoint of a container's process writes straight into the artifact, as on the
// host: `gpusnap init` started the workload with its preload requests at /tmp/.gpusnap-preload,
// where the capture mounts a folder of its own (read-only) holding that request alone, and the
// file it names is reached through the host-images mount. The driver's part is played inside the
// workload through the C library's mmap (StagingDriver, DRIVER-MAP), where
// libgpusnap-preload.so sees it as it sees the driver's. Before, the library found no request in
// the container and the region was copied after the driver's call (16 GiB: +1.09 s of capture on
// the H200).
TEST_F(ContainerTest, TheDriversMemoryGoesStraightIntoTheArtifactThroughMountsInItsTmp) {
  SKIP_WITHOUT_RUNC();
  auto source = start("source", bundle("source", shimmed_workload()));
  ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }));
  const auto children = proc::children(source->pid());
  ASSERT_EQ(children.size(), 1u);
  const pid_t workload = children.front();
  gpu::FakeDriver fake;
  fake.add_gpu(gpu::FakeDriver::make_gpu(kStagedGpu));
  fake.add_process(workload);
  fake.set_usage(workload, kStagedGpu, kLibraryRegion);
  StagingDriver driver(fake, [&](const std::string& line) { return ask_in(source->pid(), line); });

  CheckpointOptions co;
  co.container = ContainerRef{source->id(), runtime_root()};
  co.output = dir_ / "snap";
  co.driver = &driver;
  co.helper_binary = gpusnap_bin();
  co.run_dir = dir_ / "run";
  co.leave_running = true;
  Recorder cp_phases;
  // What CRIU dumps: the region as a private mapping of the file, by its name in the mount.
  std::vector<common::Mapping> dumped;
  cp_phases.on_start = [&](std::string_view phase) {
    if (phase == "dump") dumped = common::read_mappings(workload);
  };
  const CheckpointResult cp = gpusnap::checkpoint(co, cp_phases);
  const auto said = ::testing::PrintToString(cp_phases.notes);
  EXPECT_NE(said.find("written into the artifact by the driver's checkpoint itself"),
            std::string::npos)
      << said;
  ASSERT_EQ(cp.manifest.host_images.size(), 1u) << said;
  const auto& image = cp.manifest.host_images.front();
  EXPECT_EQ(image.end - image.start, kLibraryRegion);
  EXPECT_TRUE(image.criu_key.rfind("file[", 0) == 0) << image.criu_key;
  uint64_t pages = 0;
  for (const auto& e : stdfs::directory_iterator(co.output / kCriuImageDir)) {
    if (e.path().filename().string().rfind("pages-", 0) == 0) pages += e.file_size();
  }
  EXPECT_LT(pages, 64 * kMiB) << "CRIU stored the region too";
  bool private_mapping = false;
  for (const auto& m : dumped) {
    if (m.start == image.start) {
      private_mapping = m.perms == "rw-p" && m.path.rfind("/tmp/.gpusnap-host-images/", 0) == 0 &&
                        m.path.ends_with(stdfs::path(image.file).filename().string());
      EXPECT_TRUE(private_mapping) << m.perms << " " << m.path;
    }
  }
  EXPECT_TRUE(private_mapping);
  // The mounts went with the capture, and no request was left behind.
  EXPECT_FALSE(mounted_in(source->pid(), "/tmp/.gpusnap-host-images"));
  EXPECT_FALSE(mounted_in(source->pid(), "/tmp/.gpusnap-preload"));
  std::error_code ec;
  EXPECT_TRUE(stdfs::is_empty(dir_ / "run" / "preload", ec)) << ec.message();
  // Root's only: nobody else can leave a request there.
  EXPECT_EQ(stdfs::status(dir_ / "run" / "preload").permissions() & stdfs::perms::all,
            stdfs::perms::owner_all);
  // The source got its memory back (the driver's resume read every byte) and works on.
  EXPECT_EQ(driver.outcomes()[workload], "ok");
  EXPECT_EQ(ask_in(source->pid(), "CHECK").substr(0, 2), "OK");

  auto placeholder = start("placeholder", bundle("placeholder", placeholder_args()));
  const pid_t restored = restore_through(co.output, *placeholder, driver, fake, kLibraryRegion);
  ASSERT_NE(restored, 0);
  EXPECT_EQ(driver.outcomes()[restored], "ok");  // every byte, from the artifact's file
  EXPECT_EQ(ask_in(placeholder->pid(), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask_in(source->pid(), "CHECK").substr(0, 2), "OK");
}

// A capture of a container's process killed on the direct path: after the driver's call (its
// memory in a shared mapping of the artifact's file, reached through the mount), and while CRIU
// dumps (the region made private). The guardian takes the staging directory and the request
// away; the workload keeps the driver's bytes, from a file now in no artifact, and serves. What
// stays in the container is the two mounts, which the next capture's mounts of those names clear
// (container/mount.h).
TEST_F(ContainerTest, ACaptureKilledOnTheDirectPathLeavesTheWorkloadItsMemoryAndNoArtifact) {
  SKIP_WITHOUT_RUNC();
  for (const std::string phase : {"host-images", "dump"}) {
    SCOPED_TRACE(phase);
    auto source = start("source-" + phase, bundle("source-" + phase, shimmed_workload()));
    ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }));
    const auto children = proc::children(source->pid());
    ASSERT_EQ(children.size(), 1u);
    const pid_t workload = children.front();
    const auto snap = dir_ / ("snap-" + phase);
    // The capture in a process of its own, killed there; the guardian outlives it.
    const pid_t capture = ::fork();
    if (capture == 0) {
      gpu::FakeDriver fake;
      fake.add_gpu(gpu::FakeDriver::make_gpu(kStagedGpu));
      fake.add_process(workload);
      fake.set_usage(workload, kStagedGpu, kLibraryRegion);
      StagingDriver driver(fake,
                           [&](const std::string& line) { return ask_in(source->pid(), line); });
      CheckpointOptions co;
      co.container = ContainerRef{source->id(), runtime_root()};
      co.output = snap;
      co.driver = &driver;
      co.helper_binary = gpusnap_bin();
      co.run_dir = dir_ / "run";
      KillAt reporter(phase);
      try {
        gpusnap::checkpoint(co, reporter);
      } catch (...) {  // NOLINT(bugprone-empty-catch): the parent checks what was left
      }
      ::_exit(3);  // the phase never came
    }
    int status = 0;
    ASSERT_EQ(::waitpid(capture, &status, 0), capture);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;

    const auto staging_left = [&] {
      for (const auto& e : stdfs::directory_iterator(dir_.path())) {
        if (e.path().filename().string().rfind("." + snap.filename().string() + ".staging-", 0) ==
            0) {
          return true;
        }
      }
      return false;
    };
    EXPECT_TRUE(eventually([&] { return !staging_left(); }));
    EXPECT_FALSE(stdfs::exists(snap));
    // No request is left where a library could take it.
    std::error_code ec;
    for (stdfs::recursive_directory_iterator it(dir_ / "run" / "preload", ec), end;
         !ec && it != end; it.increment(ec)) {
      EXPECT_FALSE(it->is_regular_file()) << it->path();
    }
    // The workload keeps the driver's bytes and works on.
    std::optional<common::Mapping> region;
    for (const auto& m : common::read_mappings(workload)) {
      if (m.path.rfind("/tmp/.gpusnap-host-images/", 0) == 0) region = m;
    }
    ASSERT_TRUE(region.has_value());
    EXPECT_NE(region->path.find("(deleted)"), std::string::npos) << region->path;
    EXPECT_EQ(StagingDriver::check_region(workload, region->start, kLibraryRegion), "ok");
    EXPECT_EQ(ask_in(source->pid(), "CHECK").substr(0, 2), "OK");
    EXPECT_TRUE(running(workload));
  }
}

TEST(ContainerInit, RunsTheCommandAndExitsWithItsStatus) {
  // The shim outside a container too: CMD's exit status is the shim's.
  auto ok = common::run_capture({gpusnap_bin(), "init", "--", "/bin/sh", "-c", "exit 7"});
  EXPECT_EQ(ok.status.code, 7) << ok.output;
  auto usage = gpusnap({"init", "--placeholder", "--", "/bin/true"});
  EXPECT_EQ(usage.exit_code, 2);
}

TEST(ContainerInit, MemoryTierIsRefusedToAPlaceholderAndWithoutTheSiteFolder) {
  auto placeholder = gpusnap({"init", "--placeholder", "--memory-tier"});
  EXPECT_EQ(placeholder.exit_code, 2) << placeholder.err;
  EXPECT_NE(placeholder.err.find("init --placeholder takes no --memory-tier"), std::string::npos)
      << placeholder.err;
  // No site folder where the variable points: a usage error naming it, and CMD never starts.
  TempDir dir;
  ScopedEnv site(engine::kPythonSiteEnv, (dir / "no-such-folder").string());
  auto started = dir / "started";
  auto r = gpusnap({"init", "--memory-tier", "--", "/bin/sh", "-c", "touch " + started.string()});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("GPUSNAP_PYTHON_SITE names " + (dir / "no-such-folder").string() +
                       ", which holds no readable sitecustomize.py and gpusnap_handshake.py"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(stdfs::exists(started));
}

}  // namespace
}  // namespace gpusnap::testing
