// Helpers for the system tests: real processes, real CRIU, the real CLI. Nothing here fakes a
// component; it only starts them and talks to them.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "common/subprocess.h"
#include "gpusnap/phases.h"
#include "gpusnap/restore.h"
#include "testing/unit.h"  // TempDir, error_of, catch_error, Contains, write, dead_pid

namespace gpusnap::testing {

// Whether this machine can run the system tests (root and a working CRIU); the reason if not.
std::optional<std::string> system_test_blocker();

// Skips the test, reporting "skipped: WHY", when `blocker` (an std::optional<std::string>) holds
// the reason it cannot run here.
#define GPUSNAP_SKIP_IF_BLOCKED(blocker)                           \
  do {                                                             \
    if (auto why = (blocker)) GTEST_SKIP() << "skipped: " << *why; \
  } while (0)

// Skips the test where there is no root or no working CRIU.
#define SKIP_WITHOUT_CRIU() GPUSNAP_SKIP_IF_BLOCKED(::gpusnap::testing::system_test_blocker())

// Paths of built programs, found from the test binary's own location (build/tests/), so the
// build tree can be copied to another machine (the GPU machine) and run there.
std::string build_path(const std::string& relative);
std::string gpusnap_bin();

// A workload that speaks the tests' line protocol and writes its port to --ready-file,
// started in its own session with its output in DIR/workload.log.
class Workload {
 public:
  // The test workload (tests/workload) with these extra arguments.
  Workload(const TempDir& dir, std::vector<std::string> extra_args = {});
  // Any program; "--ready-file PATH" is appended to argv.
  Workload(const TempDir& dir, std::vector<std::string> argv, std::chrono::seconds ready_within);
  ~Workload();
  pid_t pid() const { return pid_; }
  uint16_t port() const { return port_; }
  void kill_tree();

 private:
  std::optional<common::Subprocess> process_;
  pid_t pid_ = 0;
  uint16_t port_ = 0;
};

// One request/reply line on 127.0.0.1:port; "" when the connection fails.
std::string ask(uint16_t port, const std::string& line,
                std::chrono::milliseconds timeout = std::chrono::seconds(10));

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
// Runs the built gpusnap binary.
CliResult gpusnap(const std::vector<std::string>& args,
                  std::chrono::milliseconds timeout = std::chrono::minutes(3));

// Whether process `pid` maps a file whose path ends with `name` (e.g. "libgpusnap-preload.so").
bool maps_file(pid_t pid, const std::string& name);

// The value of `key` in a workload reply of the form "key=value key2=value2"; "" if absent.
std::string field(const std::string& reply, const std::string& key);

// Whether `pred` becomes true within `limit`, asking every 20 ms (and once more at the end).
template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(15)) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// Stops its own process (SIGKILL) when the phase named starts: a gpusnap killed there.
class KillAt final : public Reporter {
 public:
  explicit KillAt(std::string phase) : phase_(std::move(phase)) {}
  void phase_started(std::string_view name) override {
    if (name == phase_) ::raise(SIGKILL);
  }
  void phase_finished(std::string_view, double) override {}
  void note(std::string_view) override {}

 private:
  std::string phase_;
};

// The PID namespaces of every process on the host (their /proc/PID/ns/pid links).
std::set<std::string> pid_namespaces();
// Those of pid_namespaces() that `before` did not hold: what a command made and left. One that
// ended since `before` is no matter (unit tests running beside may end theirs meanwhile).
std::set<std::string> pid_namespaces_since(const std::set<std::string>& before);

// Kills a restored copy (its namespace init) and waits until it is gone or a zombie (every
// process of its namespace has then exited); an init that is a child of this process (restore()
// called in-process) is reaped as well.
void end_copy(pid_t init_pid);

// Whether a process is running (exists, not stopped, not a zombie).
bool running(pid_t pid);

// One restored copy: its root process and namespace init (host pids), its first published port
// (0 if none).
struct RestoredCopy {
  pid_t pid = 0;
  pid_t init_pid = 0;
  uint16_t port = 0;
};

// The copies a restore started, ended (end_copy) whatever the test's outcome.
class Copies {
 public:
  // From `gpusnap restore --json`'s output.
  explicit Copies(nlohmann::json restore_json);
  // From gpusnap::restore()'s result.
  explicit Copies(const std::vector<CopyInfo>& restored);
  Copies(const Copies&) = delete;
  Copies& operator=(const Copies&) = delete;
  ~Copies();

  // The first published port of copy `i`.
  uint16_t port(size_t i) const { return copies.at(i).port; }

  nlohmann::json doc;  // the JSON it came from (null for restore()'s result)
  std::vector<RestoredCopy> copies;
};

}  // namespace gpusnap::testing
