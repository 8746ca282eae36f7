// System tests of the library's GPU path: gpusnap::checkpoint() and gpusnap::restore() called
// directly, on the real test workload (tests/workload) with real CRIU, with a FakeDriver playing
// the NVIDIA driver. Each test registers the workload's real pids as CUDA processes on a fake
// GPU, then asserts the exact sequence of driver state transitions and the real outcome: which
// processes run, what is on disk, whether the workload's memory and threads are intact.
//
// The copies a restore starts get host pids nobody knows in advance, so the fake does not know
// them either: a restore against a plain fake fails at the GPU restore, which these tests use to
// check that such a failure leaves nothing behind. To restore successfully, a test registers the
// copies' processes with the fake when the "gpu-restore" phase starts (via the Reporter), which
// is where the real driver would first see them, in the CHECKPOINTED state CRIU restored.
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "criu/criu.h"
#include "engine/gpu_state.h"
#include "engine/preflight.h"
#include "gpu/fake_driver.h"
#include "gpusnap/artifact.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

using gpu::FakeDriver;
using gpu::ProcessState;
using nlohmann::json;

constexpr const char* kGpuA = "GPU-0a0a0a0a-1111-2222-3333-444444444444";
constexpr const char* kGpuB = "GPU-0b0b0b0b-5555-6666-7777-888888888888";
constexpr const char* kDriverVersion = "580.159.04";  // FakeDriver's default
constexpr uint64_t kMiB = 1ull << 20;

// Records notes and phases; optionally runs a hook when a phase starts or finishes.
class RecordingReporter : public Reporter {
 public:
  std::function<void(std::string_view phase, bool started)> hook;

  void phase_started(std::string_view name) override {
    {
      std::lock_guard lock(mutex_);
      phases_.emplace_back(name);
    }
    if (hook) hook(name, true);
  }
  void phase_finished(std::string_view name, double) override {
    if (hook) hook(name, false);
  }
  void note(std::string_view text) override {
    std::lock_guard lock(mutex_);
    notes_.emplace_back(text);
  }
  std::vector<std::string> notes() const {
    std::lock_guard lock(mutex_);
    return notes_;
  }
  std::vector<std::string> phases() const {
    std::lock_guard lock(mutex_);
    return phases_;
  }
  bool noted(const std::string& part) const {
    for (const auto& n : notes()) {
      if (n.find(part) != std::string::npos) return true;
    }
    return false;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> notes_;
  std::vector<std::string> phases_;
};

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += (out.empty() ? "" : " | ") + l;
  return "[" + out + "]";
}

std::string call(const char* name, pid_t pid) {
  return std::string(name) + " " + std::to_string(pid);
}

// The expected driver calls: groups in order; inside a group, any order (they run in parallel).
struct Calls {
  std::vector<std::vector<std::string>> groups;
  Calls& then(std::string c) {
    groups.push_back({std::move(c)});
    return *this;
  }
  Calls& any_order(std::vector<std::string> cs) {
    groups.push_back(std::move(cs));
    return *this;
  }
};

::testing::AssertionResult Matches(const std::vector<std::string>& actual, const Calls& want) {
  size_t at = 0;
  for (const auto& group : want.groups) {
    if (at + group.size() > actual.size()) {
      return ::testing::AssertionFailure() << "too few calls: " << join(actual);
    }
    std::vector<std::string> got(actual.begin() + static_cast<long>(at),
                                 actual.begin() + static_cast<long>(at + group.size()));
    auto expected = group;
    std::sort(got.begin(), got.end());
    std::sort(expected.begin(), expected.end());
    if (got != expected) {
      return ::testing::AssertionFailure() << "calls " << at << ".." << at + group.size() - 1
                                           << " should be " << join(group) << " in any order; "
                                           << "all calls: " << join(actual);
    }
    at += group.size();
  }
  if (at != actual.size()) {
    return ::testing::AssertionFailure() << "extra calls after " << at << ": " << join(actual);
  }
  return ::testing::AssertionSuccess();
}

// Where `c` is in `calls` (-1 when absent).
long position(const std::vector<std::string>& calls, const std::string& c) {
  auto it = std::find(calls.begin(), calls.end(), c);
  return it == calls.end() ? -1 : static_cast<long>(it - calls.begin());
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<pid_t> tree_pids(pid_t root) {
  std::vector<pid_t> out;
  for (const auto& p : proc::read_tree(root)) out.push_back(p.pid);
  return out;
}

// Registers `pids` as CUDA processes on GPU kGpuA, the i-th holding (i+1) * 256 MiB.
void register_cuda(FakeDriver& fake, const std::vector<pid_t>& pids) {
  for (size_t i = 0; i < pids.size(); ++i) {
    fake.add_process(pids[i]);
    fake.set_usage(pids[i], kGpuA, (i + 1) * 256 * kMiB);
  }
}

// Processes of restored copies: host pid -> pid inside the copy's namespace, for every process
// one PID namespace down whose inner pid is one of `ns_pids`. With `ours`, only those whose
// ancestors include this test process (the copies' inits are its children).
std::map<pid_t, pid_t> copy_processes(const std::set<pid_t>& ns_pids, bool ours) {
  std::map<pid_t, pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    pid_t pid = std::atoi(e.path().filename().c_str());
    if (pid <= 0) continue;
    try {
      auto p = proc::read_process(pid);
      if (p.nspid.size() != 2 || !ns_pids.count(p.nspid[1])) continue;
      if (p.state == 'Z') continue;
      if (ours) {
        bool found = false;
        pid_t up = p.ppid;
        for (int depth = 0; depth < 8 && up > 1 && !found; ++depth) {
          if (up == ::getpid())
            found = true;
          else
            up = proc::read_process(up).ppid;
        }
        if (!found) continue;
      }
      out[pid] = p.nspid[1];
    } catch (const std::exception&) {
    }
  }
  return out;
}

// Entries of `dir` that are staging directories of the artifact named `name`.
std::vector<std::string> staging_left(const std::filesystem::path& dir, const std::string& name) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    auto n = e.path().filename().string();
    if (n.rfind("." + name + ".staging-", 0) == 0) out.push_back(n);
  }
  return out;
}

bool journal_empty(const std::filesystem::path& run_dir) {
  std::error_code ec;
  auto dir = run_dir / "journal";
  return !std::filesystem::exists(dir) || std::filesystem::is_empty(dir, ec);
}

