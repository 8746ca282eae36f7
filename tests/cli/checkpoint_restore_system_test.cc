// Black-box tests of the built gpusnap CLI with real CRIU on real processes: the test workload
// (tests/workload) is captured, restored as copies in their own namespaces, and asked to prove
// its memory, threads, files, pipe and child are intact.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/proc.h"
#include "testing/capture_restore.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
using CheckpointRestore = CaptureRestoreTest;
using Verify = CaptureRestoreTest;
using BadInput = CaptureRestoreTest;
using Faults = CaptureRestoreTest;

TEST_F(CheckpointRestore, TwoCopiesRunBesideTheSource) {
  auto& source = start(
      {"--mib", "64", "--threads", "4", "--children", "1", "--file", (dir / "data").string()});
  ASSERT_EQ(ask(source.port(), "INCR"), "1");
  std::string seed = field(ask(source.port(), "INFO"), "seed");
  ASSERT_FALSE(seed.empty());

  auto cp_doc = json::parse(capture({"--leave-running", "--json"}).out);
  EXPECT_EQ(cp_doc.at("processes").get<int>(), 2);  // the workload and its child
  EXPECT_TRUE(std::filesystem::exists(snap / "manifest.json"));
  EXPECT_TRUE(running(source.pid()));

  Copies reaper = restore({"--replicas", "2"});
  ASSERT_EQ(reaper.copies.size(), 2u);
  EXPECT_NE(reaper.copies[0].pid, reaper.copies[1].pid);

  for (const auto& c : reaper.copies) {
    EXPECT_TRUE(running(c.pid));
    auto info = ask(c.port, "INFO");
    EXPECT_EQ(field(info, "seed"), seed) << "memory did not come from the snapshot: " << info;
    // Inside its namespace the copy has the source's original pid.
    EXPECT_EQ(field(info, "pid"), std::to_string(source.pid()));
    EXPECT_EQ(ask(c.port, "CHECK").substr(0, 2), "OK");
    // The counter continues from the snapshot's value, independently in each copy.
    EXPECT_EQ(ask(c.port, "INCR"), "2");
    EXPECT_EQ(ask(c.port, "INCR"), "3");
  }
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask(source.port(), "INCR"), "2");
}

TEST_F(CheckpointRestore, WithoutLeaveRunningTheSourceStops) {
  pid_t pid = start({"--mib", "16", "--lock-file", (dir / "lock").string(), "--unlinked",
                     dir.path().string()})
                  .pid();
  capture();
  EXPECT_TRUE(eventually([&] { return !running(pid); }));

  auto vr = gpusnap({"verify", snap.string()});
  EXPECT_EQ(vr.exit_code, 0) << vr.err;

  // The file lock and the unlinked file come back with the copy.
  Copies reaper = restore();
  EXPECT_EQ(ask(reaper.copies[0].port, "CHECK").substr(0, 2), "OK");
}

// A worker whose stdin and stdout are pipes to its parent (Python's subprocess with PIPE): those
// pipes are the tree's own, and a copy keeps them. Only stdio that leads out of the tree (the
// log the test gave the parent) goes to the copy's output.log.
TEST_F(CheckpointRestore, AWorkerPipedToItsParentKeepsItsPipesInTheCopy) {
  auto& source =
      start({"python3", build_path("tests/frameworks.py"), "--framework", "tree", "--cpu"},
            std::chrono::seconds(30));
  auto before = ask(source.port(), "CHECK");
  ASSERT_EQ(before.substr(0, 12), "OK max_err=0") << before;
  capture({"--leave-running"});
  auto manifest = json::parse(fs::read_file(snap / "manifest.json"));
  ASSERT_EQ(manifest["processes"].size(), 2u);
  EXPECT_EQ(manifest["processes"][1]["stdio"].size(), 1u)  // its stderr, the test's log
      << manifest["processes"][1]["stdio"].dump();
  Copies reaper = restore();
  auto after = ask(reaper.copies[0].port, "CHECK");
  EXPECT_EQ(after.substr(0, 12), "OK max_err=0") << after;
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 12), "OK max_err=0");
}

