// GPU tests (ctest label `gpu`): real GPUs, the real NVIDIA driver, real CRIU, the built CLI.
// Where there is no GPU each test reports "skipped: no GPU". Results from the H200 machines
// are recorded in docs/status.md; each test prints its phase timings as a line
// "RESULT <test> <json>" for that record.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "common/syscall_injection.h"
#include "gpu/driver.h"
#include "store/registry_fixture.h"
#include "testing/capture_restore.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;

std::optional<std::string> gpu_blocker(size_t gpus_needed = 1) {
  if (auto why = system_test_blocker()) return why;
  auto driver = gpu::open_nvidia_driver();
  if (!driver->available()) return "no GPU (" + driver->reason() + ")";
  auto count = driver->facts().gpus.size();
  if (count == 0) return "no GPU";
  if (count < gpus_needed) return "fewer than " + std::to_string(gpus_needed) + " GPUs";
  return std::nullopt;
}

#define SKIP_WITHOUT_GPU(n) GPUSNAP_SKIP_IF_BLOCKED(gpu_blocker(n))

// The CLI's capture and restore fixture, skipped where there is no GPU; a test that needs more
// than one says so again in its body.
class GpuTest : public CaptureRestoreTest {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(1); }
};
using CudaWorkload = GpuTest;
using TorchWorkload = GpuTest;
using Remap = GpuTest;
using KvCache = GpuTest;
using MemoryTier = GpuTest;
using MultiGpu = GpuTest;

void record(const std::string& name, const json& result) {
  std::cout << "RESULT " << name << " " << result.dump() << std::endl;
}

std::vector<std::string> cuda_pattern(double gib) {
  return {build_path("tests/cuda_pattern"), "--gib", std::to_string(gib)};
}

std::vector<std::string> torch_graph(const TempDir& dir, double gib) {
  const char* weights = std::getenv("GPUSNAP_TEST_WEIGHTS");  // reuse a made weights file
  return {"python3",   build_path("tests/torch_graph.py"),
          "--gib",     std::to_string(gib),
          "--weights", weights != nullptr ? weights : (dir / "weights.bin").string()};
}

std::string ok(const std::string& reply) { return reply.substr(0, 2); }

TEST_F(CudaWorkload, CheckpointLeaveRunningThenRestoreWithMemoryIntact) {
  auto& source = start(cuda_pattern(4), std::chrono::seconds(120));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  ASSERT_EQ(ok(before), "OK") << before;
  auto cp = capture({"--leave-running", "--json"});
  record("cuda-4gib-checkpoint", json::parse(cp.out));
  // The source got its GPU state back and works on.
  EXPECT_EQ(ask(source.port(), "CHECK", std::chrono::seconds(60)), before);

  auto inspect = json::parse(gpusnap({"inspect", snap.string(), "--json"}).out);
  ASSERT_FALSE(inspect["gpu"].is_null());
  EXPECT_GE(inspect["gpu"]["processes"][0]["bytes"].get<uint64_t>(), 4ull << 30);
  EXPECT_FALSE(inspect["gpu"]["gpus"][0]["uuid"].get<std::string>().empty());

  Copies copies = restore();
  record("cuda-4gib-restore", copies.doc);
  EXPECT_EQ(ask(copies.port(0), "CHECK", std::chrono::seconds(60)), before);
}

TEST_F(CudaWorkload, PreloadGivesTheDriversCheckpointItsMemoryAndEveryByteSurvives) {
  // Started as `gpusnap run` and `gpusnap init` start workloads: with libgpusnap-preload.so.
  std::vector<std::string> argv = {
      "/usr/bin/env", "LD_PRELOAD=" + build_path("libgpusnap-preload.so"), "GPUSNAP_PRELOAD_LOG=1"};
  auto pattern = cuda_pattern(4);
  argv.insert(argv.end(), pattern.begin(), pattern.end());
  auto& source = start(argv, std::chrono::seconds(120));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  ASSERT_EQ(ok(before), "OK") << before;
  auto cp = capture({"--leave-running", "--json"});
  record("cuda-4gib-preload-checkpoint", json::parse(cp.out));
  EXPECT_EQ(cp.err.find("runs without libgpusnap-preload.so"), std::string::npos) << cp.err;
  // The driver's region (4 GiB of pattern and the driver's own state) went through the library.
  std::string log;
  ASSERT_TRUE(fs::try_read_file(dir / "workload.log", &log));
  auto at = log.find("gpusnap-preload: populated ");
  ASSERT_NE(at, std::string::npos) << log;
  EXPECT_GE(std::stoul(log.substr(at + 27)), 4096u) << log.substr(at, 120);
  // ... straight into the artifact's file: one host image, at offset 0 of its file, written by
  // the driver's copy; the source got its GPU state back from that file (privately mapped).
  EXPECT_NE(log.find("gpusnap-preload: the driver's memory goes straight into "), std::string::npos)
      << log;
  auto manifest = json::parse(fs::read_file(snap / "manifest.json"));
  ASSERT_EQ(manifest["host_images"].size(), 1u) << manifest["host_images"].dump();
  EXPECT_EQ(manifest["host_images"][0]["file_offset"].get<uint64_t>(), 0u);
  EXPECT_NE(cp.out.find("written into the artifact by the driver's checkpoint itself"),
            std::string::npos)
      << cp.out;
  EXPECT_EQ(ask(source.port(), "CHECK", std::chrono::seconds(60)), before);

  Copies copies = restore();
  EXPECT_EQ(ask(copies.port(0), "CHECK", std::chrono::seconds(60)), before);
}

TEST_F(CudaWorkload, TwoCopiesAtOnceOnOneGpu) {
  auto& source = start(cuda_pattern(2), std::chrono::seconds(120));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  capture();
  Copies copies = restore({"--replicas", "2"});
  record("cuda-2gib-two-copies-restore", copies.doc);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ask(copies.port(i), "CHECK", std::chrono::seconds(60)), before) << "copy " << i;
  }
}

TEST_F(CudaWorkload, LockTimeoutLeavesTheWorkloadRunning) {
  auto& source = start(cuda_pattern(1), std::chrono::seconds(120));
  ASSERT_EQ(ask(source.port(), "BUSY 6000").substr(0, 4), "BUSY");
  auto cp = gpusnap({"checkpoint", "-p", std::to_string(source.pid()), "-o", snap.string(),
                     "--gpu-lock-timeout", "1"});
  EXPECT_EQ(cp.exit_code, 11) << cp.err;
  EXPECT_NE(cp.err.find("lock"), std::string::npos) << cp.err;
  EXPECT_FALSE(std::filesystem::exists(snap));
  EXPECT_EQ(ok(ask(source.port(), "CHECK", std::chrono::seconds(60))), "OK");
}