CheckpointOptions checkpoint_options(pid_t pid, const std::filesystem::path& output,
                                     FakeDriver& fake, const std::filesystem::path& run_dir) {
  CheckpointOptions o;
  o.pid = pid;
  o.output = output;
  o.driver = &fake;
  o.helper_binary = gpusnap_bin();
  o.run_dir = run_dir;
  return o;
}

RestoreOptions restore_options(const std::filesystem::path& artifact, gpu::Driver& driver,
                               const std::filesystem::path& run_dir) {
  RestoreOptions o;
  o.artifact = artifact;
  o.driver = &driver;
  o.helper_binary = gpusnap_bin();
  o.run_dir = run_dir;
  o.timeout = std::chrono::seconds(60);
  return o;
}

// What every test here starts from: a temporary directory, a fake driver with one H200
// (kGpuA), and a reporter; most also a source workload whose processes are CUDA processes on it.
class GpuEngine : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CRIU();
    fake.add_gpu(FakeDriver::make_gpu(kGpuA));
  }

  // Starts the source workload with these arguments; its tree must have `processes`
  // processes, registered as CUDA processes (the i-th holding (i+1) * 256 MiB). Fatal failure
  // otherwise: call it inside ASSERT_NO_FATAL_FAILURE.
  void start_source(std::vector<std::string> args, size_t processes) {
    source_.emplace(dir, std::move(args));
    pids = tree_pids(source_->pid());
    ASSERT_EQ(pids.size(), processes);
    register_cuda(fake, pids);
  }
  const Workload& source() const { return *source_; }

  // A checkpoint of the source into dir/snap, with the fake and dir/run.
  CheckpointOptions source_checkpoint() {
    return checkpoint_options(source().pid(), dir / "snap", fake, dir / "run");
  }
  // Checkpoints the source as source_checkpoint() says; returns its error, if any.
  std::optional<Error> checkpoint_error() {
    return error_of([&] { checkpoint(source_checkpoint(), reporter); });
  }

  // The source, after a failure the capture rolled back: every process RUNNING on the driver
  // and alive, the workload's state intact, no artifact, no staging directory, no journal.
  void expect_source_untouched() {
    for (pid_t pid : pids) {
      EXPECT_EQ(fake.peek_state(pid), ProcessState::kRunning);
      EXPECT_TRUE(running(pid));
    }
    EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
    EXPECT_TRUE(journal_empty(dir / "run"));
    EXPECT_EQ(ask(source().port(), "CHECK").substr(0, 2), "OK");
  }

  TempDir dir;
  FakeDriver fake;
  RecordingReporter reporter;
  std::vector<pid_t> pids;  // the source's tree, in tree order

 private:
  std::optional<Workload> source_;
};

// --- 1. The happy path ---------------------------------------------------------------------------

TEST_F(GpuEngine, LeaveRunningLocksAllThenCheckpointsThenResumesAfterTheDump) {
  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--threads", "2", "--children", "1"}, 2));

  auto o = source_checkpoint();
  o.leave_running = true;
  o.gpu_lock_timeout = std::chrono::milliseconds(4321);
  std::vector<std::string> at_dump_start, at_dump_end;
  reporter.hook = [&](std::string_view phase, bool started) {
    if (phase == "dump") (started ? at_dump_start : at_dump_end) = fake.transitions();
  };
  auto result = checkpoint(o, reporter);

  // Every process locked (in tree order) before any is checkpointed; CRIU dumps them
  // checkpointed; only then does each get its GPU state back and is unlocked.
  auto locked_and_checkpointed =
      Calls()
          .then(call("lock", pids[0]))
          .then(call("lock", pids[1]))
          .any_order({call("checkpoint", pids[0]), call("checkpoint", pids[1])});
  EXPECT_TRUE(Matches(at_dump_start, locked_and_checkpointed));
  EXPECT_TRUE(Matches(at_dump_end, locked_and_checkpointed));
  auto all = fake.transitions();
  EXPECT_TRUE(Matches(all, Calls(locked_and_checkpointed)
                               .any_order({call("restore", pids[0]), call("unlock", pids[0]),
                                           call("restore", pids[1]), call("unlock", pids[1])})));
  for (pid_t pid : pids) {
    EXPECT_LT(position(all, call("restore", pid)), position(all, call("unlock", pid))) << join(all);
  }
  EXPECT_EQ(fake.last_lock_timeout(), std::chrono::milliseconds(4321));

  // The manifest, as returned and as written.
  for (const auto& m : {result.manifest, Artifact::open(dir / "snap").manifest()}) {
    ASSERT_TRUE(m.gpu) << m.to_json().dump();
    const GpuFacts& g = *m.gpu;
    EXPECT_EQ(g.driver_version, kDriverVersion);
    EXPECT_EQ(g.cuda_driver_version, 13000);
    ASSERT_EQ(g.gpus.size(), 1u);
    EXPECT_EQ(g.gpus[0].uuid, kGpuA);
    EXPECT_EQ(g.gpus[0].name, "NVIDIA H200");
    ASSERT_EQ(g.processes.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(g.processes[i].pid, pids[i]);
      EXPECT_EQ(g.processes[i].bytes, (i + 1) * 256 * kMiB);
      ASSERT_EQ(m.processes.size(), 2u);
      EXPECT_EQ(m.processes[i].gpu_bytes, (i + 1) * 256 * kMiB);
    }
  }
  EXPECT_EQ(result.artifact, std::filesystem::absolute(dir / "snap"));
  EXPECT_TRUE(Artifact::open(dir / "snap").verify().empty());
  // `inspect` shows each CUDA process (a rank) with its bytes per GPU.
  auto shown = gpusnap({"inspect", (dir / "snap").string()});
  ASSERT_EQ(shown.exit_code, 0) << shown.err;
  EXPECT_NE(
      shown.out.find("CUDA process 0 (pid " + std::to_string(pids[0]) + "): 256.0 MiB on GPU 0"),
      std::string::npos)
      << shown.out;
  EXPECT_NE(
      shown.out.find("CUDA process 1 (pid " + std::to_string(pids[1]) + "): 512.0 MiB on GPU 0"),
      std::string::npos)
      << shown.out;

  for (pid_t pid : pids) {
    EXPECT_EQ(fake.peek_state(pid), ProcessState::kRunning);
    EXPECT_TRUE(running(pid));
  }
  EXPECT_EQ(ask(source().port(), "CHECK").substr(0, 2), "OK");
  EXPECT_TRUE(journal_empty(dir / "run"));
  // Nothing to report but that the workload does not speak the handshake, and that it was
  // started without the preload library (by the test, not by `gpusnap run`): no GPU rollback.
  ASSERT_EQ(reporter.notes().size(), 2u) << join(reporter.notes());
  EXPECT_NE(reporter.notes()[0].find("does not speak the workload handshake"), std::string::npos);
  EXPECT_EQ(reporter.notes()[1].find("CUDA process " + std::to_string(pids[0]) + ", " +
                                     std::to_string(pids[1]) + " runs without " +
                                     "libgpusnap-preload.so: the driver's checkpoint fills its "
                                     "host memory in one thread"),
            0u)
      << reporter.notes()[1];
}

