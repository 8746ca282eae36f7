// The workload handshake end to end, with real processes and real CRIU: `gpusnap run` and
// `gpusnap checkpoint` pausing workloads that speak it (the C++ and Python examples), copies
// resuming with their own contexts, and every way a workload can fail the handshake.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "engine/python_site.h"
#include "testing/capture_restore.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
using Handshake = CaptureRestoreTest;
using MemoryTierPlumbing = CaptureRestoreTest;

std::string cxx_worker() { return build_path("tests/gpusnap-example-handshake-worker"); }

// Kills a process tree we did not start ourselves (a workload launched by `gpusnap run`).
struct TreeKiller {
  pid_t pid = 0;
  ~TreeKiller() {
    if (pid <= 0) return;
    try {
      for (const auto& p : proc::read_tree(pid)) ::kill(p.pid, SIGKILL);
    } catch (const std::exception&) {
    }
  }
};

uint16_t read_port(const std::filesystem::path& ready) {
  std::string text;
  if (!eventually([&] { return fs::try_read_file(ready, &text); })) return 0;
  return static_cast<uint16_t>(std::stoi(text));
}

// `gpusnap run` of `worker` captured into `snap`, and two copies restored from it.
void run_capture_and_restore(const TempDir& dir, const std::filesystem::path& snap,
                             const std::vector<std::string>& worker) {
  auto ready = dir / "port";
  std::vector<std::string> args = {"run", "-o", snap.string(), "--leave-running", "--json", "--"};
  args.insert(args.end(), worker.begin(), worker.end());
  args.insert(args.end(), {"--cache-mib", "256", "--ready-file", ready.string()});
  auto run = gpusnap(args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  auto doc = json::parse(run.out);
  TreeKiller source{doc["pid"].get<pid_t>()};
  EXPECT_TRUE(doc["handshake"].get<bool>());
  // `gpusnap run` starts workloads with the library that speeds up the driver's checkpoint.
  EXPECT_TRUE(maps_file(source.pid, "libgpusnap-preload.so"));
  // And with JAX's preallocation off (the driver's checkpoint kills JAX with it on), unless the
  // user set it.
  std::string environ;
  ASSERT_TRUE(fs::try_read_file("/proc/" + std::to_string(source.pid) + "/environ", &environ));
  std::vector<std::string> entries;
  for (std::istringstream in(environ); std::getline(in, entries.emplace_back(), '\0');) {
  }
  if (std::getenv("XLA_PYTHON_CLIENT_PREALLOCATE") == nullptr) {
    EXPECT_NE(std::find(entries.begin(), entries.end(), "XLA_PYTHON_CLIENT_PREALLOCATE=false"),
              entries.end());
  }
  uint16_t port = read_port(ready);
  ASSERT_NE(port, 0);

  // The source was paused, captured and resumed as itself; its cache is back.
  auto info = ask(port, "INFO");
  EXPECT_EQ(field(info, "restored"), "0") << info;
  EXPECT_EQ(field(info, "cache_mib"), "256") << info;
  EXPECT_EQ(ask(port, "INCR"), "1");
  // The 256 MiB cache was released before the capture: it is not in the artifact.
  auto manifest = json::parse(gpusnap({"inspect", snap.string(), "--json"}).out);
  EXPECT_LT(manifest["total_bytes"].get<uint64_t>(), 128ull << 20);
  EXPECT_FALSE(manifest["handshake"].is_null());

  Copies copies = restore(snap, port, {"--replicas", "2", "--set", "greeting=hello"});
  EXPECT_TRUE(copies.doc["handshake"].get<bool>());
  for (size_t i = 0; i < 2; ++i) {
    // RESUMED came before restore returned: the copy serves at once, with its own context.
    auto copy_info = ask(copies.port(i), "INFO");
    EXPECT_EQ(field(copy_info, "copy"), std::to_string(i)) << copy_info;
    EXPECT_EQ(field(copy_info, "restored"), "1") << copy_info;
    EXPECT_EQ(field(copy_info, "cache_mib"), "256") << copy_info;
    EXPECT_EQ(field(copy_info, "greeting"), "hello") << copy_info;
    EXPECT_EQ(ask(copies.port(i), "INCR"), "1");  // the counter as it was at the capture
    // CRIU put the library's mapping back in the copy, from the same file.
    EXPECT_TRUE(maps_file(copies.doc["copies"][i]["pid"].get<pid_t>(), "libgpusnap-preload.so"));
  }
  EXPECT_EQ(ask(port, "INCR"), "2");
}

TEST_F(Handshake, RunCapturesAtReadyAndCopiesResumeWithTheirOwnContext) {
  run_capture_and_restore(dir, snap, {cxx_worker()});
}

TEST_F(Handshake, PythonClientDoesTheSame) {
  run_capture_and_restore(dir, snap, {"python3", build_path("tests/handshake_worker.py")});
}

TEST_F(Handshake, WorkloadThatNeverSaysReadyTimesOutAndIsStopped) {
  auto marker = (dir / "never-ready-port").string();
  auto run = gpusnap({"run", "-o", snap.string(), "--ready-timeout", "2", "--", "/usr/bin/env",
                      "GPUSNAP_EXAMPLE_NEVER_READY=1", cxx_worker(), "--ready-file", marker});
  EXPECT_EQ(run.exit_code, 11) << run.err;
  EXPECT_NE(run.err.find("did not say READY within 2 s"), std::string::npos) << run.err;
  EXPECT_FALSE(std::filesystem::exists(snap));
  // gpusnap launched it and it never became capturable: it is gone.
  EXPECT_TRUE(eventually([&] {
    for (const auto& e : std::filesystem::directory_iterator("/proc")) {
      std::string cmdline;
      if (fs::try_read_file(e.path() / "cmdline", &cmdline) &&
          cmdline.find(marker) != std::string::npos) {
        return false;
      }
    }
    return true;
  }));
}

// A worker started by the test (not by gpusnap) that speaks the handshake.
struct HandshakeWorker {
  TempDir& dir;
  std::filesystem::path control;
  std::unique_ptr<Workload> process;
  HandshakeWorker(TempDir& d, const std::string& pause_mode) : dir(d), control(d / "control") {
    std::filesystem::create_directories(control);
    process = std::make_unique<Workload>(
        dir,
        std::vector<std::string>{"/usr/bin/env", "GPUSNAP_CONTROL_DIR=" + control.string(),
                                 "GPUSNAP_EXAMPLE_PAUSE=" + pause_mode, cxx_worker()},
        std::chrono::seconds(30));
    EXPECT_TRUE(eventually([&] { return std::filesystem::exists(control / "ready"); }));
  }
};

TEST_F(Handshake, FailedPauseAbortsTheCaptureAndLeavesTheSourceServing) {
  HandshakeWorker worker(dir, "fail");
  ASSERT_EQ(ask(worker.process->port(), "INCR"), "1");
  auto cp =
      gpusnap({"checkpoint", "-p", std::to_string(worker.process->pid()), "-o", snap.string()});
  EXPECT_EQ(cp.exit_code, 9) << cp.err;
  EXPECT_NE(cp.err.find("answered FAILED to pause: refused by test"), std::string::npos) << cp.err;
  EXPECT_FALSE(std::filesystem::exists(snap));
  EXPECT_EQ(ask(worker.process->port(), "INCR"), "2");
  EXPECT_TRUE(running(worker.process->pid()));
}

// gpusnap killed (SIGKILL: nothing of its own runs) while the workload pauses: the capture's
// guardian resumes the workload once its pause ends, with no gpusnap run afterwards, and
// removes the staging directory.
TEST_F(Handshake, GpusnapKilledDuringThePauseLeavesTheWorkloadServing) {
  HandshakeWorker worker(dir, "slow");  // 3 s to pause
  const uint16_t port = worker.process->port();
  ASSERT_EQ(ask(port, "INCR"), "1");
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(), "checkpoint",  "-p",     std::to_string(worker.process->pid()),
            "-o",          snap.string(), "--quiet"};
  common::Subprocess cp(o);
  ASSERT_TRUE(eventually([&] { return std::filesystem::exists(worker.control / "pause"); }));
  // The workload polls every 20-50 ms: by now it is in its 3 s pause.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  cp.kill(SIGKILL);
  cp.wait();
  // The workload serves on until its pause ends (3 s), pauses, then takes the guardian's
  // resume: it serves again, as the source, with its cache back. Without the guardian it
  // would answer "ERR paused" for ever.
  std::this_thread::sleep_for(std::chrono::milliseconds(3500));
  EXPECT_TRUE(eventually([&] { return ask(port, "PING") == "PONG" && ask(port, "CHECK") == "OK"; },
                         std::chrono::seconds(20)))
      << ask(port, "INFO");
  const auto counter = ask(port, "INCR");
  EXPECT_EQ(counter.find_first_not_of("0123456789"), std::string::npos) << counter;
  const auto info = ask(port, "INFO");
  EXPECT_EQ(field(info, "restored"), "0") << info;
  EXPECT_NE(field(info, "cache_mib"), "0") << info;
  EXPECT_FALSE(std::filesystem::exists(snap));
  EXPECT_TRUE(eventually([&] {
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      if (e.path().filename().string().rfind(".snap", 0) == 0) return false;
    }
    return true;
  })) << "a staging directory was left";
  EXPECT_TRUE(running(worker.process->pid()));
}