// The node agent carries GPU snapshots: the same checkpoint and restore as above, asked of a
// running gpusnap-agent through `gpusnap --agent SOCKET`, storage named by the agent.
TEST_F(CudaWorkload, CheckpointAndRestoreThroughTheAgent) {
  const std::string socket = (dir / "agent.sock").string();
  common::UniqueFd log(::open((dir / "agent.log").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
  common::SpawnOptions o;
  o.argv = {build_path("gpusnap-agent"),
            "--socket",
            socket,
            "--storage",
            (dir / "snapshots").string(),
            "--state-dir",
            (dir / "state").string(),
            "--run-dir",
            (dir / "run").string()};
  o.stdout_fd = log.get();
  o.stderr_fd = log.get();
  common::Subprocess agent(o);
  ASSERT_TRUE(eventually(
      [&] {
        return gpusnap({"--agent", socket, "list"}).exit_code == 0;
      },
      std::chrono::seconds(30)))
      << fs::read_file(dir / "agent.log");

  auto& source = start(cuda_pattern(4), std::chrono::seconds(120));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  ASSERT_EQ(ok(before), "OK") << before;
  auto cp = gpusnap({"--agent", socket, "checkpoint", "-p", std::to_string(source.pid()), "-o",
                     "cuda", "--leave-running", "--json"});
  ASSERT_EQ(cp.exit_code, 0) << cp.err << fs::read_file(dir / "agent.log");
  record("agent-cuda-4gib-checkpoint", json::parse(cp.out));
  EXPECT_EQ(ask(source.port(), "CHECK", std::chrono::seconds(60)), before);
  auto inspect = json::parse(gpusnap({"--agent", socket, "inspect", "cuda", "--json"}).out);
  ASSERT_FALSE(inspect["gpu"].is_null()) << inspect.dump();

  auto rs = gpusnap(
      {"--agent", socket, "restore", "cuda", "--publish", std::to_string(source.port()), "--json"});
  ASSERT_EQ(rs.exit_code, 0) << rs.err << fs::read_file(dir / "agent.log");
  Copies copies{json::parse(rs.out)};
  record("agent-cuda-4gib-restore", copies.doc);
  EXPECT_EQ(ask(copies.port(0), "CHECK", std::chrono::seconds(60)), before);
  agent.kill(SIGKILL);
  agent.wait();
}

// Kills the capture `cp`; the guardian must then give the workload its GPU state back (it answers
// as `before`), with nothing written at `output`.
void expect_killed_capture_undone(common::Subprocess& cp, Workload& source,
                                  const std::string& before, const std::filesystem::path& output) {
  cp.kill(SIGKILL);
  cp.wait();
  EXPECT_TRUE(
      eventually([&] { return ask(source.port(), "CHECK") == before; }, std::chrono::seconds(60)))
      << ask(source.port(), "CHECK");
  EXPECT_FALSE(std::filesystem::exists(output));
}

// gpusnap killed (SIGKILL) in the middle of the driver's checkpoint: the capture's guardian
// returns the workload's GPU state, with no gpusnap run afterwards, and nothing is written.
TEST_F(CudaWorkload, GpusnapKilledDuringTheGpuCheckpointLeavesTheWorkloadWorking) {
  auto& source = start(cuda_pattern(4), std::chrono::seconds(120));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  ASSERT_EQ(ok(before), "OK") << before;
  const std::filesystem::path journal = "/run/gpusnap/journal";
  auto entries = [&] {
    std::set<std::string> names;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(journal, ec)) {
      names.insert(e.path().filename().string());
    }
    return names;
  };
  const auto old_entries = entries();
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(), "checkpoint",  "-p",     std::to_string(source.pid()),
            "-o",          snap.string(), "--quiet"};
  common::Subprocess cp(o);
  // The journal entry appears before the lock; the checkpoint of 4 GiB then takes ~2.7 s.
  ASSERT_TRUE(eventually([&] { return entries() != old_entries; }, std::chrono::seconds(30)));
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  expect_killed_capture_undone(cp, source, before, snap);
  record("killed-mid-gpu-checkpoint", {{"answer", ask(source.port(), "CHECK")}});
}

std::vector<std::string> with_preload(std::vector<std::string> argv) {
  argv.insert(argv.begin(), {"/usr/bin/env", "LD_PRELOAD=" + build_path("libgpusnap-preload.so")});
  return argv;
}