TEST_F(CheckpointRestore, EstablishedConnectionSurvivesTheCapture) {
  auto& source = start({"--mib", "8"});
  // A client connected across the checkpoint: CRIU must dump the established connection and
  // the source must keep serving it afterwards.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(source.port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::write(fd, "PING\n", 5), 5);
  char buf[16] = {};
  ASSERT_EQ(::read(fd, buf, sizeof buf), 5);

  capture({"--leave-running"});
  ASSERT_EQ(::write(fd, "PING\n", 5), 5);
  ASSERT_EQ(::read(fd, buf, sizeof buf), 5);
  EXPECT_EQ(std::string(buf, 5), "PONG\n");
  ::close(fd);

  // The copy restores with the connection closed (its peer is not in the copy's namespace)
  // and serves new ones.
  Copies reaper = restore();
  EXPECT_EQ(ask(reaper.copies[0].port, "PING"), "PONG");
}

TEST_F(CheckpointRestore, InspectShowsTheTree) {
  auto& source = start({"--mib", "8", "--children", "2"});
  capture({"--leave-running"});
  auto human = gpusnap({"inspect", snap.string()});
  ASSERT_EQ(human.exit_code, 0) << human.err;
  EXPECT_NE(human.out.find("processes  3"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("gpusnap-test-workload"), std::string::npos);
  auto doc = json::parse(gpusnap({"inspect", snap.string(), "--json"}).out);
  EXPECT_EQ(doc.at("processes").size(), 3u);
  EXPECT_EQ(doc.at("processes")[0].at("pid").get<pid_t>(), source.pid());
  EXPECT_FALSE(doc.at("host").at("criu_version").get<std::string>().empty());
  EXPECT_GT(doc.at("total_bytes").get<uint64_t>(), 8u << 20);
}

// The largest file of the artifact: CRIU's pages image.
std::filesystem::path largest_file(const std::filesystem::path& dir) {
  std::filesystem::path best;
  uintmax_t size = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file() && e.file_size() > size) {
      size = e.file_size();
      best = e.path();
    }
  }
  return best;
}

void flip_byte(const std::filesystem::path& file, off_t offset) {
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char b;
  ASSERT_EQ(::pread(fd, &b, 1, offset), 1);
  b ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &b, 1, offset), 1);
  ::close(fd);
}

TEST_F(Verify, CatchesOneFlippedByteAndRestoreRefuses) {
  start({"--mib", "16"});
  capture({"--leave-running"});
  auto pages = largest_file(snap);
  flip_byte(pages, static_cast<off_t>(std::filesystem::file_size(pages) / 2));

  auto vr = gpusnap({"verify", snap.string(), "--json"});
  EXPECT_EQ(vr.exit_code, 4);
  auto doc = json::parse(vr.out);
  EXPECT_FALSE(doc.at("ok").get<bool>());
  ASSERT_EQ(doc.at("problems").size(), 1u);
  EXPECT_EQ(doc.at("problems")[0].at("path").get<std::string>(),
            std::filesystem::relative(pages, snap).string());

  auto before = pid_namespaces();
  auto rs = gpusnap({"restore", snap.string()});
  EXPECT_EQ(rs.exit_code, 4);
  EXPECT_NE(rs.err.find("is corrupt"), std::string::npos) << rs.err;
  EXPECT_NE(rs.err.find("checksum mismatch"), std::string::npos) << rs.err;
  EXPECT_TRUE(pid_namespaces_since(before).empty());  // refused before anything started
}