// ---- The memory tier's plumbing, with tests/tier_standin.py playing the GPU side ------------

std::vector<std::string> tier_standin(const std::string& extra = "") {
  std::vector<std::string> argv = {"python3", build_path("tests/tier_standin.py"), "--mib", "16"};
  if (!extra.empty()) argv.insert(argv.end(), {"--drain-delay", extra});
  return argv;
}

// The artifact's manifest entries under tier/, by path.
std::map<std::string, uint64_t> tier_files(const std::filesystem::path& artifact) {
  std::map<std::string, uint64_t> out;
  std::string text;
  EXPECT_TRUE(fs::try_read_file(artifact / "manifest.json", &text));
  const json manifest = json::parse(text);  // a named object: the loop refers into it
  for (const auto& f : manifest.at("files")) {
    const auto path = f.at("path").get<std::string>();
    if (path.rfind("tier/", 0) == 0) out[path] = f.at("size").get<uint64_t>();
  }
  return out;
}

bool has_phase(const json& report, const std::string& name) {
  for (const auto& p : report.at("phases")) {
    if (p.at("name") == name) return true;
  }
  return false;
}

// The stand-in (with `extra` arguments) started by `gpusnap run` and captured --leave-running
// into `snap`: the source, killed with its tree at the end, and the port it serves on (0 when
// the run failed, which the EXPECT has reported).
struct StandInRun {
  TreeKiller source;
  uint16_t port = 0;
  json report;  // the run's --json
};
StandInRun run_tier_standin(const TempDir& dir, const std::filesystem::path& snap,
                            const std::vector<std::string>& extra = {}) {
  const auto ready = dir / "port";
  std::vector<std::string> args = {"run", "-o", snap.string(), "--leave-running", "--json", "--"};
  auto worker = tier_standin();
  args.insert(args.end(), worker.begin(), worker.end());
  args.insert(args.end(), extra.begin(), extra.end());
  args.insert(args.end(), {"--ready-file", ready.string()});
  auto run = gpusnap(args);
  EXPECT_EQ(run.exit_code, 0) << run.err;
  if (run.exit_code != 0) return {};
  const json report = json::parse(run.out);
  return {TreeKiller{report["pid"].get<pid_t>()}, read_port(ready), report};
}

