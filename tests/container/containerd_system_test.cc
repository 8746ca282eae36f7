// Containers as a Kubernetes node runs them: containerd (Debian's, started by the test with its
// own root, state and socket) runs them from an image the test builds and imports into the
// kubelet's namespace, through the runc v2 shim. gpusnap is given container IDs only: it finds
// the shim's runc root itself, captures the source while it runs and restores into a
// placeholder container that containerd started; containerd keeps reporting both correctly.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "testing/containerd.h"
#include "testing/containers.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
namespace stdfs = std::filesystem;

// Where the runc v2 shim keeps the kubelet's containers.
const std::string kShimRoot = "/run/containerd/runc/k8s.io";

class ContainerdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = containerd_blocker()) GTEST_SKIP() << "skipped: " << *why;
    containerd_.emplace(dir_ / "containerd");
    if (auto why = containerd_->failure()) GTEST_SKIP() << "skipped: " << *why;
  }

  std::unique_ptr<ManagedContainer> start(const std::string& name,
                                          const std::vector<std::string>& args) {
    auto c = std::make_unique<ManagedContainer>(*containerd_, prefix_ + name, args);
    EXPECT_TRUE(c->started()) << "ctr run " << name << ": " << c->start_output();
    return c;
  }
  // The source, serving: its first INCR answered 1.
  std::unique_ptr<ManagedContainer> start_source(
      std::vector<std::string> args = shimmed_workload()) {
    auto source = start("source", args);
    EXPECT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }))
        << "the workload did not answer in its container";
    EXPECT_EQ(ask_in(source->pid(), "INCR"), "1");
    return source;
  }
  // By ID alone: no --runtime-root.
  CliResult checkpoint(const std::string& id, const stdfs::path& out) {
    return gpusnap(
        {"checkpoint", "--container", id, "-o", out.string(), "--leave-running", "--json"});
  }
  CliResult restore(const stdfs::path& snap, const std::string& id) {
    return gpusnap({"restore", snap.string(), "--into-container", id, "--run-dir",
                    (dir_ / "run").string(), "--json"});
  }
  static std::string error_message(const CliResult& r) {
    try {
      return json::parse(r.out).at("error").at("message").get<std::string>();
    } catch (const json::exception&) {
      return "(no JSON error: " + r.out + r.err + ")";
    }
  }
  // The source still runs as before: containerd lists it with its pid, and it serves, not frozen.
  void expect_source_running(const ManagedContainer& source, const std::string& incr) {
    EXPECT_EQ(source.status(), "RUNNING");
    EXPECT_EQ(source.listed_pid(), source.pid());
    EXPECT_EQ(ask_in(source.pid(), "INCR"), incr);
  }

  TempDir dir_;
  std::optional<Containerd> containerd_;
  std::string prefix_ = "gpusnap-test-" + fs::random_id().substr(0, 6) + "-";
};