TEST_F(GpuEngine, WithoutLeaveRunningTheSourceStopsCheckpointedAndARestoreOfUnknownPidsFails) {
  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--children", "1"}, 2));

  auto result = checkpoint(source_checkpoint(), reporter);
  // No restore, no unlock: the source is stopped with its GPU state in the artifact.
  EXPECT_TRUE(Matches(fake.transitions(),
                      Calls()
                          .then(call("lock", pids[0]))
                          .then(call("lock", pids[1]))
                          .any_order({call("checkpoint", pids[0]), call("checkpoint", pids[1])})));
  for (pid_t pid : pids) {
    EXPECT_EQ(fake.peek_state(pid), ProcessState::kCheckpointed);
    EXPECT_TRUE(eventually([&] { return !running(pid); })) << pid << " still runs";
  }
  EXPECT_EQ(result.phases.back().name, "stop");
  EXPECT_TRUE(journal_empty(dir / "run"));

  // The copy's processes have host pids the fake does not know: the GPU restore is attempted
  // on them (not on the source's pids) and fails; nothing of the restore is left.
  fake.clear_calls();
  RecordingReporter restore_reporter;
  auto e = error_of(
      [&] { restore(restore_options(dir / "snap", fake, dir / "run"), restore_reporter); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kGpu) << e->what();
  EXPECT_TRUE(contains(e->what(), "cuCheckpointProcessRestore")) << e->what();
  auto restores = fake.transitions();
  ASSERT_EQ(restores.size(), 2u) << join(restores);  // both processes of the copy, in parallel
  std::vector<pid_t> copy_pids;
  for (const auto& c : restores) {
    EXPECT_TRUE(c.starts_with("restore ")) << c;
    pid_t pid = std::atoi(c.c_str() + 8);
    EXPECT_EQ(std::count(pids.begin(), pids.end(), pid), 0) << "restored the source's pid: " << c;
    copy_pids.push_back(pid);
  }
  // The copy's processes are gone, and with the last of them its namespaces. (Its own
  // processes, not every PID namespace on the host: tests running beside this one make theirs.)
  EXPECT_TRUE(eventually([&] {
    return std::none_of(copy_pids.begin(), copy_pids.end(), [](pid_t p) { return running(p); });
  })) << "a copy's process outlived the failed restore";
  EXPECT_TRUE(copy_processes({pids.begin(), pids.end()}, false).empty());
}

// The real driver first sees a restored copy's processes after CRIU restored them, CHECKPOINTED.
// Registering them with the fake at that moment lets the whole restore run, on real copies.
TEST_F(GpuEngine, RestoreReturnsEveryCopyProcessToRunning) {
  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--children", "1"}, 2));
  auto o = source_checkpoint();
  o.leave_running = true;
  RecordingReporter cp_reporter;
  auto cp = checkpoint(o, cp_reporter);
  fake.clear_calls();

  std::map<pid_t, pid_t> registered;  // host pid -> ns pid
  reporter.hook = [&](std::string_view phase, bool started) {
    if (phase != "gpu-restore" || !started) return;
    registered = copy_processes({pids.begin(), pids.end()}, true);
    for (const auto& [host, ns] : registered) {
      fake.add_process(host, ProcessState::kCheckpointed);
      for (const auto& p : cp.manifest.gpu->processes) {
        if (p.pid == ns) fake.set_usage(host, kGpuA, p.bytes);
      }
    }
  };
  auto ro = restore_options(dir / "snap", fake, dir / "run");
  ro.replicas = 2;
  ro.publish = {PortPublish::parse(std::to_string(source().port()))};
  auto rs = restore(ro, reporter);
  Copies reaper{rs.copies};

  ASSERT_EQ(registered.size(), 4u);  // 2 copies x (workload + child)
  Calls want;
  std::vector<std::string> group;
  for (const auto& [host, ns] : registered) {
    group.push_back(call("restore", host));  // no GPU pairs: the same GPU is here
    group.push_back(call("unlock", host));
  }
  auto all = fake.transitions();
  EXPECT_TRUE(Matches(all, want.any_order(group)));
  for (const auto& [host, ns] : registered) {
    EXPECT_LT(position(all, call("restore", host)), position(all, call("unlock", host)));
    EXPECT_EQ(fake.peek_state(host), ProcessState::kRunning);
  }
  ASSERT_EQ(rs.copies.size(), 2u);
  for (const auto& c : rs.copies) {
    EXPECT_TRUE(registered.count(c.host_pid)) << c.host_pid;
    EXPECT_EQ(c.ns_pid, source().pid());
    ASSERT_EQ(c.ports.size(), 1u);
    EXPECT_EQ(ask(c.ports[0].host_port, "CHECK").substr(0, 2), "OK");
  }
  for (pid_t pid : pids) EXPECT_EQ(fake.peek_state(pid), ProcessState::kRunning);
  EXPECT_EQ(ask(source().port(), "CHECK").substr(0, 2), "OK");
  // The driver is readied beside CRIU's restore and waited for before its restore calls.
  auto phases = reporter.phases();
  auto at = [&](const char* name) { return std::find(phases.begin(), phases.end(), name); };
  ASSERT_NE(at("gpu-init"), phases.end());
  EXPECT_LT(at("criu-restore"), at("gpu-init"));
  EXPECT_LT(at("gpu-init"), at("gpu-restore"));
}

// --- 2-4. A GPU phase fails mid-way: every process is put back --------------------------------

TEST_F(GpuEngine, LockTimeoutOnTheSecondOfThreeUnlocksTheFirst) {
  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--children", "2"}, 3));
  fake.time_out_next_lock(pids[1]);

  auto e = checkpoint_error();
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kTimeout) << e->what();
  EXPECT_TRUE(contains(e->what(), "cuCheckpointProcessLock(pid " + std::to_string(pids[1]) +
                                      ") failed: the lock timed out"))
      << e->what();
  EXPECT_TRUE(contains(e->what(), "unlocked process " + std::to_string(pids[0]))) << e->what();
  EXPECT_FALSE(contains(e->what(), "unlocked process " + std::to_string(pids[1]))) << e->what();
  EXPECT_TRUE(Matches(fake.transitions(), Calls()
                                              .then(call("lock", pids[0]))
                                              .then(call("lock", pids[1]))
                                              .then(call("unlock", pids[0]))));
  expect_source_untouched();
  EXPECT_TRUE(staging_left(dir.path(), "snap").empty()) << staging_left(dir.path(), "snap")[0];
}