// gpusnap killed (SIGKILL) while the driver writes the GPU memory straight into the artifact's
// file (the workload runs with libgpusnap-preload.so), or after, once the file is named and
// mapped privately in the workload: the guardian returns the GPU state from the file, which it
// unlinks with the staging directory; nothing is written, and no request is left behind. (Not
// in between: while the remap holds a thread with ptrace, a killed gpusnap breaks it.)
void kill_direct_capture(const std::string& name, bool after_the_drivers_call) {
  TempDir dir;
  Workload source(dir, with_preload(cuda_pattern(4)), std::chrono::seconds(120));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  ASSERT_EQ(ok(before), "OK") << before;
  auto request_left = [&] {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator("/run/gpusnap/preload", ec)) {
      if (e.path().filename().string().find("-" + std::to_string(source.pid())) !=
          std::string::npos) {
        return true;
      }
    }
    return false;
  };
  // The staging directory's host image: "PID.img" until the driver's call is over, then
  // "PID-ADDR.img".
  // Whether the workload maps its host image privately (the remap is over).
  auto private_image = [&] {
    for (const auto& m : common::read_mappings(source.pid())) {
      if (m.path.find("/host-images/" + std::to_string(source.pid()) + "-") != std::string::npos &&
          m.perms.size() == 4 && m.perms[3] == 'p') {
        return true;
      }
    }
    return false;
  };
  auto image = [&](bool named) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir.path(), ec)) {
      if (e.path().filename().string().rfind(".snap.staging-", 0) != 0) continue;
      for (const auto& f : std::filesystem::directory_iterator(e.path() / "host-images", ec)) {
        auto n = f.path().filename().string();
        if (n.rfind(std::to_string(source.pid()) + (named ? "-" : ".img"), 0) == 0) return true;
      }
    }
    return false;
  };
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(),           "checkpoint", "-p", std::to_string(source.pid()), "-o",
            (dir / "snap").string(), "--json"};
  common::UniqueFd output(
      ::open((dir / "gpusnap.out").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
  o.stdout_fd = output.get();
  o.stderr_fd = output.get();
  common::Subprocess cp(o);
  if (after_the_drivers_call) {
    ASSERT_TRUE(eventually([&] { return private_image(); }, std::chrono::seconds(30)))
        << fs::read_file(dir / "gpusnap.out");
  } else {
    // The request is left just before the driver's call; its copy of 4 GiB takes ~1 s.
    ASSERT_TRUE(
        eventually([&] { return image(false) && !request_left(); }, std::chrono::seconds(60)));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  expect_killed_capture_undone(cp, source, before, dir / "snap");
  EXPECT_TRUE(eventually([&] { return !image(false) && !image(true); }));
  EXPECT_FALSE(request_left());
  record(name, {{"answer", ask(source.port(), "CHECK")}});
}

TEST_F(CudaWorkload, GpusnapKilledWhileTheDriverWritesIntoTheArtifactLeavesTheWorkloadWorking) {
  kill_direct_capture("killed-mid-direct-gpu-checkpoint", false);
}

TEST_F(CudaWorkload, GpusnapKilledAfterTheDriverWroteIntoTheArtifactLeavesTheWorkloadWorking) {
  kill_direct_capture("killed-after-direct-gpu-checkpoint", true);
}

TEST_F(CudaWorkload, RefusesCopiesThatDoNotFitInGpuMemory) {
  start(cuda_pattern(4), std::chrono::seconds(120));
  capture({"--leave-running"});
  auto rs = gpusnap({"restore", snap.string(), "--replicas", "100"});
  EXPECT_EQ(rs.exit_code, 5) << rs.err;
  EXPECT_NE(rs.err.find("free, the 100 copy(ies) need"), std::string::npos) << rs.err;
  auto bad = gpusnap({"restore", snap.string(), "--gpu-map", "0=99"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("no GPU '99' on this host"), std::string::npos) << bad.err;
}

TEST_F(TorchWorkload, CudaGraphReplaysAfterRestore) {
  auto& source = start(torch_graph(dir, 4), std::chrono::seconds(600));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  ASSERT_EQ(ok(before), "OK") << before;
  record("torch-4gib-ready", {{"info", ask(source.port(), "INFO")}});
  auto cp = capture({"--json"});
  record("torch-4gib-checkpoint", json::parse(cp.out));
  Copies copies = restore();
  record("torch-4gib-restore", copies.doc);
  auto after = ask(copies.port(0), "CHECK", std::chrono::seconds(60));
  EXPECT_EQ(after.substr(0, 13), "OK max_err=0 ") << after;
}

TEST_F(Remap, SnapshotFromGpu0RestoresOntoGpu1) {
  SKIP_WITHOUT_GPU(2);
  auto& source = start(cuda_pattern(2), std::chrono::seconds(120));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  capture();
  Copies copies = restore({"--gpu-map", "0=1"});
  record("cuda-2gib-remap-restore", copies.doc);
  EXPECT_EQ(ask(copies.port(0), "CHECK", std::chrono::seconds(60)), before);
  // The driver places the copy's memory on GPU 1.
  auto driver = gpu::open_nvidia_driver();
  auto facts = driver->facts();
  pid_t pid = copies.doc["copies"][0]["pid"].get<pid_t>();
  bool on_gpu1 = false;
  for (const auto& u : driver->usage())
    on_gpu1 |= u.host_pid == pid && u.gpu_uuid == facts.gpus[1].uuid;
  EXPECT_TRUE(on_gpu1);
}

// `gpusnap run` of the KV-cache example (examples/kv_cache_worker.py) with a cache of kv_gib:
// captured through the handshake, which releases the cache; returns the run's JSON.
json run_kv_worker(const TempDir& dir, const std::string& name, double kv_gib) {
  auto ready = dir / (name + ".port");
  auto run = gpusnap({"run", "-o", (dir / name).string(), "--json", "--", "python3",
                      build_path("tests/kv_cache_worker.py"), "--kv-gib", std::to_string(kv_gib),
                      "--weights-gib", "1", "--ready-file", ready.string()},
                     std::chrono::minutes(5));
  EXPECT_EQ(run.exit_code, 0) << run.err;
  return run.exit_code == 0 ? json::parse(run.out) : json();
}

TEST_F(KvCache, TheCacheNeverEntersTheArtifactAndTheGraphReplaysAfterRestore) {
  auto none = run_kv_worker(dir, "kv0", 0);
  auto big = run_kv_worker(dir, "kv8", 8);
  ASSERT_FALSE(none.is_null());
  ASSERT_FALSE(big.is_null());
  EXPECT_TRUE(big["handshake"].get<bool>());
  auto without = none["bytes"].get<uint64_t>(), with = big["bytes"].get<uint64_t>();
  record("kv-cache-artifacts",
         {{"kv0_bytes", without}, {"kv8_bytes", with}, {"kv8_checkpoint", big}});
  // An 8 GiB cache adds at most 1% to the artifact: it was released at the pause.
  EXPECT_LE(static_cast<double>(with), static_cast<double>(without) * 1.01);
  // The copy maps fresh memory at the same addresses on resume; the CUDA graph captured over
  // them before the checkpoint replays to the same answer.
  // --publish needs the copy's port: the one the source listened on (its ready file).
  std::string port_text;
  ASSERT_TRUE(fs::try_read_file(dir / "kv8.port", &port_text));
  Copies copies = restore(dir / "kv8", std::stoi(port_text));
  record("kv-cache-restore", copies.doc);
  auto check = ask(copies.port(0), "CHECK", std::chrono::seconds(60));
  EXPECT_EQ(check.substr(0, 12), "OK max_err=0") << check;
}

// ---- The memory tier (docs/memory-tier.md) ----------------------------------------------------

// How tests/torch_tier.py gets its memory tier: none, its own use_memory_tier() call, or
// `gpusnap run --memory-tier` installing it when the workload imports torch.
enum class TierRoute { kNone, kOneLine, kGpusnapRun };

// `gpusnap run` of tests/torch_tier.py holding `gib` GiB of weights, with the tier by `route`:
// captured at READY through the handshake. Returns the run's JSON (null on failure).
json run_tier_worker(const TempDir& dir, const std::string& name, double gib, TierRoute route) {
  const char* weights = std::getenv("GPUSNAP_TEST_WEIGHTS");
  auto ready = dir / (name + ".port");
  std::vector<std::string> args = {"run", "-o", (dir / name).string(), "--json"};
  if (route == TierRoute::kGpusnapRun) args.emplace_back("--memory-tier");
  const char* tier_flag = route == TierRoute::kNone      ? "--no-tier"
                          : route == TierRoute::kOneLine ? "--tier"
                                                         : "--tier-by-gpusnap";
  args.insert(args.end(), {"--", "python3", build_path("tests/torch_tier.py"), tier_flag, "--gib",
                           std::to_string(gib), "--weights",
                           weights != nullptr ? weights : (dir / "weights.bin").string(),
                           "--ready-file", ready.string()});
  auto run = gpusnap(args, std::chrono::minutes(10));
  EXPECT_EQ(run.exit_code, 0) << run.err;
  return run.exit_code == 0 ? json::parse(run.out) : json();
}

// Bytes of the artifact's files under tier/.
uint64_t tier_bytes(const std::filesystem::path& artifact) {
  std::string text;
  EXPECT_TRUE(fs::try_read_file(artifact / "manifest.json", &text));
  uint64_t bytes = 0;
  const json manifest = json::parse(text);  // a named object: the loop refers into it
  for (const auto& f : manifest.at("files")) {
    if (f.at("path").get<std::string>().rfind("tier/", 0) == 0)
      bytes += f.at("size").get<uint64_t>();
  }
  return bytes;
}

// Captures the tier workload (its tier by `route`), restores it (with `restore_args`: one copy,
// or as many as --replicas asks for), and checks in every copy that every weight is bit-exact
// and the CUDA graph captured before the checkpoint replays to its answer.
void tier_round_trip(const std::string& name, double gib,
                     const std::vector<std::string>& restore_args = {},
                     TierRoute route = TierRoute::kOneLine) {
  TempDir dir;
  auto run = run_tier_worker(dir, name, gib, route);
  ASSERT_FALSE(run.is_null());
  EXPECT_TRUE(run["handshake"].get<bool>());
  const auto artifact = dir / name;
  // The weights went through the tier's files, not the driver's checkpoint.
  EXPECT_GE(static_cast<double>(tier_bytes(artifact)), gib * (1ULL << 30));
  std::string port_text;
  ASSERT_TRUE(fs::try_read_file(dir / (name + ".port"), &port_text));
  Copies copies = restore(artifact, std::stoi(port_text), restore_args);
  record(name + "-checkpoint", run);
  record(name + "-restore", copies.doc);
  ASSERT_FALSE(copies.copies.empty());
  for (size_t i = 0; i < copies.copies.size(); ++i) {
    auto check = ask(copies.port(i), "CHECK", std::chrono::seconds(60));
    EXPECT_EQ(check.substr(0, 13), "OK max_err=0 ") << "copy " << i << ": " << check;
    auto verify = ask(copies.port(i), "VERIFY", std::chrono::seconds(300));
    EXPECT_EQ(verify.substr(0, 3), "OK ") << "copy " << i << ": " << verify;
  }
}

TEST_F(MemoryTier, FourGiBBitExactAfterRestoreAndTheGraphReplays) {
  tier_round_trip("tier-4gib", 4);
}

TEST_F(MemoryTier, SixteenGiBBitExactAfterRestoreAndTheGraphReplays) {
  tier_round_trip("tier-16gib", 16);
}

// Three copies of one tier artifact at once onto one GPU: each copy's prefill fills it, only the
// first one checksums the files as it reads them (engine::TierPrefills), and every copy's weights
// are bit-exact.
TEST_F(MemoryTier, CopiesRestoredAtOnceAreEachBitExact) {
  tier_round_trip("tier-2gib-copies", 2, {"--replicas", "3"});
}

// A node that never saw the snapshot (docs/store.md, "The memory tier streams"): the tier
// snapshot pushed to a real registry and restored from it into an empty node cache; the copy's
// prefill fills the GPU from the drain files as the pull writes them, and the copy takes that
// memory over (its note says so: not the fallback of a fill in the copy). Needs docker-registry
// on PATH (on the GPU machine, carried: it needs only libc).
TEST_F(MemoryTier, RestoredFromARegistryFillsTheGpuAsTheSnapshotArrives) {
  if (::access("/usr/bin/docker-registry", X_OK) != 0 &&
      ::access("/usr/local/bin/docker-registry", X_OK) != 0) {
    GTEST_SKIP() << "skipped: no docker-registry in /usr/bin or /usr/local/bin (carry it there)";
  }
  TempDir dir;
  auto run = run_tier_worker(dir, "tier-oci", 4, TierRoute::kOneLine);
  ASSERT_FALSE(run.is_null());
  LocalRegistry registry(dir, {});
  const std::string ref = registry.ref("gpu/tier:a");
  auto push = gpusnap({"push", (dir / "tier-oci").string(), ref, "--plain-http", "--json"},
                      std::chrono::minutes(5));
  ASSERT_EQ(push.exit_code, 0) << push.err;
  std::string port_text;
  ASSERT_TRUE(fs::try_read_file(dir / "tier-oci.port", &port_text));
  Copies copies = restore(
      ref, std::stoi(port_text),
      {"--plain-http", "--cache", (dir / "cache").string(), "--run-dir", (dir / "node").string()});
  record("tier-4gib-oci-restore", copies.doc);
  ASSERT_FALSE(copies.copies.empty());
  const std::string doc = copies.doc.dump();
  EXPECT_NE(doc.find("await-criu-images"), std::string::npos) << "not restored as it arrived";
  EXPECT_NE(doc.find("taken by the copy"), std::string::npos) << doc;
  // Every byte went to the GPU from the node copy's own pages, written once by the pull
  // (docs/memory-tier.md, "Read in place"), none through the prefill's buffers.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      doc, m, std::regex(R"((\d+) bytes of \d+ filled .*?; (\d+) bytes read in place)")))
      << doc;
  EXPECT_EQ(m[2].str(), m[1].str()) << doc;
  // The driver's restore did not wait for the drain files, which only the tier reads.
  std::vector<std::string> phases;
  for (const auto& p : copies.doc.at("phases")) phases.push_back(p.at("name").get<std::string>());
  const auto at = [&](const char* name) {
    return std::find(phases.begin(), phases.end(), name) - phases.begin();
  };
  EXPECT_LT(at("await-host-images"), at("gpu-restore")) << doc;
  EXPECT_LT(at("gpu-restore"), at("await-artifact")) << doc;
  EXPECT_LT(at("await-artifact"), static_cast<ptrdiff_t>(phases.size())) << doc;
  auto check = ask(copies.port(0), "CHECK", std::chrono::seconds(60));
  EXPECT_EQ(check.substr(0, 13), "OK max_err=0 ") << check;
  auto verify = ask(copies.port(0), "VERIFY", std::chrono::seconds(300));
  EXPECT_EQ(verify.substr(0, 3), "OK ") << verify;
}

TEST_F(MemoryTier, RestoredOntoAnotherGpuWithGpuMap) {
  SKIP_WITHOUT_GPU(2);
  tier_round_trip("tier-2gib-remap", 2, {"--gpu-map", "0=1"});
}

// The same workload without the call to use_memory_tier(): `gpusnap run --memory-tier` has its
// Python install the tier at `import torch` (clients/python/gpusnap_site/sitecustomize.py), and the
// weights go through the tier's files as with the one line.
TEST_F(MemoryTier, GpusnapRunInstallsTheTierWithoutTheOneLine) {
  tier_round_trip("tier-4gib-by-gpusnap", 4, {}, TierRoute::kGpusnapRun);
}

// A serving thread that runs GPU work without a break, each step inside the handshake's
// gpu_work() gate (torch_tier.py --request-loop), through a tier capture that leaves the source
// running, then a restore: the pause holds the loop before the drain, and the source and the copy
// both run it on, the graph replaying exactly. Where a step still ran on drained memory the
// workload would die and the capture fail at once, naming the tier
// (MemoryTierPlumbing.AWorkloadThatDiesAfterItsDrainFailsTheCaptureAtOnce on CPU).
TEST_F(MemoryTier, ARequestLoopRunningThroughTheCaptureIsHeldAtThePauseAndRunsOn) {
  const auto control = dir / "control";
  std::filesystem::create_directories(control);
  const char* weights = std::getenv("GPUSNAP_TEST_WEIGHTS");
  auto& source =
      start({"/usr/bin/env", "GPUSNAP_CONTROL_DIR=" + control.string(),
             "GPUSNAP_TIER_LIBRARY=" + build_path("libgpusnap-tier.so"), "python3",
             build_path("tests/torch_tier.py"), "--tier", "--gib", "2", "--weights",
             weights != nullptr ? weights : (dir / "weights.bin").string(), "--request-loop"},
            std::chrono::seconds(300));
  auto loops = [](uint16_t port) {
    const std::string n = field(ask(port, "INFO", std::chrono::seconds(60)), "loops");
    return n.empty() ? 0ULL : std::stoull(n);
  };
  auto why = [&](uint16_t port) {
    std::string log;
    (void)fs::try_read_file(dir / "workload.log", &log);
    return ask(port, "INFO", std::chrono::seconds(60)) + "\nworkload.log:\n" + log;
  };
  ASSERT_TRUE(eventually([&] { return loops(source.port()) > 20; }, std::chrono::seconds(60)))
      << why(source.port());
  const auto start_time = std::chrono::steady_clock::now();
  auto cp = gpusnap({"checkpoint", "-p", std::to_string(source.pid()), "-o", snap.string(),
                     "--leave-running", "--json"},
                    std::chrono::minutes(3));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  ASSERT_EQ(cp.exit_code, 0) << cp.err << fs::read_file(dir / "workload.log");
  EXPECT_LT(seconds, 60);
  const uint64_t after_capture = loops(source.port());
  EXPECT_TRUE(eventually([&] { return loops(source.port()) > after_capture + 20; },
                         std::chrono::seconds(60)))
      << why(source.port());
  const auto check = ask(source.port(), "CHECK", std::chrono::seconds(60));
  EXPECT_EQ(check.substr(0, 13), "OK max_err=0 ") << check;

  Copies copies = restore();
  ASSERT_EQ(copies.copies.size(), 1U);
  const uint64_t restored = loops(copies.port(0));
  EXPECT_TRUE(
      eventually([&] { return loops(copies.port(0)) > restored + 20; }, std::chrono::seconds(60)))
      << why(copies.port(0));
  const auto copy_check = ask(copies.port(0), "CHECK", std::chrono::seconds(60));
  EXPECT_EQ(copy_check.substr(0, 13), "OK max_err=0 ") << copy_check;
  record(
      "tier-request-loop",
      {{"checkpoint", json::parse(cp.out)}, {"restore", copies.doc}, {"capture_seconds", seconds}});
}

// gpusnap killed (SIGKILL) once the tier's drain has written its files and released the GPU
// memory (its index, written last, is in the staging folder): from then on the files are the
// only copy. The capture's guardian resumes the workload, whose client fills the tier back from
// the staging folder before the guardian removes it: every weight bit-exact, the graph replaying,
// nothing written. With a stand-in on CPU:
// MemoryTierPlumbing.GpusnapKilledDuringTheDrainLeavesTheWorkloadWithItsMemory.
TEST_F(MemoryTier, GpusnapKilledAfterTheDrainLeavesTheWorkloadServingWithItsMemory) {
  const auto control = dir / "control";
  std::filesystem::create_directories(control);
  const char* weights = std::getenv("GPUSNAP_TEST_WEIGHTS");
  auto& source = start({"/usr/bin/env", "GPUSNAP_CONTROL_DIR=" + control.string(),
                        "GPUSNAP_TIER_LIBRARY=" + build_path("libgpusnap-tier.so"), "python3",
                        build_path("tests/torch_tier.py"), "--tier", "--gib", "4", "--weights",
                        weights != nullptr ? weights : (dir / "weights.bin").string()},
                       std::chrono::seconds(300));
  const auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  ASSERT_EQ(before.substr(0, 13), "OK max_err=0 ") << before;
  const std::string index = std::to_string(source.pid()) + ".json";
  auto staging_has = [&](const std::string& name) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir.path(), ec)) {
      if (e.path().filename().string().rfind(".snap.staging-", 0) == 0 &&
          std::filesystem::exists(e.path() / "tier" / name)) {
        return true;
      }
    }
    return false;
  };
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(), "checkpoint",  "-p",     std::to_string(source.pid()),
            "-o",          snap.string(), "--quiet"};
  common::Subprocess cp(o);
  ASSERT_TRUE(eventually([&] { return staging_has(index); }, std::chrono::seconds(120)));
  cp.kill(SIGKILL);
  cp.wait();
  // Asked only once resumed: a graph replayed over released memory would fault.
  auto resumed = [&] {
    std::string log;
    return fs::try_read_file(dir / "workload.log", &log) &&
           log.find("resumed ") != std::string::npos;
  };
  ASSERT_TRUE(eventually(resumed, std::chrono::seconds(60))) << fs::read_file(dir / "workload.log");
  const auto after = ask(source.port(), "CHECK", std::chrono::seconds(60));
  EXPECT_EQ(after.substr(0, 13), "OK max_err=0 ") << after;
  EXPECT_EQ(field(after, "pid"), field(before, "pid"));  // the same process, not a copy
  const auto verify = ask(source.port(), "VERIFY", std::chrono::seconds(300));
  EXPECT_EQ(verify.substr(0, 3), "OK ") << verify;
  EXPECT_FALSE(std::filesystem::exists(snap));
  EXPECT_TRUE(eventually([&] {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir.path(), ec)) {
      if (e.path().filename().string().rfind(".snap", 0) == 0) return false;
    }
    return true;
  })) << "a staging directory was left";
  record("tier-killed-after-drain", {{"check", after}, {"verify", verify}});
}