TEST_F(ContainerdTest, CapturesByIdAndRestoresIntoAPlaceholderContainerdStarted) {
  auto source = start_source();
  auto seed = field(ask_in(source->pid(), "INFO"), "seed");

  auto snap = dir_ / "snap";
  auto cp = checkpoint(source->id(), snap);
  ASSERT_EQ(cp.exit_code, 0) << cp.out << cp.err;
  EXPECT_EQ(json::parse(cp.out).at("processes").get<int>(), 2);
  auto manifest = json::parse(fs::read_file(snap / "manifest.json"));
  EXPECT_EQ(manifest.at("container").at("runtime_root"), kShimRoot);
  EXPECT_EQ(manifest.at("container").at("id"), source->id());
  // The root filesystem is containerd's snapshot of the image, mounted for the task.
  EXPECT_NE(manifest.at("container")
                .at("rootfs")
                .get<std::string>()
                .find("io.containerd.runtime.v2.task/k8s.io/" + source->id()),
            std::string::npos)
      << manifest.at("container").dump();
  expect_source_running(*source, "2");

  auto placeholder = start("placeholder", placeholder_args());
  auto rs = restore(snap, placeholder->id());
  ASSERT_EQ(rs.exit_code, 0) << rs.out << rs.err;
  auto restored = restored_into(rs.out, placeholder->pid());  // in the placeholder's namespaces
  // Asked inside the placeholder's network namespace: the snapshot's memory, counting on.
  EXPECT_EQ(field(ask_in(placeholder->pid(), "INFO"), "seed"), seed);
  EXPECT_EQ(ask_in(placeholder->pid(), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask_in(placeholder->pid(), "INCR"), "2");

  // containerd reports both tasks as they are: running, each with its own PID 1.
  EXPECT_EQ(placeholder->status(), "RUNNING");
  EXPECT_EQ(placeholder->listed_pid(), placeholder->pid());
  expect_source_running(*source, "3");

  // Stopping the placeholder through containerd (SIGTERM to its PID 1) ends the workload.
  auto kill = containerd_->ctr({"task", "kill", placeholder->id()});
  ASSERT_TRUE(kill.status.ok()) << kill.output;
  EXPECT_TRUE(eventually([&] { return placeholder->status() == "STOPPED"; }))
      << placeholder->status();
  EXPECT_FALSE(running(restored));
  expect_source_running(*source, "4");
}

TEST_F(ContainerdTest, RefusesAnIdThatIsNotThereAndOneInTwoRoots) {
  auto source = start_source();
  auto out = dir_ / "snap";

  auto missing = checkpoint(prefix_ + "nosuch", out);
  EXPECT_EQ(missing.exit_code, 3) << missing.out << missing.err;
  auto message = error_message(missing);
  EXPECT_EQ(message.rfind("container " + prefix_ +
                              "nosuch was not found in the runtime roots "
                              "searched (",
                          0),
            0u)
      << message;
  EXPECT_NE(message.find(kShimRoot), std::string::npos) << message;
  auto bad = checkpoint("../k8s.io", out);
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(error_message(bad), "'../k8s.io' is not a container id");

  // The same ID under bare runc's root too (as on a node running two runtimes): gpusnap names
  // both roots instead of guessing.
  Container twin("/run/runc", source->id(), make_bundle(dir_ / "twin", placeholder_args()));
  ASSERT_TRUE(twin.started());
  auto ambiguous = checkpoint(source->id(), out);
  EXPECT_EQ(ambiguous.exit_code, 2);
  EXPECT_EQ(error_message(ambiguous),
            "container " + source->id() + " is in 2 runtime roots (/run/runc, " + kShimRoot + ")");
  EXPECT_FALSE(stdfs::exists(out));
  // --runtime-root picks one.
  auto picked = gpusnap({"checkpoint", "--container", source->id(), "--runtime-root", kShimRoot,
                         "-o", out.string(), "--leave-running", "--json"});
  EXPECT_EQ(picked.exit_code, 0) << picked.out << picked.err;
  expect_source_running(*source, "2");
}

// The pid of a running `criu dump`, 0 if none.
pid_t criu_dump() {
  for (const auto& entry : stdfs::directory_iterator("/proc")) {
    std::string cmdline;
    if (!fs::try_read_file(entry.path() / "cmdline", &cmdline)) continue;
    if (cmdline.find("criu") != std::string::npos &&
        cmdline.find(std::string("\0dump\0", 6)) != std::string::npos) {
      return static_cast<pid_t>(std::stol(entry.path().filename().string()));
    }
  }
  return 0;
}

TEST_F(ContainerdTest, ContainerdRestartedDuringACaptureLosesNothing) {
  // Enough memory that CRIU is still dumping when containerd goes.
  auto args = shimmed_workload();
  args[std::find(args.begin(), args.end(), "--mib") - args.begin() + 1] = "768";
  auto source = start_source(args);

  auto snap = dir_ / "snap";
  auto log = dir_ / "checkpoint.out";
  common::UniqueFd out(::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(), "checkpoint",  "--container",     source->id(),
            "-o",          snap.string(), "--leave-running", "--json"};
  o.stdout_fd = out.get();
  o.stderr_fd = out.get();
  common::Subprocess capture(o);
  ASSERT_TRUE(eventually([] { return criu_dump() != 0; }, std::chrono::seconds(60)))
      << fs::read_file(log);
  containerd_->kill(/*start_again=*/false);
  EXPECT_FALSE(capture.poll().has_value()) << "the capture ended before containerd did";
  containerd_->kill(/*start_again=*/true);
  ASSERT_FALSE(containerd_->failure()) << *containerd_->failure();

  // containerd is not on the capture's path (the shim and runc's state are): it completes.
  auto status = capture.wait(std::chrono::minutes(3));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->ok()) << fs::read_file(log);
  EXPECT_TRUE(stdfs::exists(snap / "manifest.json"));
  // The restarted containerd still knows the source as running, with its pid; it serves.
  expect_source_running(*source, "2");
  // And the snapshot restores into a placeholder the restarted containerd starts.
  auto placeholder = start("placeholder", placeholder_args());
  auto rs = restore(snap, placeholder->id());
  ASSERT_EQ(rs.exit_code, 0) << rs.out << rs.err;
  EXPECT_EQ(ask_in(placeholder->pid(), "INCR"), "2");
}

TEST_F(ContainerdTest, APlaceholderThatExitedIsRefusedAndTheSnapshotKept) {
  auto source = start_source();
  auto snap = dir_ / "snap";
  ASSERT_EQ(checkpoint(source->id(), snap).exit_code, 0);

  auto gone = start("gone", placeholder_args());
  auto kill = containerd_->ctr({"task", "kill", "-s", "SIGKILL", gone->id()});
  ASSERT_TRUE(kill.status.ok()) << kill.output;
  ASSERT_TRUE(eventually([&] { return gone->status() == "STOPPED"; }));
  auto refused = restore(snap, gone->id());
  EXPECT_EQ(refused.exit_code, 3) << refused.out << refused.err;
  EXPECT_EQ(error_message(refused),
            "container " + gone->id() + " (runc root " + kShimRoot + ") is stopped, not running");
  // Deleted by containerd: then it is not there at all.
  ASSERT_TRUE(containerd_->ctr({"task", "delete", gone->id()}).status.ok());
  auto deleted = restore(snap, gone->id());
  EXPECT_EQ(deleted.exit_code, 3);
  EXPECT_EQ(error_message(deleted).rfind("container " + gone->id() + " was not found", 0), 0u)
      << error_message(deleted);

  // Nothing was lost: the snapshot restores into a placeholder that waits; the source runs.
  auto placeholder = start("placeholder", placeholder_args());
  auto rs = restore(snap, placeholder->id());
  ASSERT_EQ(rs.exit_code, 0) << rs.out << rs.err;
  EXPECT_EQ(ask_in(placeholder->pid(), "INCR"), "2");
  expect_source_running(*source, "2");
}

}  // namespace
}  // namespace gpusnap::testing
