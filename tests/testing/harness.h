// Helpers for the system tests: real processes, real CRIU, the real CLI. Nothing here fakes a
// component; it only starts them and talks to them.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/subprocess.h"

namespace gpusnap::testing {

// A scratch directory removed at the end of the test.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& leaf) const { return path_ / leaf; }

 private:
  std::filesystem::path path_;
};

// Whether this machine can run the system tests (root and a working CRIU); the reason if not.
std::optional<std::string> system_test_blocker();

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
  std::optional<Subprocess> process_;
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

// Kills a restored copy (its namespace init) and waits until it is gone.
void end_copy(pid_t init_pid);

// Whether a process is running (exists, not stopped, not a zombie).
bool running(pid_t pid);

}  // namespace gpusnap::testing