// `gpusnap verify` of `snap` (its tier files are checksummed like the rest), then two copies of
// it, each publishing `port` (a restore that fails stops the test).
Copies verify_and_restore_two_copies(const std::filesystem::path& snap, uint16_t port) {
  EXPECT_EQ(gpusnap({"verify", snap.string()}).exit_code, 0);
  return restore(snap, port, {"--replicas", "2"});
}

TEST_F(MemoryTierPlumbing, DrainedIntoTheArtifactChecksummedAndFilledByEachCopy) {
  auto source = run_tier_standin(dir, snap);
  const uint16_t port = source.port;
  ASSERT_NE(port, 0);
  // The source drained into the staging directory and filled back from it before the commit.
  EXPECT_EQ(ask(port, "CHECK"), "OK");
  auto info = ask(port, "INFO");
  EXPECT_EQ(field(info, "drains"), "1") << info;
  EXPECT_EQ(field(info, "fills"), "1") << info;
  EXPECT_NE(field(info, "tier_dir").find(".snap.staging-"), std::string::npos) << info;
  // A source that runs on is not kept paused while its tier's files are hashed: they are read
  // in the checksum phase, after its resume.
  EXPECT_FALSE(has_phase(source.report, "tier-hash")) << source.report.dump();
  // The tier's files are the artifact's: listed, sized, checksummed; nothing else is in tier/.
  const std::string pid = field(info, "pid");
  EXPECT_EQ(
      tier_files(snap),
      (std::map<std::string, uint64_t>{
          {"tier/" + pid + "-w0.img", 16u << 20},
          {"tier/" + pid + ".json", std::filesystem::file_size(snap / "tier" / (pid + ".json"))}}));

  Copies copies = verify_and_restore_two_copies(snap, port);
  ASSERT_EQ(copies.copies.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    // Each copy filled from the artifact itself before it answered RESUMED.
    EXPECT_EQ(ask(copies.port(i), "CHECK"), "OK");
    auto copy_info = ask(copies.port(i), "INFO");
    EXPECT_EQ(field(copy_info, "restored"), "1") << copy_info;
    EXPECT_EQ(field(copy_info, "tier_dir"), (std::filesystem::absolute(snap) / "tier").string())
        << copy_info;
    // Captured after its drain, before the source's own fill: this fill is its first.
    EXPECT_EQ(field(copy_info, "fills"), "1") << copy_info;
  }
}