TEST_F(MemoryTier, WorkloadWithoutTheTierIsCapturedAsBefore) {
  auto run = run_tier_worker(dir, "notier", 1, TierRoute::kNone);
  ASSERT_FALSE(run.is_null());
  EXPECT_EQ(tier_bytes(dir / "notier"), 0u);
  EXPECT_FALSE(std::filesystem::exists(dir / "notier" / "tier"));
}

// transformers' LlamaForCausalLM of Llama-3-8B's width (4 of its 32 layers: 3.7 GB of bf16
// weights) on the tier: greedy generate() after the restore gives the tokens it gave before
// the capture, token for token, with the weights carried by the tier's files (and, where
// gpusnap-tier-prefill is beside gpusnap, filled ahead of the copy's resume).
TEST_F(MemoryTier, TransformersLlamaGeneratesTheSameTokensAfterRestore) {
  const auto ready = dir / "llama.port";
  auto run = gpusnap({"run", "-o", (dir / "llama").string(), "--json", "--", "python3",
                      build_path("tests/llama_tier.py"), "--tier", "--layers", "4", "--ready-file",
                      ready.string()},
                     std::chrono::minutes(10));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_GE(tier_bytes(dir / "llama"), 3ull << 30);
  std::string port_text;
  ASSERT_TRUE(fs::try_read_file(ready, &port_text));
  Copies copies = restore(dir / "llama", std::stoi(port_text));
  record("tier-llama-checkpoint", json::parse(run.out));
  record("tier-llama-restore", copies.doc);
  auto check = ask(copies.port(0), "CHECK", std::chrono::seconds(120));
  EXPECT_EQ(check.substr(0, 10), "OK tokens=") << check;
  EXPECT_NE(check.find(" same=1 "), std::string::npos) << check;
}