TEST_F(GpuEngine, CheckpointFailingLockedIsUnlockedAndTheCheckpointedOneRestored) {
  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--children", "1"}, 2));
  fake.fail_next("checkpoint", pids[1], ProcessState::kLocked);

  auto e = checkpoint_error();
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kGpu) << e->what();
  EXPECT_TRUE(contains(e->what(), "cuCheckpointProcessCheckpoint(pid " + std::to_string(pids[1])))
      << e->what();
  EXPECT_TRUE(contains(e->what(), "restored the GPU state of process " + std::to_string(pids[0])))
      << e->what();
  EXPECT_TRUE(contains(e->what(), "unlocked process " + std::to_string(pids[0]))) << e->what();
  EXPECT_TRUE(contains(e->what(), "unlocked process " + std::to_string(pids[1]))) << e->what();
  EXPECT_TRUE(Matches(fake.transitions(),
                      Calls()
                          .then(call("lock", pids[0]))
                          .then(call("lock", pids[1]))
                          .any_order({call("checkpoint", pids[0]), call("checkpoint", pids[1])})
                          .then(call("restore", pids[0]))
                          .then(call("unlock", pids[0]))
                          .then(call("unlock", pids[1]))));
  expect_source_untouched();
  EXPECT_TRUE(staging_left(dir.path(), "snap").empty());
}

TEST_F(GpuEngine, ProcessMarkedFailedIsKilledAndTheOthersResume) {
  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--children", "1"}, 2));
  pid_t root = pids[0], child = pids[1];
  fake.fail_next("checkpoint", child, ProcessState::kFailed);

  auto e = checkpoint_error();
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kGpu) << e->what();
  EXPECT_TRUE(contains(e->what(), "process " + std::to_string(child) +
                                      " was marked FAILED by the driver and has been killed"))
      << e->what();
  EXPECT_TRUE(Matches(fake.transitions(),
                      Calls()
                          .then(call("lock", root))
                          .then(call("lock", child))
                          .any_order({call("checkpoint", root), call("checkpoint", child)})
                          .then(call("restore", root))
                          .then(call("unlock", root))));
  EXPECT_EQ(fake.peek_state(root), ProcessState::kRunning);
  EXPECT_EQ(fake.peek_state(child), ProcessState::kFailed);
  EXPECT_TRUE(eventually([&] { return !running(child); })) << "the FAILED process still runs";
  EXPECT_TRUE(running(root));
  EXPECT_EQ(ask(source().port(), "PING"), "PONG");
  EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
  EXPECT_TRUE(staging_left(dir.path(), "snap").empty());
  EXPECT_TRUE(journal_empty(dir / "run"));
}

// With --leave-running, a restore that fails while giving the source its GPU state back: the
// rollback retries it, the source runs on, and no artifact appears.
TEST_F(GpuEngine, ResumeFailingAfterTheDumpIsRetriedAndNoArtifactAppears) {
  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--children", "1"}, 2));
  fake.fail_next("restore", pids[1]);  // stays CHECKPOINTED
  auto o = source_checkpoint();
  o.leave_running = true;
  auto e = error_of([&] { checkpoint(o, reporter); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kGpu) << e->what();
  EXPECT_TRUE(contains(e->what(), "restored the GPU state of process " + std::to_string(pids[1])))
      << e->what();
  EXPECT_TRUE(Matches(
      fake.transitions(),
      Calls()
          .then(call("lock", pids[0]))
          .then(call("lock", pids[1]))
          .any_order({call("checkpoint", pids[0]), call("checkpoint", pids[1])})
          .any_order({call("restore", pids[0]), call("unlock", pids[0]), call("restore", pids[1])})
          .then(call("restore", pids[1]))
          .then(call("unlock", pids[1]))));
  expect_source_untouched();
  EXPECT_TRUE(eventually([&] { return staging_left(dir.path(), "snap").empty(); }));
}

// A process another checkpoint holds LOCKED (a second gpusnap on the same tree) must be left
// alone: the capture refuses before locking anything, and never unlocks what it did not lock.
TEST_F(GpuEngine, RollbackLeavesAloneAProcessItDidNotMove) {
  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--children", "1"}, 2));
  fake.lock(pids[1], std::chrono::seconds(1));  // held by someone else
  fake.clear_calls();

  auto e = checkpoint_error();
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kGpu) << e->what();
  EXPECT_NE(std::string(e->what()).find("is LOCKED, not RUNNING"), std::string::npos) << e->what();
  EXPECT_TRUE(fake.transitions().empty());
  EXPECT_EQ(fake.peek_state(pids[0]), ProcessState::kRunning);
  EXPECT_EQ(fake.peek_state(pids[1]), ProcessState::kLocked) << "unlocked under its owner";
}

// Two checkpoints in one process (a library user such as an agent, checkpointing two workloads
// at once) keep one journal entry each: the second finishing must not remove the first's.
TEST_F(GpuEngine, TwoCheckpointsInOneProcessKeepTheirOwnJournal) {
  Workload first(dir, {"--mib", "4", "--children", "0"});
  Workload second(dir, {"--mib", "4", "--children", "0"});
  register_cuda(fake, {first.pid()});
  register_cuda(fake, {second.pid()});
  auto run_dir = dir / "run";

  // While the first checkpoint dumps (its process CHECKPOINTED), a second one runs to the end.
  std::vector<pid_t> journaled_during_first;
  reporter.hook = [&](std::string_view phase, bool started) {
    if (phase != "dump" || !started) return;
    auto o2 = checkpoint_options(second.pid(), dir / "snap2", fake, run_dir);
    o2.leave_running = true;
    RecordingReporter r2;
    checkpoint(o2, r2);
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(run_dir / "journal", ec)) {
      for (pid_t p : json::parse(fs::read_file(e.path())).at("pids").get<std::vector<pid_t>>()) {
        journaled_during_first.push_back(p);
      }
    }
  };
  auto o1 = checkpoint_options(first.pid(), dir / "snap1", fake, run_dir);
  o1.leave_running = true;
  checkpoint(o1, reporter);
  EXPECT_EQ(journaled_during_first, std::vector<pid_t>{first.pid()})
      << "the first checkpoint's processes were CHECKPOINTED with no journal entry naming them";
}