// A workload of several processes with a tier each (tensor-parallel ranks), one of them
// speaking the handshake for all through gpusnap_handshake.TierGroup: every rank drains its own
// files into the one folder, and every rank of every copy fills from the artifact.
TEST_F(MemoryTierPlumbing, EveryRankOfAWorkloadDrainsAndFillsItsOwnTier) {
  auto source = run_tier_standin(dir, snap, {"--ranks", "3"});
  const uint16_t port = source.port;
  ASSERT_NE(port, 0);
  EXPECT_EQ(ask(port, "CHECK"), "OK ranks=3");
  auto info = ask(port, "INFO");
  EXPECT_EQ(field(info, "rank_fills"), "1,1") << info;  // drained and filled back, like rank 0
  // Three ranks, three pids, each with its image and its index; nothing else.
  std::set<std::string> pids = {field(info, "pid")};
  std::istringstream rank_pids(field(info, "rank_pids"));
  for (std::string p; std::getline(rank_pids, p, ',');) pids.insert(p);
  ASSERT_EQ(pids.size(), 3u) << info;
  std::set<std::string> expected;
  for (const auto& p : pids) expected.insert({"tier/" + p + "-w0.img", "tier/" + p + ".json"});
  std::set<std::string> listed;
  for (const auto& [path, size] : tier_files(snap)) listed.insert(path);
  EXPECT_EQ(listed, expected);

  Copies copies = verify_and_restore_two_copies(snap, port);
  ASSERT_EQ(copies.copies.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(ask(copies.port(i), "CHECK"), "OK ranks=3");
    auto copy_info = ask(copies.port(i), "INFO");
    // Captured after the drain: each rank's fill from the artifact is its first.
    EXPECT_EQ(field(copy_info, "fills"), "1") << copy_info;
    EXPECT_EQ(field(copy_info, "rank_fills"), "1,1") << copy_info;
  }
}