TEST_F(BadInput, EachGetsItsMessageAndExitCode) {
  auto& source = start({"--mib", "4"});
  capture({"--leave-running"});

  auto expect = [](const CliResult& r, int code, const std::string& text) {
    EXPECT_EQ(r.exit_code, code) << r.err;
    EXPECT_NE(r.err.find(text), std::string::npos) << "wanted '" << text << "' in: " << r.err;
    // One line, naming the cause and the fix.
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  expect(gpusnap({"restore", (dir / "nothing").string()}), 3, "does not exist");
  std::filesystem::create_directory(dir / "empty");
  expect(gpusnap({"restore", (dir / "empty").string()}), 4, "has no manifest.json");
  expect(gpusnap({"checkpoint", "-p", "4000000", "-o", (dir / "x").string()}), 3,
         "no process with pid 4000000");
  expect(gpusnap({"checkpoint", "-p", std::to_string(source.pid()), "-o", snap.string()}), 2,
         "already exists");
  expect(gpusnap({"restore", snap.string(), "--bogus"}), 2, "unknown option --bogus");
  expect(gpusnap({"restore", snap.string(), "--replicas", "0"}), 2, "--replicas must be");

  // A copy of the artifact, damaged in one way each.
  auto damaged = [&](const std::string& name, const std::function<void(json&)>& edit) {
    auto copy = dir / name;
    std::filesystem::copy(snap, copy, std::filesystem::copy_options::recursive);
    auto doc = json::parse(fs::read_file(copy / "manifest.json"));
    edit(doc);
    fs::write_file(copy / "manifest.json", doc.dump());
    return copy.string();
  };
  expect(gpusnap({"restore", damaged("foreign", [](json& d) { d["format"] = "tarball"; })}), 4,
         "not a gpusnap artifact");
  expect(gpusnap({"restore", damaged("future", [](json& d) { d["format_version"] = 99; })}), 4,
         "format version 99 is not supported");
  expect(gpusnap({"restore", damaged("arch", [](json& d) { d["host"]["arch"] = "riscv64"; })}), 5,
         "taken on riscv64");
  expect(gpusnap({"restore",
                  damaged("cpu", [](json& d) { d["host"]["cpu_flags"].push_back("avx10_9"); })}),
         5, "lacks instruction sets the source used: avx10_9");
  expect(gpusnap({"restore", damaged("nofield", [](json& d) { d.erase("files"); })}), 4,
         "lacks the field 'files'");
  // A malformed GPU or container section is a bad artifact naming the field, in every command
  // that reads the manifest: never an internal error from the JSON library.
  const auto bad_gpu = damaged("badgpu", [](json& d) { d["gpu"] = "x"; });
  for (const char* command : {"inspect", "restore", "verify"}) {
    SCOPED_TRACE(command);
    expect(gpusnap({command, bad_gpu}), 4,
           "manifest field 'gpu' has the wrong type: expected an object or null, found string");
  }
  expect(gpusnap({"restore", damaged("badcontainer", [](json& d) { d["container"] = 7; })}), 4,
         "manifest field 'container' has the wrong type: expected an object or null, found "
         "number");

  auto truncated = dir / "truncated";
  std::filesystem::copy(snap, truncated, std::filesystem::copy_options::recursive);
  auto pages = largest_file(truncated);
  std::filesystem::resize_file(pages, std::filesystem::file_size(pages) - 1);
  expect(gpusnap({"restore", truncated.string(), "--no-verify"}), 4, "truncated");

  fs::write_file(truncated / "manifest.json", "{not json");
  expect(gpusnap({"inspect", truncated.string()}), 4, "is not valid JSON");
}

TEST_F(BadInput, IoUringIsRefusedBeforeAnythingIsFrozen) {
  try {
    start({"--mib", "4", "--io-uring"});
  } catch (const std::exception& e) {
    GTEST_SKIP() << "skipped: io_uring is disabled on this host";
  }
  auto r = gpusnap({"checkpoint", "-p", std::to_string(source().pid()), "-o", snap.string()});
  EXPECT_EQ(r.exit_code, 6);
  EXPECT_NE(r.err.find("holds an io_uring instance"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("gpusnap run"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "snap"));
  EXPECT_FALSE(std::filesystem::exists(dir / "snap.criu-dump.log"));  // CRIU never ran
  EXPECT_EQ(ask(source().port(), "CHECK").substr(0, 2), "OK");
}

// Every directory entry of `dir` whose name contains `part`.
std::vector<std::string> entries_with(const std::filesystem::path& dir, const std::string& part) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    auto name = e.path().filename().string();
    if (name.find(part) != std::string::npos) out.push_back(name);
  }
  return out;
}