// One CUDA graph per batch size (tests/graph_pools.py: an MLP whose temporaries reach 64 MiB a
// tensor): on the tier each capture reuses the temporaries it freed, as PyTorch's private pools
// do, so the graphs take about what they take on PyTorch's own allocator rather than the sum of
// every temporary; and after a restore every graph replays to its answer.
TEST_F(MemoryTier, GraphsReuseWhatTheirCaptureFreedAndReplayAfterRestore) {
  const std::string script = build_path("tests/graph_pools.py");
  auto graphs_took = [](const std::string& info) {
    return std::stoll(field(info, "used_after")) - std::stoll(field(info, "used_before"));
  };
  std::string native_info;
  {
    Workload native(dir, {"python3", script, "--no-tier"}, std::chrono::seconds(300));
    EXPECT_EQ(ask(native.port(), "CHECK", std::chrono::seconds(60)).substr(0, 13), "OK max_err=0 ");
    native_info = ask(native.port(), "INFO");
  }
  const auto ready = dir / "pools.port";
  auto run = gpusnap({"run", "-o", (dir / "pools").string(), "--json", "--", "python3", script,
                      "--tier", "--ready-file", ready.string()},
                     std::chrono::minutes(10));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  std::string port_text;
  ASSERT_TRUE(fs::try_read_file(ready, &port_text));
  Copies copies = restore(dir / "pools", std::stoi(port_text));
  auto check = ask(copies.port(0), "CHECK", std::chrono::seconds(60));
  EXPECT_EQ(check.substr(0, 13), "OK max_err=0 ") << check;
  EXPECT_NE(check.find(" graphs=5 "), std::string::npos) << check;
  const std::string tier_info = ask(copies.port(0), "INFO");  // the source's figures, restored
  ASSERT_EQ(field(tier_info, "tier"), "1") << tier_info;
  const long long native = graphs_took(native_info), tier = graphs_took(tier_info);
  record("tier-graph-pools", {{"native_graphs_bytes", native},
                              {"tier_graphs_bytes", tier},
                              {"native_info", native_info},
                              {"tier_info", tier_info},
                              {"tier_bytes_in_artifact", tier_bytes(dir / "pools")},
                              {"checkpoint", json::parse(run.out)},
                              {"restore", copies.doc}});
  // Summed, the temporaries of the five captures come to about 1.7 GB; their peaks to about a
  // tenth of that. The tier keeps the warm-ups' largest temporaries cached beside the pools.
  EXPECT_LE(tier, native + (512LL << 20)) << "tier " << tier << " vs PyTorch's own " << native;
}