TEST_F(MemoryTierPlumbing, ADamagedTierFileRefusesTheRestore) {
  std::vector<std::string> args = {"run", "-o", snap.string(), "--json", "--"};
  auto worker = tier_standin();
  args.insert(args.end(), worker.begin(), worker.end());
  auto run = gpusnap(args);
  ASSERT_EQ(run.exit_code, 0) << run.err;
  // The source stopped at the end: its tier's files were hashed beside CRIU's dump, and the
  // capture waited for those sums before its seal.
  EXPECT_TRUE(has_phase(json::parse(run.out), "tier-hash")) << run.out;
  const auto files = tier_files(snap);
  ASSERT_EQ(files.size(), 2u);
  const auto image = snap / files.begin()->first;
  {
    common::UniqueFd fd(::open(image.c_str(), O_WRONLY | O_CLOEXEC));
    ASSERT_GE(fd.get(), 0);
    ASSERT_EQ(::pwrite(fd.get(), "x", 1, 4096), 1);
  }
  auto rs = gpusnap({"restore", snap.string(), "--json"});
  EXPECT_EQ(rs.exit_code, 4) << rs.err;  // a bad artifact: no copy ever fills from it
  EXPECT_NE(rs.err.find(files.begin()->first), std::string::npos) << rs.err;
}

// gpusnap killed after the workload's tier has written its files: the guardian has the
// workload fill them back before it removes the staging directory.
TEST_F(MemoryTierPlumbing, GpusnapKilledDuringTheDrainLeavesTheWorkloadWithItsMemory) {
  auto control = dir / "control";
  std::filesystem::create_directories(control);
  auto argv = tier_standin("3");  // files written, then 3 s before the memory is released
  argv.insert(argv.begin(), {"/usr/bin/env", "GPUSNAP_CONTROL_DIR=" + control.string(),
                             "PYTHONPATH=" + build_path("tests")});
  Workload worker(dir, argv, std::chrono::seconds(30));
  ASSERT_TRUE(eventually([&] { return std::filesystem::exists(control / "ready"); }));
  ASSERT_EQ(ask(worker.port(), "CHECK"), "OK");
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(), "checkpoint",  "-p",     std::to_string(worker.pid()),
            "-o",          snap.string(), "--quiet"};
  common::Subprocess cp(o);
  // Killed once the drain's files are there: from then on they may be the only copy.
  ASSERT_TRUE(eventually([&] {
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      if (e.path().filename().string().rfind(".snap.staging-", 0) == 0 &&
          std::filesystem::exists(e.path() / "tier" / (std::to_string(worker.pid()) + ".json"))) {
        return true;
      }
    }
    return false;
  }));
  cp.kill(SIGKILL);
  cp.wait();
  // The drain ends (3 s), the memory is released, PAUSED; the guardian's resume fills it back
  // (until then CHECK answers from memory the drain has not released yet, or "ERR drained").
  EXPECT_TRUE(eventually([&] { return field(ask(worker.port(), "INFO"), "fills") == "1"; },
                         std::chrono::seconds(30)))
      << ask(worker.port(), "INFO");
  EXPECT_EQ(ask(worker.port(), "CHECK"), "OK");
  EXPECT_EQ(field(ask(worker.port(), "INFO"), "drains"), "1");
  EXPECT_TRUE(eventually([&] {
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      if (e.path().filename().string().rfind(".snap", 0) == 0) return false;
    }
    return true;
  })) << "a staging directory was left";
}

