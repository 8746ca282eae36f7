#include "testing/capture_restore.h"

#include <stdexcept>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/fs.h"

namespace gpusnap::testing {

namespace {

// The command line as one string, for a message.
std::string joined(const std::vector<std::string>& args) {
  std::string out = "gpusnap";
  for (const auto& a : args) out += " " + a;
  return out;
}

CliResult succeeded(const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  auto r = gpusnap(args, timeout);
  if (r.exit_code != 0) {
    throw std::runtime_error(joined(args) + " exited " + std::to_string(r.exit_code) + ": " +
                             r.err + r.out);
  }
  return r;
}

}  // namespace

CliResult capture(pid_t pid, const std::filesystem::path& out, const std::vector<std::string>& args,
                  std::chrono::milliseconds timeout) {
  std::vector<std::string> argv = {"checkpoint", "--pid", std::to_string(pid), "-o", out.string()};
  argv.insert(argv.end(), args.begin(), args.end());
  return succeeded(argv, timeout);
}

Copies restore(const std::filesystem::path& artifact, uint16_t port,
               const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  std::vector<std::string> argv = {"restore", artifact.string(), "--publish", std::to_string(port),
                                   "--json"};
  argv.insert(argv.end(), args.begin(), args.end());
  return Copies{nlohmann::json::parse(succeeded(argv, timeout).out)};
}

void CaptureRestoreTest::SetUp() { SKIP_WITHOUT_CRIU(); }

Workload& CaptureRestoreTest::start(std::vector<std::string> extra_args) {
  return source_.emplace(dir, std::move(extra_args));
}

Workload& CaptureRestoreTest::start(std::vector<std::string> argv,
                                    std::chrono::seconds ready_within) {
  return source_.emplace(dir, std::move(argv), ready_within);
}

Workload& CaptureRestoreTest::source() {
  if (!source_) throw std::logic_error("no source workload: start() it first");
  return *source_;
}

CliResult CaptureRestoreTest::capture(const std::vector<std::string>& args,
                                      std::chrono::milliseconds timeout) {
  try {
    return testing::capture(source().pid(), snap, args, timeout);
  } catch (const std::runtime_error& e) {
    std::string log;
    (void)fs::try_read_file(dir / "workload.log", &log);
    throw std::runtime_error(std::string(e.what()) + "\nworkload.log:\n" + log);
  }
}

Copies CaptureRestoreTest::restore(const std::vector<std::string>& args,
                                   std::chrono::milliseconds timeout) {
  return testing::restore(snap, source().port(), args, timeout);
}

}  // namespace gpusnap::testing