// torch.compile(mode="reduce-overhead") on the tier (tests/frameworks.py), the tier installed by
// `route`: PyTorch runs its CUDA graph trees on its own allocator only, so use_memory_tier()
// turns them off and Inductor captures its graphs with torch.cuda.graph, each in a pool of the
// tier's. Captured at READY with its weights in the tier's files; after the restore the compiled
// model, its graph replayed, gives the answer it gave before the capture, bit for bit.
void torch_compile_on_tier(const std::string& name, TierRoute route) {
  TempDir dir;
  const auto ready = dir / (name + ".port");
  std::vector<std::string> args = {"run", "-o", (dir / name).string(), "--json"};
  if (route == TierRoute::kGpusnapRun) args.emplace_back("--memory-tier");
  args.insert(args.end(), {"--", "python3", build_path("tests/frameworks.py"), "--framework",
                           "torch-compile", "--ready-file", ready.string()});
  if (route == TierRoute::kOneLine) args.emplace_back("--tier");
  auto run = gpusnap(args, std::chrono::minutes(10));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  EXPECT_GE(tier_bytes(dir / name), 256ull << 20);  // 8 bf16 layers of 4096 x 4096
  std::string port_text;
  ASSERT_TRUE(fs::try_read_file(ready, &port_text));
  Copies copies = restore(dir / name, std::stoi(port_text));
  auto check = ask(copies.port(0), "CHECK", std::chrono::seconds(120));
  EXPECT_EQ(check.substr(0, 12), "OK max_err=0") << check;
  const std::string info = ask(copies.port(0), "INFO");
  EXPECT_EQ(field(info, "cudagraph_trees"), "0") << info;
  record(name, {{"info", info},
                {"tier_bytes_in_artifact", tier_bytes(dir / name)},
                {"checkpoint", json::parse(run.out)},
                {"restore", copies.doc}});
}

TEST_F(MemoryTier, TorchCompileReduceOverheadRestoresExactly) {
  torch_compile_on_tier("tier-torch-compile", TierRoute::kOneLine);
}

TEST_F(MemoryTier, TorchCompileUnderGpusnapRunMemoryTierRestoresExactly) {
  torch_compile_on_tier("tier-torch-compile-by-gpusnap", TierRoute::kGpusnapRun);
}

std::vector<std::string> torch_tp(int ranks, double gib, bool nccl_defaults = false) {
  std::vector<std::string> argv = {"python3", build_path("tests/torch_tp.py"),
                                   "--ranks", std::to_string(ranks),
                                   "--gib",   std::to_string(gib)};
  if (nccl_defaults) argv.push_back("--nccl-defaults");
  return argv;
}

// The GPU each process of a copy uses now, by host pid.
std::map<pid_t, std::string> gpu_of(gpu::Driver& driver) {
  std::map<pid_t, std::string> out;
  for (const auto& u : driver.usage()) out[u.host_pid] = u.gpu_uuid;
  return out;
}