// A workload on the memory tier that dies once its tier's files are written (as one whose
// stray GPU work hit the drained memory does): the capture fails at once, not after the
// guardian's wait for a fill from a workload that can no longer answer, and leaves no staging.
TEST_F(MemoryTierPlumbing, AWorkloadThatDiesAfterItsDrainFailsTheCaptureAtOnce) {
  auto control = dir / "control";
  std::filesystem::create_directories(control);
  auto argv = tier_standin();
  argv.insert(argv.begin(), {"/usr/bin/env", "GPUSNAP_CONTROL_DIR=" + control.string(),
                             "PYTHONPATH=" + build_path("tests")});
  argv.push_back("--die-in-drain");
  Workload worker(dir, argv, std::chrono::seconds(30));
  ASSERT_TRUE(eventually([&] { return std::filesystem::exists(control / "ready"); }));
  const auto start = std::chrono::steady_clock::now();
  auto cp = gpusnap({"checkpoint", "-p", std::to_string(worker.pid()), "-o", snap.string()});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(cp.exit_code, 9) << cp.err;
  EXPECT_NE(cp.err.find("exited during pause"), std::string::npos) << cp.err;
  EXPECT_LT(seconds, 30) << cp.err;  // the guardian waited 120 s for an answer before
  EXPECT_FALSE(std::filesystem::exists(snap));
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_NE(e.path().filename().string().rfind(".snap", 0), 0u) << e.path();
  }
}

TEST_F(Handshake, WorkloadDyingDuringThePauseAbortsTheCapture) {
  HandshakeWorker worker(dir, "die");
  auto cp =
      gpusnap({"checkpoint", "-p", std::to_string(worker.process->pid()), "-o", snap.string()});
  EXPECT_EQ(cp.exit_code, 9) << cp.err;
  EXPECT_NE(cp.err.find("exited during pause"), std::string::npos) << cp.err;
  EXPECT_FALSE(std::filesystem::exists(snap));
}

TEST_F(Handshake, CheckpointSaysWhenItCapturesWithoutTheHandshake) {
  start({"--mib", "4"});
  auto cp = capture({"--leave-running"});
  EXPECT_NE(cp.err.find("does not speak the workload handshake"), std::string::npos) << cp.err;
}