// --- 5. Refused before any GPU call; CRIU failing after the GPU phases -------------------------

TEST_F(GpuEngine, IoUringIsRefusedBeforeAnyDriverCall) {
  std::unique_ptr<Workload> source;
  try {
    source = std::make_unique<Workload>(
        dir, std::vector<std::string>{"--mib", "4", "--children", "0", "--io-uring"});
  } catch (const std::exception&) {
    GTEST_SKIP() << "skipped: io_uring is disabled on this host";
  }
  register_cuda(fake, tree_pids(source->pid()));
  auto e = error_of([&] {
    checkpoint(checkpoint_options(source->pid(), dir / "snap", fake, dir / "run"), reporter);
  });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kNotCapturable) << e->what();
  EXPECT_TRUE(contains(e->what(), "io_uring")) << e->what();
  EXPECT_TRUE(fake.calls().empty()) << join(fake.calls());
  EXPECT_EQ(fake.peek_state(source->pid()), ProcessState::kRunning);
  EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
  EXPECT_TRUE(staging_left(dir.path(), "snap").empty());
  EXPECT_EQ(ask(source->port(), "CHECK").substr(0, 2), "OK");
}

// A capture of `source`, registered as a CUDA process holding `bytes` on kGpuA; its error.
std::optional<Error> capture_holding(FakeDriver& fake, Workload& source, uint64_t bytes,
                                     const std::filesystem::path& output,
                                     const std::filesystem::path& run_dir) {
  fake.add_process(source.pid());
  fake.set_usage(source.pid(), kGpuA, bytes);
  RecordingReporter reporter;
  return error_of(
      [&] { checkpoint(checkpoint_options(source.pid(), output, fake, run_dir), reporter); });
}

// What must hold after a refusal for want of room: nothing was asked of the driver but facts,
// nothing is at the output, the workload runs on.
void expect_refused_untouched(const Error& e, FakeDriver& fake, Workload& source,
                              const std::filesystem::path& out) {
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment) << e.what();
  EXPECT_EQ(e.exit_code(), 10);
  EXPECT_TRUE(fake.transitions().empty()) << join(fake.calls());
  EXPECT_EQ(fake.peek_state(source.pid()), ProcessState::kRunning);
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_TRUE(staging_left(out.parent_path(), out.filename().string()).empty());
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
}

TEST(GpuCapture, AStoreTooSmallForTheGpuMemoryIsRefusedBeforeAnythingIsFrozen) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir, {"--mib", "4", "--children", "0"});
  auto store = dir / "store";
  std::filesystem::create_directory(store);
  ASSERT_EQ(::mount("gpusnap-test", store.c_str(), "tmpfs", 0, "size=16m"), 0);
  FakeDriver fake;
  fake.add_gpu(FakeDriver::make_gpu(kGpuA));
  auto e = capture_holding(fake, source, 64 * kMiB, store / "snap", dir / "run");
  ASSERT_TRUE(e);
  // The numbers: what the artifact needs, of which GPU memory, and what the store has.
  EXPECT_TRUE(contains(e->what(), "the artifact needs up to ")) << e->what();
  EXPECT_TRUE(contains(e->what(), "(64.0 MiB of GPU memory + ")) << e->what();
  EXPECT_TRUE(contains(e->what(), store.string() + " has ")) << e->what();
  EXPECT_TRUE(contains(e->what(), " free")) << e->what();
  EXPECT_TRUE(contains(e->hint(), "-o")) << e->hint();
  expect_refused_untouched(*e, fake, source, store / "snap");
  ::umount2(store.c_str(), MNT_DETACH);
}

TEST(GpuCapture, GpuMemoryBeyondTheHostsAvailableMemoryIsRefusedBeforeAnythingIsFrozen) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir, {"--mib", "4", "--children", "0"});
  std::string meminfo = fs::read_file("/proc/meminfo");
  const uint64_t available = engine::memory_available(meminfo);
  ASSERT_GT(available, 0u);
  // A GPU larger than this host's memory, its process holding twice what is available: without
  // the preload library the driver's checkpoint would need all of it in the process.
  FakeDriver fake;
  fake.add_gpu(FakeDriver::make_gpu(kGpuA, "NVIDIA H200", 4 * available));
  auto e = capture_holding(fake, source, 2 * available, dir / "snap", dir / "run");
  ASSERT_TRUE(e);
  EXPECT_TRUE(contains(e->what(), "the capture needs ")) << e->what();
  EXPECT_TRUE(contains(e->what(), fs::human_bytes(2 * available) +
                                      " of GPU memory the driver's checkpoint puts in the "
                                      "processes' own memory"))
      << e->what();
  EXPECT_TRUE(contains(e->what(), " available (MemAvailable)")) << e->what();
  EXPECT_TRUE(contains(e->hint(), "libgpusnap-preload.so")) << e->hint();
  expect_refused_untouched(*e, fake, source, dir / "snap");
}