TEST_F(MultiGpu, TensorParallelWorkloadCapturedAndRestoredAsOne) {
  SKIP_WITHOUT_GPU(2);
  auto& source = start(torch_tp(2, 2), std::chrono::seconds(600));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(60));
  ASSERT_EQ(before, "OK ranks=2 max_err=0");
  auto cp = capture({"--json"});
  record("torch-tp2-checkpoint", json::parse(cp.out));
  auto inspect = json::parse(gpusnap({"inspect", snap.string(), "--json"}).out);
  ASSERT_EQ(inspect["gpu"]["processes"].size(), 2u);
  ASSERT_EQ(inspect["gpu"]["gpus"].size(), 2u);

  auto driver = gpu::open_nvidia_driver();
  auto facts = driver->facts();
  for (const std::string map : {"", "0=1,1=0"}) {
    Copies copies = restore(map.empty() ? std::vector<std::string>{}
                                        : std::vector<std::string>{"--gpu-map", map});
    record(map.empty() ? "torch-tp2-restore" : "torch-tp2-restore-swapped", copies.doc);
    EXPECT_EQ(ask(copies.port(0), "CHECK", std::chrono::seconds(60)), before) << "map " << map;
    if (!map.empty()) {
      // Rank 0 was on GPU 0 at the checkpoint; it now runs on GPU 1, and rank 1 on GPU 0.
      auto now = gpu_of(*driver);
      std::vector<std::string> rank_gpus;
      for (const auto& p : inspect["gpu"]["processes"]) {
        auto init = copies.doc["copies"][0]["init_pid"].get<pid_t>();
        pid_t host = proc::host_pid_in_namespace(init, p["pid"].get<pid_t>());
        rank_gpus.push_back(now[host]);
      }
      EXPECT_EQ(rank_gpus, (std::vector<std::string>{facts.gpus[1].uuid, facts.gpus[0].uuid}));
    }
  }
}

// Both ranks of a tensor-parallel workload with a memory tier each: rank 0's handshake client
// drains and fills both (gpusnap_handshake.TierGroup); the weights go through the tier's files,
// one pair per rank, and the all-reduced answer is exact after restore, also with the GPUs
// swapped.
// `gpusnap run` of tests/torch_tp.py with --tier (then `extra`), `gib` GiB per rank, captured at
// READY: `gib` GiB per rank went through the tier, and every rank wrote its own index. Returns
// the port rank 0 listens on, or "" (the failure reported).
std::string run_tp_on_tier(const std::filesystem::path& snap, const std::filesystem::path& ready,
                           int ranks, double gib, const std::vector<std::string>& extra = {}) {
  auto argv = torch_tp(ranks, gib);
  std::vector<std::string> args = {"run", "-o", snap.string(), "--json", "--"};
  args.insert(args.end(), argv.begin(), argv.end());
  args.insert(args.end(), {"--tier", "--ready-file", ready.string()});
  args.insert(args.end(), extra.begin(), extra.end());
  auto run = gpusnap(args, std::chrono::minutes(10));
  EXPECT_EQ(run.exit_code, 0) << run.err;
  if (run.exit_code != 0) return "";
  record(snap.filename().string() + "-run", json::parse(run.out));
  EXPECT_GE(static_cast<double>(tier_bytes(snap)), ranks * gib * (1ULL << 30));
  size_t indexes = 0;
  for (const auto& e : std::filesystem::directory_iterator(snap / "tier")) {
    if (e.path().extension() == ".json") ++indexes;
  }
  EXPECT_EQ(indexes, static_cast<size_t>(ranks));
  std::string port_text;
  EXPECT_TRUE(fs::try_read_file(ready, &port_text));
  return port_text.empty() ? "" : std::to_string(std::stoi(port_text));
}

// Two ranks on one GPU (torch_tp.py --one-gpu: the collective over gloo, as NCCL takes one rank
// per GPU), each allocating through its own tier; rank 0's client drains and fills both
// (TierGroup, RankTier over the socketpairs CRIU restores). After the restore each rank has
// taken over its own prefill and both graphs replay to the answer. On two GPUs with NCCL:
// MultiGpu.TensorParallelRanksEachWithTheirOwnTier.
TEST_F(MemoryTier, TwoRanksOnOneGpuEachWithTheirOwnTier) {
  const std::string port = run_tp_on_tier(snap, dir / "tp.port", 2, 1, {"--one-gpu"});
  ASSERT_FALSE(port.empty());
  Copies copies = restore(snap, std::stoi(port));
  record("tp-one-gpu-tier-restore", copies.doc);
  size_t taken = 0;
  for (const auto& note : copies.doc["notes"]) {
    if (note.get<std::string>().find("taken by the copy") != std::string::npos) ++taken;
  }
  EXPECT_EQ(taken, 2u) << copies.doc["notes"];  // a prefill per rank, each taken by its rank
  EXPECT_EQ(ask(copies.port(0), "CHECK", std::chrono::seconds(60)), "OK ranks=2 max_err=0");
  ask(copies.port(0), "QUIT", std::chrono::seconds(30));
}

TEST_F(MultiGpu, TensorParallelRanksEachWithTheirOwnTier) {
  SKIP_WITHOUT_GPU(2);
  const std::string port = run_tp_on_tier(snap, dir / "tp-tier.port", 2, 2);
  ASSERT_FALSE(port.empty());
  for (const std::string map : {"", "0=1,1=0"}) {
    Copies copies = restore(
        snap, std::stoi(port),
        map.empty() ? std::vector<std::string>{} : std::vector<std::string>{"--gpu-map", map});
    record(map.empty() ? "torch-tp2-tier-restore" : "torch-tp2-tier-restore-swapped", copies.doc);
    EXPECT_EQ(ask(copies.port(0), "CHECK", std::chrono::seconds(60)), "OK ranks=2 max_err=0")
        << "map " << map;
    ask(copies.port(0), "QUIT", std::chrono::seconds(30));
  }
}

TEST_F(MultiGpu, RefusesNcclTransportsTheDriverCannotCarry) {
  SKIP_WITHOUT_GPU(2);
  auto& source = start(torch_tp(2, 1, /*nccl_defaults=*/true), std::chrono::seconds(600));
  auto cp = gpusnap({"checkpoint", "-p", std::to_string(source.pid()), "-o", snap.string()});
  EXPECT_EQ(cp.exit_code, 6) << cp.err;
  EXPECT_NE(cp.err.find("NCCL_P2P_DISABLE=1"), std::string::npos) << cp.err;
  EXPECT_EQ(ask(source.port(), "CHECK", std::chrono::seconds(60)), "OK ranks=2 max_err=0");
}

// --- Real frameworks: one test per row of docs/compatibility.md ----------------------------------
// Small sizes. Each workload computes its answer before the checkpoint and a restored copy must
// compute it again exactly (max_err=0) from the GPU state it got back. Each prints a RESULT line
// with the row's figures: cold start (the workload's own start-to-ready), the capture's phases,
// the restore's phases and the time from the restore command to the first exact answer, and the
// artifact's bytes against the GPU bytes the driver saw in use.