// The workloads `gpusnap run` has launched (their folders under /run/gpusnap/launched).
size_t launched() {
  std::error_code ec;
  size_t n = 0;
  for (std::filesystem::directory_iterator it("/run/gpusnap/launched", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++n;
  }
  return n;
}

TEST_F(Handshake, RunRefusesAPreloadLibraryThatIsNotThere) {
  size_t before = launched();
  auto r = common::run_capture({"/usr/bin/env",
                                "GPUSNAP_PRELOAD_LIBRARY=/nonexistent/libgpusnap-preload.so",
                                gpusnap_bin(), "run", "-o", snap.string(), "--", cxx_worker()});
  EXPECT_FALSE(r.status.ok());
  EXPECT_EQ(r.status.code, 2) << r.output;  // a usage error, before anything starts
  EXPECT_NE(r.output.find("GPUSNAP_PRELOAD_LIBRARY names /nonexistent/libgpusnap-preload.so, "
                          "which cannot be read"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(snap));
  EXPECT_EQ(launched(), before);  // no launch directory left behind
}

// `gpusnap run --memory-tier`: a Python workload that speaks the handshake and never calls
// use_memory_tier() gets the tier at its `import torch` (PyTorch's stand-in here, on the
// PYTHONPATH gpusnap was started with, kept after gpusnap's folder), through build/python found
// beside the built gpusnap; the real libgpusnap-tier.so, found beside libgpusnap-preload.so in
// LD_PRELOAD, is the allocator and the tier the client drains (nothing allocated, nothing to drain
// on a CPU). The GPU test is MemoryTier.GpusnapRunInstallsTheTierWithoutTheOneLine.
TEST_F(Handshake, RunWithMemoryTierInstallsTheTierWhenThePythonWorkloadImportsTorch) {
  const auto report_path = dir / "report.json";
  const auto standin = build_path("tests/torch_standin");
  ScopedEnv python_path("PYTHONPATH", standin);
  ScopedEnv torch_log("TORCH_STANDIN_LOG", (dir / "torch.log").string());
  ScopedEnv no_site(engine::kPythonSiteEnv, "");
  auto run = gpusnap({"run", "--memory-tier", "-o", snap.string(), "--json", "--ready-timeout",
                      "30", "--", "python3", build_path("tests/tier_site_probe.py"), "--report",
                      report_path.string()});
  std::string text;
  ASSERT_TRUE(fs::try_read_file(report_path, &text)) << run.err;
  const json report = json::parse(text);
  TreeKiller source{report["pid"].get<pid_t>()};  // a failed capture leaves it running
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const std::string site = build_path("python");
  EXPECT_EQ(report["PYTHONPATH"], site + ":" + standin);
  EXPECT_EQ(report["GPUSNAP_MEMORY_TIER"], "1");
  const std::string library = build_path("libgpusnap-tier.so");
  // Installed once, after torch's own code ran.
  EXPECT_EQ(report["torch_log"],
            json({"import-begin", "import-end", "allocator " + library + " tier_malloc tier_free",
                  "change_current_allocator"}));
  // The client drains and fills that tier, and the workload's gpusnap_handshake is the folder's,
  // though a copy lies beside its script (sys.path[0]): torch was imported first.
  EXPECT_EQ(report["tier_path"], library);
  EXPECT_EQ(report["handshake_file"], site + "/gpusnap_handshake.py");
  EXPECT_TRUE(std::filesystem::exists(build_path("tests/gpusnap_handshake.py")));
  const json doc = json::parse(run.out);
  EXPECT_TRUE(doc["handshake"].get<bool>());
  EXPECT_NE(doc["notes"].dump().find(
                "memory tier: the workload's Python installs it when it imports torch (" + site +
                "/sitecustomize.py;"),
            std::string::npos)
      << doc["notes"];
}

TEST_F(Handshake, RunWithMemoryTierRefusesAMissingPythonSiteFolder) {
  size_t before = launched();
  ScopedEnv site(engine::kPythonSiteEnv, (dir / "no-such-folder").string());
  auto run = gpusnap({"run", "--memory-tier", "-o", snap.string(), "--", "python3", "-c", "1"});
  EXPECT_EQ(run.exit_code, 2) << run.err;  // a usage error, before anything starts
  EXPECT_EQ(run.err, "gpusnap: error: GPUSNAP_PYTHON_SITE names " +
                         (dir / "no-such-folder").string() +
                         ", which holds no readable sitecustomize.py and gpusnap_handshake.py "
                         "(fix: point GPUSNAP_PYTHON_SITE at gpusnap's Python folder (python/ "
                         "beside gpusnap: the build tree's, or /opt/gpusnap/bin/python on a "
                         "node), or run without --memory-tier and call "
                         "gpusnap_handshake.use_memory_tier() in the workload)\n");
  EXPECT_FALSE(std::filesystem::exists(snap));
  EXPECT_EQ(launched(), before);  // no launch directory left behind
}

TEST_F(Handshake, RunRefusesIoUringToTheWorkload) {
  auto run = gpusnap({"run", "-o", snap.string(), "--ready-timeout", "10", "--",
                      build_path("tests/gpusnap-test-workload"), "--io-uring"});
  // The test workload insists on io_uring: under `gpusnap run` the kernel says ENOSYS, as it
  // would where io_uring is absent, and the workload says so.
  EXPECT_EQ(run.exit_code, 9) << run.err;
  EXPECT_NE(run.err.find("exited before it said READY"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("io_uring"), std::string::npos) << run.err;
}

}  // namespace
}  // namespace gpusnap::testing
