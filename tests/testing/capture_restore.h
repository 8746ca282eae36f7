// The setup the CLI and GPU system tests repeat, said once: a scratch folder, a source workload
// started in it, its capture by the built CLI into DIR/snap, and copies restored from it that
// end with the test. A capture or a restore that should succeed and does not stops the test
// with gpusnap's own message; one expected to fail is run with gpusnap() and its exit checked.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "testing/harness.h"

namespace gpusnap::testing {

// `gpusnap checkpoint --pid PID -o OUT ARGS...`, which must exit 0: its result, or an exception
// (the test fails with gpusnap's stderr and the workload's log) when it does not.
CliResult capture(pid_t pid, const std::filesystem::path& out,
                  const std::vector<std::string>& args = {},
                  std::chrono::milliseconds timeout = std::chrono::minutes(3));

// `gpusnap restore ARTIFACT --publish PORT --json ARGS...`, which must exit 0: its copies, ended
// when the result goes, or an exception as for capture().
Copies restore(const std::filesystem::path& artifact, uint16_t port,
               const std::vector<std::string>& args = {},
               std::chrono::milliseconds timeout = std::chrono::minutes(3));

// The fixture of the tests that capture one source workload and restore copies of it. Skips
// the test where the system tests cannot run (no root, no working CRIU).
class CaptureRestoreTest : public ::testing::Test {
 protected:
  void SetUp() override;

  // Starts the source: the test workload with these extra arguments, or any program that
  // writes its port to --ready-file within `ready_within`.
  Workload& start(std::vector<std::string> extra_args = {});
  Workload& start(std::vector<std::string> argv, std::chrono::seconds ready_within);
  // The source started; an exception before start().
  Workload& source();

  // capture() of the source into `snap`.
  CliResult capture(const std::vector<std::string>& args = {},
                    std::chrono::milliseconds timeout = std::chrono::minutes(3));
  // restore() of `snap`, publishing the source's port.
  Copies restore(const std::vector<std::string>& args = {},
                 std::chrono::milliseconds timeout = std::chrono::minutes(3));
  // The same of another process or artifact (the functions above, which the names in a test's
  // body would otherwise hide).
  static CliResult capture(pid_t pid, const std::filesystem::path& out,
                           const std::vector<std::string>& args = {},
                           std::chrono::milliseconds timeout = std::chrono::minutes(3)) {
    return testing::capture(pid, out, args, timeout);
  }
  static Copies restore(const std::filesystem::path& artifact, uint16_t port,
                        const std::vector<std::string>& args = {},
                        std::chrono::milliseconds timeout = std::chrono::minutes(3)) {
    return testing::restore(artifact, port, args, timeout);
  }

  TempDir dir;
  const std::filesystem::path snap = dir / "snap";

 private:
  std::optional<Workload> source_;  // ended before `dir` is removed
};

}  // namespace gpusnap::testing