// pids of running criu processes whose command line mentions `needle`.
std::vector<pid_t> criu_processes(const std::string& needle) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    pid_t pid = std::atoi(e.path().filename().c_str());
    if (pid <= 0) continue;
    std::string cmdline;
    if (!fs::try_read_file(e.path() / "cmdline", &cmdline)) continue;
    if (cmdline.find("criu") != std::string::npos && cmdline.find(needle) != std::string::npos) {
      out.push_back(pid);
    }
  }
  return out;
}

TEST_F(Faults, KilledMidCheckpointLeavesSourceRunningAndNoArtifact) {
  auto& source = start({"--mib", "1024", "--threads", "2"});
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(), "checkpoint",  "-p",     std::to_string(source.pid()),
            "-o",          snap.string(), "--quiet"};
  common::Subprocess cp(o);
  // Kill gpusnap while CRIU is dumping (and so has the source frozen).
  ASSERT_TRUE(eventually([&] { return !criu_processes(snap.filename().string()).empty(); },
                         std::chrono::seconds(30)));
  cp.kill(SIGKILL);
  cp.wait();
  // CRIU finishes and resumes the tree; the guardian then removes the staging directory.
  EXPECT_TRUE(eventually([&] { return criu_processes(snap.filename().string()).empty(); },
                         std::chrono::seconds(60)));
  EXPECT_TRUE(eventually([&] { return entries_with(dir.path(), "snap").empty(); }))
      << "left behind: " << entries_with(dir.path(), "snap").front();
  EXPECT_TRUE(running(source.pid()));
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
}

TEST_F(Faults, FailedRestoreLeavesNoProcessOrNamespace) {
  start({"--mib", "8"});
  capture({"--leave-running"});
  // Damage CRIU's view of the process tree in a way only CRIU notices (with --no-verify).
  auto pstree = snap / "criu" / "pstree.img";
  std::filesystem::resize_file(pstree, 0);
  auto doc = json::parse(fs::read_file(snap / "manifest.json"));
  for (auto& f : doc["files"]) {
    if (f["path"] == "criu/pstree.img") f["size"] = 0;
  }
  fs::write_file(snap / "manifest.json", doc.dump());

  auto before = pid_namespaces();
  auto rs = gpusnap({"restore", snap.string(), "--replicas", "2", "--no-verify"});
  EXPECT_EQ(rs.exit_code, 7) << rs.err;
  EXPECT_NE(rs.err.find("failed to restore"), std::string::npos) << rs.err;
  EXPECT_NE(rs.err.find("restore.log"), std::string::npos) << rs.err;
  EXPECT_TRUE(eventually([&] { return pid_namespaces_since(before).empty(); }));
}

TEST_F(Faults, KilledMidRestoreLeavesNoProcessOrNamespace) {
  auto& source = start({"--mib", "1024", "--threads", "2"});
  capture({"--leave-running"});
  auto before = pid_namespaces();
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(), "restore", snap.string(), "--replicas", "2", "--no-verify", "--quiet"};
  common::Subprocess rs(o);
  // CRIU's restore command line names the artifact's image directory.
  auto mine = (snap / "criu").string();
  ASSERT_TRUE(eventually([&] { return !criu_processes(mine).empty(); }, std::chrono::seconds(30)));
  rs.kill(SIGKILL);
  rs.wait();
  EXPECT_TRUE(eventually([&] { return pid_namespaces_since(before).empty(); }))
      << "a copy's namespace outlived the killed restore";
  EXPECT_TRUE(criu_processes(mine).empty());
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
}

}  // namespace
}  // namespace gpusnap::testing