TEST_F(GpuEngine, CriuDumpFailingAfterTheGpuCheckpointResumesTheGpuState) {
  // A CRIU whose dump fails (after writing an error to its log); everything else is the real one.
  auto script = dir / "criu-failing-dump";
  fs::write_file(script, "#!/bin/sh\n"
                         "if [ \"$1\" = dump ]; then\n"
                         "  log=; prev=\n"
                         "  for a in \"$@\"; do\n"
                         "    [ \"$prev\" = --log-file ] && log=$a\n"
                         "    prev=$a\n"
                         "  done\n"
                         "  echo '(00.000100) Error (criu/cr-dump.c:2100): fake-criu refused "
                         "the dump' >> \"$log\"\n"
                         "  exit 1\n"
                         "fi\n"
                         "exec '" +
                             criu::locate().path + "' \"$@\"\n");
  std::filesystem::permissions(script, std::filesystem::perms::owner_all);

  ASSERT_NO_FATAL_FAILURE(start_source({"--mib", "8", "--children", "1"}, 2));
  auto o = source_checkpoint();
  o.criu_path = script.string();
  o.leave_running = true;
  auto e = error_of([&] { checkpoint(o, reporter); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kCriu) << e->what();
  EXPECT_TRUE(contains(e->what(), "fake-criu refused the dump")) << e->what();
  EXPECT_TRUE(Matches(fake.transitions(),
                      Calls()
                          .then(call("lock", pids[0]))
                          .then(call("lock", pids[1]))
                          .any_order({call("checkpoint", pids[0]), call("checkpoint", pids[1])})
                          .then(call("restore", pids[0]))
                          .then(call("unlock", pids[0]))
                          .then(call("restore", pids[1]))
                          .then(call("unlock", pids[1]))));
  for (pid_t pid : pids) {
    EXPECT_EQ(fake.peek_state(pid), ProcessState::kRunning);
    EXPECT_TRUE(running(pid));
    EXPECT_TRUE(reporter.noted("restored the GPU state of process " + std::to_string(pid)))
        << join(reporter.notes());
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
  EXPECT_TRUE(eventually([&] { return staging_left(dir.path(), "snap").empty(); }));
  auto kept_log = dir / "snap.criu-dump.log";
  ASSERT_TRUE(std::filesystem::exists(kept_log));
  EXPECT_TRUE(contains(fs::read_file(kept_log), "fake-criu refused the dump"));
  EXPECT_TRUE(journal_empty(dir / "run"));
  EXPECT_EQ(ask(source().port(), "CHECK").substr(0, 2), "OK");
}

// --- 6. Restore refusals, before any copy starts ------------------------------------------------

TEST_F(GpuEngine, RestoreRefusesWhatThisHostsGpusCannotTake) {
  ASSERT_NO_FATAL_FAILURE(
      start_source({"--mib", "8", "--children", "1"}, 2));  // 256 + 512 MiB of GPU memory on kGpuA
  auto cpo = source_checkpoint();
  cpo.leave_running = true;
  RecordingReporter cp_reporter;
  checkpoint(cpo, cp_reporter);

  auto before = pid_namespaces();
  auto run_dir = dir / "restore-run";
  // Each refusal: its kind and message, and no copy was started.
  auto refused = [&](gpu::Driver& driver, ErrorKind kind, std::vector<std::string> parts,
                     int replicas = 1, std::vector<std::string> map = {}) {
    auto o = restore_options(dir / "snap", driver, run_dir);
    o.replicas = replicas;
    o.gpu_map = std::move(map);
    RecordingReporter reporter;
    auto e = error_of([&] { restore(o, reporter); });
    if (!e) {
      ADD_FAILURE() << "restore was not refused";
      return;
    }
    EXPECT_EQ(e->kind(), kind) << e->what();
    for (const auto& p : parts) EXPECT_TRUE(contains(e->what(), p)) << e->what();
    EXPECT_FALSE(std::filesystem::exists(run_dir / "copies")) << "a copy was started";
    EXPECT_TRUE(pid_namespaces_since(before).empty());
    auto phases = reporter.phases();
    EXPECT_EQ(std::count(phases.begin(), phases.end(), "criu-restore"), 0);
  };

  {
    SCOPED_TRACE("no driver");
    FakeDriver none;
    none.set_unavailable("libcuda.so.1: cannot open shared object file");
    refused(none, ErrorKind::kEnvironment, {"holds GPU state", "libcuda.so.1: cannot open"});
  }
  {
    SCOPED_TRACE("another driver version");
    FakeDriver other;
    other.set_versions("570.86.15", 12080);
    other.add_gpu(FakeDriver::make_gpu(kGpuA));
    refused(other, ErrorKind::kIncompatible, {kDriverVersion, "570.86.15"});
  }
  {
    SCOPED_TRACE("same GPU uuid, another model");
    FakeDriver other;
    other.add_gpu(FakeDriver::make_gpu(kGpuA, "NVIDIA A100-SXM4-80GB"));
    refused(other, ErrorKind::kIncompatible, {"NVIDIA H200", "NVIDIA A100-SXM4-80GB"});
  }
  {
    SCOPED_TRACE("another GPU of another model");
    FakeDriver other;
    other.add_gpu(FakeDriver::make_gpu(kGpuB, "NVIDIA A100-SXM4-80GB"));
    refused(other, ErrorKind::kIncompatible, {"of model NVIDIA H200", kGpuA});
  }
  {
    SCOPED_TRACE("not enough free memory for 3 copies");
    FakeDriver small;
    small.add_gpu(FakeDriver::make_gpu(kGpuA));
    small.set_free_memory(kGpuA, 2048 * kMiB);  // 3 x 768 MiB needed
    refused(small, ErrorKind::kIncompatible, {kGpuA, "free", "3 copy(ies)"}, 3);
  }
  {
    SCOPED_TRACE("--gpu-map entries naming unknown GPUs");
    FakeDriver other;
    other.add_gpu(FakeDriver::make_gpu(kGpuA));
    refused(other, ErrorKind::kUsage, {"no GPU '" + std::string(kGpuB) + "' on this host"}, 1,
            {std::string(kGpuA) + "=" + kGpuB});
    refused(other, ErrorKind::kUsage, {"no GPU '" + std::string(kGpuB) + "' in the artifact"}, 1,
            {std::string(kGpuB) + "=0"});
    refused(other, ErrorKind::kUsage, {"expected OLD=NEW"}, 1, {kGpuA});
  }
  EXPECT_TRUE(fake.peek_state(pids[0]) == ProcessState::kRunning);

  {
    SCOPED_TRACE("automatic remap onto a GPU of the same model");
    FakeDriver other;
    other.add_gpu(FakeDriver::make_gpu(kGpuB));
    RecordingReporter reporter;
    auto e = error_of([&] { restore(restore_options(dir / "snap", other, run_dir), reporter); });
    ASSERT_TRUE(e);
    // The copy's pids are unknown to this fake: the remapped restore is attempted, then fails.
    EXPECT_EQ(e->kind(), ErrorKind::kGpu) << e->what();
    EXPECT_TRUE(reporter.noted(std::string("GPU ") + kGpuA + " maps to " + kGpuB))
        << join(reporter.notes());
    auto restores = other.transitions();
    ASSERT_EQ(restores.size(), 2u) << join(restores);
    for (const auto& c : restores) {
      EXPECT_TRUE(c.starts_with("restore ")) << c;
      EXPECT_TRUE(c.ends_with(std::string(" ") + kGpuA + "->" + kGpuB)) << c;
      pid_t pid = std::atoi(c.c_str() + 8);
      EXPECT_EQ(std::count(pids.begin(), pids.end(), pid), 0) << "the source's pid: " << c;
    }
    EXPECT_TRUE(eventually([&] { return pid_namespaces_since(before).empty(); }))
        << "a copy's namespace outlived the failed restore";
    EXPECT_TRUE(copy_processes({pids.begin(), pids.end()}, false).empty());
  }
  for (pid_t pid : pids) EXPECT_EQ(fake.peek_state(pid), ProcessState::kRunning);
  EXPECT_EQ(ask(source().port(), "CHECK").substr(0, 2), "OK");
}

TEST_F(GpuEngine, GpuMapOnACpuOnlyArtifactIsAUsageError) {
  Workload cpu_only(dir, {"--mib", "4", "--children", "0"});  // not registered: no CUDA
  auto cpo = checkpoint_options(cpu_only.pid(), dir / "snap", fake, dir / "run");
  cpo.leave_running = true;
  RecordingReporter cp_reporter;
  auto cp = checkpoint(cpo, cp_reporter);
  EXPECT_FALSE(cp.manifest.gpu) << cp.manifest.to_json().dump();
  EXPECT_TRUE(fake.calls().empty()) << join(fake.calls());
  auto phases = cp_reporter.phases();
  EXPECT_EQ(std::count(phases.begin(), phases.end(), "gpu-lock"), 0);

  auto before = pid_namespaces();
  auto o = restore_options(dir / "snap", fake, dir / "restore-run");
  o.gpu_map = {"0=0"};
  auto e = error_of([&] { restore(o, reporter); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kUsage) << e->what();
  EXPECT_TRUE(contains(e->what(), "holds no GPU state")) << e->what();
  EXPECT_FALSE(std::filesystem::exists(dir / "restore-run" / "copies"));
  EXPECT_TRUE(pid_namespaces_since(before).empty());
  EXPECT_TRUE(fake.calls().empty()) << join(fake.calls());
}

// --- 7. Journal recovery
// --------------------------------------------------------------------------

common::Subprocess sleeper() {
  common::SpawnOptions o;
  o.argv = {"/bin/sleep", "120"};
  return common::Subprocess(o);
}

void write_journal(const std::filesystem::path& run_dir, pid_t owner,
                   const std::vector<pid_t>& pids) {
  std::filesystem::create_directories(run_dir / "journal");
  fs::write_file(run_dir / "journal" / (std::to_string(owner) + ".json"),
                 json{{"owner", owner}, {"pids", pids}}.dump());
}

TEST_F(GpuEngine, JournalOfAKilledGpusnapIsRecoveredAndALiveOnesIsLeftAlone) {
  auto run_dir = dir / "run";
  common::Subprocess locked = sleeper(), checkpointed = sleeper(), busy = sleeper();
  pid_t gone = dead_pid();  // a process of the journal that exited meanwhile
  fake.add_process(locked.pid(), ProcessState::kLocked);
  fake.add_process(checkpointed.pid(), ProcessState::kCheckpointed);
  fake.add_process(busy.pid(), ProcessState::kLocked);
  fake.add_process(gone, ProcessState::kLocked);

  pid_t killed_owner = dead_pid();
  write_journal(run_dir, killed_owner, {locked.pid(), checkpointed.pid(), gone});
  write_journal(run_dir, ::getpid(), {busy.pid()});  // its owner is alive: still at work

  auto lines = engine::recover_abandoned(fake, run_dir);
  auto l = [](const std::string& s) { return "recovered after a killed gpusnap: " + s; };
  std::vector<std::string> want = {
      l("unlocked process " + std::to_string(locked.pid())),
      l("restored the GPU state of process " + std::to_string(checkpointed.pid())),
      l("unlocked process " + std::to_string(checkpointed.pid())),
  };
  EXPECT_EQ(lines, want) << join(lines);
  EXPECT_TRUE(Matches(fake.transitions(), Calls()
                                              .then(call("unlock", locked.pid()))
                                              .then(call("restore", checkpointed.pid()))
                                              .then(call("unlock", checkpointed.pid()))));
  EXPECT_EQ(fake.peek_state(locked.pid()), ProcessState::kRunning);
  EXPECT_EQ(fake.peek_state(checkpointed.pid()), ProcessState::kRunning);
  EXPECT_EQ(fake.peek_state(busy.pid()), ProcessState::kLocked);
  EXPECT_EQ(fake.peek_state(gone), ProcessState::kLocked);  // not a process any more: skipped
  EXPECT_FALSE(
      std::filesystem::exists(run_dir / "journal" / (std::to_string(killed_owner) + ".json")));
  EXPECT_TRUE(
      std::filesystem::exists(run_dir / "journal" / (std::to_string(::getpid()) + ".json")));
  EXPECT_TRUE(running(locked.pid()) && running(checkpointed.pid()) && running(busy.pid()));

  // The library entry points recover first thing, and tell the reporter.
  std::filesystem::remove(run_dir / "journal" / (std::to_string(::getpid()) + ".json"));
  write_journal(run_dir, dead_pid(), {busy.pid()});
  fake.clear_calls();
  auto e = error_of([&] { restore(restore_options(dir / "nothing", fake, run_dir), reporter); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kNotFound) << e->what();
  EXPECT_EQ(reporter.notes(),
            std::vector<std::string>{l("unlocked process " + std::to_string(busy.pid()))});
  EXPECT_EQ(fake.peek_state(busy.pid()), ProcessState::kRunning);
  EXPECT_TRUE(journal_empty(run_dir));
}

// --- 8. A process dies, or its GPU state is lost, between the freeze and the commit -----------
// What JAX with preallocation does on the H200: a thread faults once the driver's checkpoint has
// taken the GPU memory and CRIU has thawed the tree. No artifact of it may be committed, and the
// source must not be stopped by gpusnap.

// A workload and its child, both CUDA processes on the fake GPU.
struct CudaTree {
  TempDir dir;
  Workload source{dir, {"--mib", "8", "--children", "1"}};
  std::vector<pid_t> pids = tree_pids(source.pid());
  pid_t root = pids.at(0);
  pid_t child = pids.at(1);
  FakeDriver fake;
  CudaTree() {
    fake.add_gpu(FakeDriver::make_gpu(kGpuA));
    register_cuda(fake, pids);
  }
};

TEST(GpuCapture, AProcessThatDiesAfterTheDumpFailsTheCaptureNamingHowAndNothingIsCommitted) {
  SKIP_WITHOUT_CRIU();
  CudaTree t;
  auto& [dir, source, pids, root, child, fake] = t;

  RecordingReporter reporter;
  reporter.hook = [&](std::string_view phase, bool started) {
    if (phase == "dump" && !started) ::kill(child, SIGSEGV);  // its parent leaves it a zombie
  };
  auto e = error_of([&] {
    checkpoint(checkpoint_options(source.pid(), dir / "snap", fake, dir / "run"), reporter);
  });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kNotCapturable) << e->what();
  EXPECT_TRUE(contains(e->what(), "process " + std::to_string(child) +
                                      " (tw-child) was killed by SIGSEGV during the capture"))
      << e->what();
  EXPECT_TRUE(contains(e->what(), "nothing was committed")) << e->what();
  EXPECT_TRUE(contains(e->hint(), "docs/compatibility.md")) << e->hint();
  EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
  EXPECT_TRUE(staging_left(dir.path(), "snap").empty());
  // Not stopped: the root lives, its GPU state given back.
  EXPECT_TRUE(running(root));
  EXPECT_EQ(fake.peek_state(root), ProcessState::kRunning);
  EXPECT_TRUE(journal_empty(dir / "run"));
}

TEST(GpuCapture, WithLeaveRunningADeathShowingAsADriverErrorIsNamedAsTheDeath) {
  SKIP_WITHOUT_CRIU();
  CudaTree t;
  auto& [dir, source, pids, root, child, fake] = t;

  auto o = checkpoint_options(source.pid(), dir / "snap", fake, dir / "run");
  o.leave_running = true;
  RecordingReporter reporter;
  reporter.hook = [&](std::string_view phase, bool started) {
    if (phase == "dump" && !started) {
      ::kill(child, SIGSEGV);
      fake.remove_process(child);  // the driver forgets a process that exited
    }
  };
  auto e = error_of([&] { checkpoint(o, reporter); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kNotCapturable) << e->what();
  EXPECT_TRUE(
      contains(e->what(), "process " + std::to_string(child) + " (tw-child) was killed by SIGSEGV"))
      << e->what();
  // The driver's complaint that first showed it is kept.
  EXPECT_TRUE(contains(e->what(), "(then: cuCheckpointProcessRestore(pid " + std::to_string(child)))
      << e->what();
  EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
  EXPECT_TRUE(running(root));
  EXPECT_EQ(fake.peek_state(root), ProcessState::kRunning);
}

TEST(GpuCapture, GpuStateTheDriverLostAfterTheDumpFailsTheCapture) {
  SKIP_WITHOUT_CRIU();
  CudaTree t;
  auto& [dir, source, pids, root, child, fake] = t;

  RecordingReporter reporter;
  reporter.hook = [&](std::string_view phase, bool started) {
    // The driver marks the child FAILED while CRIU's dump runs.
    if (phase == "dump" && !started) fake.add_process(child, ProcessState::kFailed);
  };
  auto e = error_of([&] {
    checkpoint(checkpoint_options(source.pid(), dir / "snap", fake, dir / "run"), reporter);
  });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->kind(), ErrorKind::kGpu) << e->what();
  EXPECT_TRUE(contains(e->what(), "the driver reports process " + std::to_string(child) +
                                      "'s GPU state FAILED after the dump, not CHECKPOINTED"))
      << e->what();
  EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
  EXPECT_TRUE(staging_left(dir.path(), "snap").empty());
  EXPECT_TRUE(running(root));
  EXPECT_EQ(fake.peek_state(root), ProcessState::kRunning);
}

// A process that looks like JAX on the GPU: jaxlib's library in its maps (here a copy of a
// harmless library, preloaded under that name) and the fake driver taking it for a CUDA process.
std::vector<std::string> jax_like_workload(const TempDir& dir, const std::string& preallocate) {
  auto lib = dir / "site-packages" / "jaxlib" / "_jax.so";
  std::filesystem::create_directories(lib.parent_path());
  std::filesystem::copy_file(build_path("libgpusnap-preload.so"), lib,
                             std::filesystem::copy_options::overwrite_existing);
  std::vector<std::string> argv = {"/usr/bin/env", "-u", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                   "LD_PRELOAD=" + lib.string()};
  if (!preallocate.empty()) argv.push_back("XLA_PYTHON_CLIENT_PREALLOCATE=" + preallocate);
  argv.insert(argv.end(), {build_path("tests/gpusnap-test-workload"), "--mib", "8"});
  return argv;
}

TEST(GpuCapture, JaxWithPreallocationIsRefusedBeforeAnythingIsFrozen) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir, jax_like_workload(dir, ""), std::chrono::seconds(30));
  ASSERT_TRUE(maps_file(source.pid(), "jaxlib/_jax.so"));
  FakeDriver fake;
  fake.add_gpu(FakeDriver::make_gpu(kGpuA));
  register_cuda(fake, {source.pid()});

  RecordingReporter reporter;
  auto e = error_of([&] {
    checkpoint(checkpoint_options(source.pid(), dir / "snap", fake, dir / "run"), reporter);
  });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->exit_code(), 6) << e->what();
  EXPECT_EQ(std::string(e->what()),
            "process " + std::to_string(source.pid()) +
                " (gpusnap-test-wo) runs JAX/XLA on the GPU with XLA's preallocation on "
                "(XLA_PYTHON_CLIENT_PREALLOCATE is unset): it dies of SIGSEGV inside libcuda once "
                "the driver's checkpoint takes its GPU memory, and its artifact would not restore");
  EXPECT_TRUE(contains(e->hint(), "XLA_PYTHON_CLIENT_PREALLOCATE=false")) << e->hint();
  // Refused in the preflight: not a single driver call that changes a state, nothing written.
  EXPECT_TRUE(fake.transitions().empty()) << join(fake.transitions());
  EXPECT_EQ(reporter.phases(), (std::vector<std::string>{"resolve", "preflight"}));
  EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
}

TEST(GpuCapture, JaxWithPreallocationOffIsCaptured) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Workload source(dir, jax_like_workload(dir, "false"), std::chrono::seconds(30));
  FakeDriver fake;
  fake.add_gpu(FakeDriver::make_gpu(kGpuA));
  register_cuda(fake, {source.pid()});
  auto o = checkpoint_options(source.pid(), dir / "snap", fake, dir / "run");
  o.leave_running = true;
  RecordingReporter reporter;
  checkpoint(o, reporter);
  EXPECT_TRUE(Artifact::open(dir / "snap").verify().empty());
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
}

}  // namespace
}  // namespace gpusnap::testing