std::vector<std::string> framework(const std::string& name, std::vector<std::string> extra = {},
                                   std::vector<std::string> env = {}) {
  std::vector<std::string> argv = {"/usr/bin/env"};
  argv.insert(argv.end(), env.begin(), env.end());
  argv.insert(argv.end(), {"python3", build_path("tests/frameworks.py"), "--framework", name});
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

uint64_t tree_bytes(const std::filesystem::path& root) {
  uint64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) total += e.file_size();
  }
  return total;
}

uint64_t gpu_bytes_in(const std::filesystem::path& snap) {
  auto inspect = json::parse(gpusnap({"inspect", snap.string(), "--json"}).out);
  uint64_t total = 0;
  for (const auto& p : inspect["gpu"]["processes"]) total += p["bytes"].get<uint64_t>();
  return total;
}

// Restores `snap`, asks the copy for its answer; returns the row's restore figures.
json restore_and_check(const std::filesystem::path& snap, uint16_t port) {
  auto t0 = std::chrono::steady_clock::now();
  auto rs = gpusnap({"restore", snap.string(), "--publish", std::to_string(port), "--json"});
  EXPECT_EQ(rs.exit_code, 0) << rs.err;
  if (rs.exit_code != 0) return {{"error", rs.err}};
  Copies copies{json::parse(rs.out)};
  auto after = ask(copies.port(0), "CHECK", std::chrono::seconds(120));
  double to_answer = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string output;  // the copy's own output, for a failure
  fs::try_read_file(copies.doc["copies"][0]["dir"].get<std::string>() + "/output.log", &output);
  EXPECT_EQ(after.substr(0, 12), "OK max_err=0") << after << " | copy's output: " << output;
  return {{"restore", copies.doc}, {"restore_to_first_answer_s", to_answer}, {"answer", after}};
}

class FrameworksTest : public GpuTest {
 protected:
  // The whole row for a workload that is captured (the source stopped) and restored.
  void framework_row(const std::string& name, const std::vector<std::string>& argv);
};
using Frameworks = FrameworksTest;

void FrameworksTest::framework_row(const std::string& name, const std::vector<std::string>& argv) {
  auto& source = start(argv, std::chrono::seconds(600));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(120));
  ASSERT_EQ(before.substr(0, 12), "OK max_err=0") << before;
  auto info = ask(source.port(), "INFO");
  auto cp = capture({"--json"}, std::chrono::minutes(5));
  auto row = restore_and_check(snap, source.port());
  row["info"] = info;
  row["checkpoint"] = json::parse(cp.out);
  row["artifact_bytes"] = tree_bytes(snap);
  row["gpu_bytes"] = gpu_bytes_in(snap);
  record(name, row);
}

TEST_F(Frameworks, TorchCompileReduceOverheadRestoresItsCudaGraphs) {
  framework_row("torch-compile", framework("torch-compile"));
}

TEST_F(Frameworks, JaxWithPreallocationOffRestores) {
  framework_row("jax", framework("jax", {}, {"XLA_PYTHON_CLIENT_PREALLOCATE=false"}));
}

TEST_F(Frameworks, JaxWithPreallocationIsRefusedBeforeAnythingIsFrozen) {
  auto& source = start(framework("jax", {}, {"-u", "XLA_PYTHON_CLIENT_PREALLOCATE"}),
                       std::chrono::seconds(600));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(120));
  ASSERT_EQ(before.substr(0, 12), "OK max_err=0") << before;
  auto cp =
      gpusnap({"checkpoint", "-p", std::to_string(source.pid()), "-o", snap.string(), "--json"});
  EXPECT_EQ(cp.exit_code, 6) << cp.err;
  EXPECT_NE(cp.err.find("XLA_PYTHON_CLIENT_PREALLOCATE is unset"), std::string::npos) << cp.err;
  EXPECT_FALSE(std::filesystem::exists(snap));
  // Nothing was frozen or moved: the source answers as before.
  EXPECT_EQ(ask(source.port(), "CHECK", std::chrono::seconds(60)).substr(0, 12), "OK max_err=0");
  record("jax-preallocation-refused", {{"stderr", cp.err}});
}

TEST_F(Frameworks, CupyRestores) { framework_row("cupy", framework("cupy")); }

TEST_F(Frameworks, TwoProcessTreeWithACudaWorkerRestores) {
  framework_row("tree", framework("tree"));
}

TEST_F(Frameworks, CppProgramWithCublasRestores) {
  auto binary = build_path("tests/cublas_gemm");
  if (!std::filesystem::exists(binary)) GTEST_SKIP() << "skipped: cublas_gemm not built (no nvcc)";
  framework_row("cublas", {binary});
}

// transformers generate() with its KV cache, and PyTorch's cached free blocks: captured once as
// it runs (the cache in the artifact), once through the handshake (the client frees the cache at
// the pause), and the second restored.
TEST_F(Frameworks, TransformersGenerateRestoresAndItsFreeCacheIsNotCaptured) {
  auto control = dir / "control";
  std::filesystem::create_directories(control);
  auto& source = start(
      framework("transformers", {"--cache-gib", "4"}, {"GPUSNAP_CONTROL_DIR=" + control.string()}),
      std::chrono::seconds(600));
  auto before = ask(source.port(), "CHECK", std::chrono::seconds(120));
  ASSERT_EQ(before.substr(0, 12), "OK max_err=0") << before;
  auto info = ask(source.port(), "INFO");
  auto as_it_runs = dir / "as-it-runs";
  auto cp1 = capture(source.pid(), as_it_runs, {"--leave-running", "--no-handshake", "--json"},
                     std::chrono::minutes(5));
  auto paused = dir / "paused";
  auto cp2 = capture(source.pid(), paused, {"--leave-running", "--json"}, std::chrono::minutes(5));
  auto paused_doc = json::parse(cp2.out);
  EXPECT_NE(paused_doc["notes"].dump().find("of cached free GPU memory at the pause"),
            std::string::npos)
      << cp2.out;
  auto with_cache = tree_bytes(as_it_runs), without = tree_bytes(paused);
  // The 4 GiB of free blocks are in the first artifact and not in the second.
  EXPECT_GE(with_cache, without + (3ull << 30)) << with_cache << " vs " << without;
  EXPECT_EQ(ask(source.port(), "CHECK", std::chrono::seconds(60)).substr(0, 12), "OK max_err=0");
  auto row = restore_and_check(paused, source.port());
  row["info"] = info;
  row["checkpoint_as_it_runs"] = json::parse(cp1.out);
  row["checkpoint_paused"] = paused_doc;
  row["artifact_bytes_as_it_runs"] = with_cache;
  row["artifact_bytes_paused"] = without;
  row["gpu_bytes_as_it_runs"] = gpu_bytes_in(as_it_runs);
  row["gpu_bytes_paused"] = gpu_bytes_in(paused);
  record("transformers", row);
}

}  // namespace
}  // namespace gpusnap::testing
