// CRIU's command lines, its log, its version and where it is found. No CRIU is needed: the
// binaries these tests locate are small shell scripts that print what CRIU would.
#include "criu/criu.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap::criu {
namespace {

using namespace gpusnap::testing;  // testing/unit.h

namespace stdfs = std::filesystem;
using Strings = std::vector<std::string>;

size_t count(const Strings& args, const std::string& arg) {
  return static_cast<size_t>(std::count(args.begin(), args.end(), arg));
}

// The argument right after `flag`, or "<absent>".
std::string value_of(const Strings& args, const std::string& flag) {
  auto it = std::find(args.begin(), args.end(), flag);
  if (it == args.end() || it + 1 == args.end()) return "<absent>";
  return *(it + 1);
}

TEST(CriuVersionTest, AtLeast) {
  for (const char* v : {"4.2", "4.2.1", "4.3", "4.10", "5.0", "5", "10.1"}) {
    EXPECT_TRUE(version_at_least(v, 4, 2)) << v;
  }
  for (const char* v : {"4.1.1", "4.1", "4", "3.17", "3.99.9", "", "four.two", "v4.2"}) {
    EXPECT_FALSE(version_at_least(v, 4, 2)) << v;
  }
  EXPECT_TRUE(version_at_least("4.1", 4, 1));
  EXPECT_TRUE(version_at_least("0.0", 0, 0));
}

TEST(CriuVersionTest, ParsesMajorAndMinorFromTheStart) {
  struct Case {
    const char* text;
    int major;
    int minor;
  };
  for (const Case& c : {Case{"4.2.1", 4, 2}, Case{" 4.3", 4, 3}, Case{"5", 5, 0}, Case{"4.", 4, 0},
                        Case{"4.x", 4, 0}, Case{"10.17-rc1", 10, 17}}) {
    const auto v = parse_version(c.text);
    ASSERT_TRUE(v.has_value()) << c.text;
    EXPECT_EQ(v->major, c.major) << c.text;
    EXPECT_EQ(v->minor, c.minor) << c.text;
  }
  // Text that does not start with a number, and a number too large for an int (an artifact's
  // manifest is outside input): no version.
  for (const char* text : {"", "   ", "v4.2", "four", "-", "99999999999.1"}) {
    EXPECT_FALSE(parse_version(text).has_value()) << text;
  }
}

TEST(CriuArgsTest, DumpKeepsTheSourceRunningAndCapturesServerState) {
  const Binary criu{"/opt/gpusnap/criu/criu", "4.2"};
  DumpOptions o;
  o.pid = 4242;
  o.images = "/tmp/snap/criu";
  o.log = "/tmp/snap/dump.log";
  o.ghost_limit = 1 << 20;
  const Strings args = dump_args(criu, o);
  ASSERT_GE(args.size(), 2u);
  EXPECT_EQ(args[0], "/opt/gpusnap/criu/criu");
  EXPECT_EQ(args[1], "dump");
  EXPECT_EQ(value_of(args, "--tree"), "4242");
  EXPECT_EQ(value_of(args, "--images-dir"), "/tmp/snap/criu");
  EXPECT_EQ(value_of(args, "--log-file"), "/tmp/snap/dump.log");
  EXPECT_EQ(value_of(args, "--ghost-limit"), "1048576");
  for (const char* flag :
       {"--leave-running", "--tcp-established", "--ext-unix-sk", "--file-locks", "-v4"}) {
    EXPECT_EQ(count(args, flag), 1u) << flag;
  }
  EXPECT_EQ(count(args, "--shell-job"), 0u);
  EXPECT_EQ(count(args, "--tcp-close"), 0u) << "the source keeps its connections";
}

TEST(CriuArgsTest, DumpShellJobOnlyWhenAsked) {
  DumpOptions o;
  o.pid = 7;
  o.shell_job = true;
  const Strings args = dump_args(Binary{"criu", "4.2"}, o);
  EXPECT_EQ(count(args, "--shell-job"), 1u);
  EXPECT_EQ(value_of(args, "--tree"), "7");
}

TEST(CriuArgsTest, DumpNamesEachExternalFile) {
  DumpOptions o;
  o.pid = 7;
  o.external_files = {"file[2a:1f3]", "file[2a:1f4]"};
  const Strings args = dump_args(Binary{"criu", "4.2"}, o);
  EXPECT_EQ(count(args, "--external"), 2u);
  auto first = std::find(args.begin(), args.end(), "--external");
  ASSERT_NE(first, args.end());
  EXPECT_EQ(*(first + 1), "file[2a:1f3]");
  EXPECT_EQ(args.back(), "file[2a:1f4]");
}

TEST(CriuArgsTest, RestoreDetachesKeepsConnectionsAndInheritsFds) {
  RestoreOptions o;
  o.images = "/a/criu";
  o.log = "/run/gpusnap/1/restore.log";
  o.pidfile = "/run/gpusnap/1/pid";
  o.inherit = {{10, "tmp/x.log"}, {11, "pipe:[77]"}};
  const Strings args = restore_args(Binary{"/usr/sbin/criu", "4.2"}, o);
  ASSERT_GE(args.size(), 2u);
  EXPECT_EQ(args[0], "/usr/sbin/criu");
  EXPECT_EQ(args[1], "restore");
  EXPECT_EQ(value_of(args, "--images-dir"), "/a/criu");
  EXPECT_EQ(value_of(args, "--log-file"), "/run/gpusnap/1/restore.log");
  EXPECT_EQ(value_of(args, "--pidfile"), "/run/gpusnap/1/pid");
  // Connections within the tree come back (--tcp-established); outside peers are absent in
  // the copy's network namespace and reset the connection themselves.
  for (const char* flag : {"--restore-detached", "--restore-sibling", "--tcp-established",
                           "--ext-unix-sk", "--file-locks"}) {
    EXPECT_EQ(count(args, flag), 1u) << flag;
  }
  EXPECT_EQ(count(args, "--tcp-close"), 0u);
  EXPECT_EQ(count(args, "--shell-job"), 0u);
  // Each --inherit-fd is followed by its "fd[N]:KEY", in the order given.
  Strings inherit;
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--inherit-fd") inherit.push_back(args[i + 1]);
  }
  EXPECT_EQ(inherit, (Strings{"fd[10]:tmp/x.log", "fd[11]:pipe:[77]"}));
  EXPECT_EQ(args.back(), "fd[11]:pipe:[77]");
}

TEST(CriuArgsTest, RestoreIntoAPlaceholderLeavesTheRootToItsInitAndTheCgroupsAlone) {
  RestoreOptions o;
  o.images = "/a/criu";
  o.log = "/run/gpusnap/1/restore.log";
  o.pidfile = "/run/gpusnap/1/pid";
  o.sibling = false;
  o.keep_cgroups = true;
  const Strings args = restore_args(Binary{"/usr/sbin/criu", "4.2"}, o);
  EXPECT_EQ(count(args, "--restore-sibling"), 0u);
  EXPECT_EQ(count(args, "--restore-detached"), 1u);
  EXPECT_EQ(count(args, "--manage-cgroups=ignore"), 1u);
  EXPECT_EQ(count(restore_args(Binary{"/usr/sbin/criu", "4.2"}, RestoreOptions{}),
                  "--manage-cgroups=ignore"),
            0u);
}

TEST(CriuArgsTest, RestoreWithoutInheritAndWithShellJob) {
  RestoreOptions o;
  o.shell_job = true;
  const Strings args = restore_args(Binary{"criu", "4.2"}, o);
  EXPECT_EQ(count(args, "--inherit-fd"), 0u);
  EXPECT_EQ(count(args, "--shell-job"), 1u);
}

TEST(CriuInheritKeyTest, MapsProcTargetsToCriuKeys) {
  EXPECT_EQ(inherit_key("/dev/null"), "");
  EXPECT_EQ(inherit_key(""), "");
  EXPECT_EQ(inherit_key("/tmp/a.log"), "tmp/a.log");
  EXPECT_EQ(inherit_key("/var/log/app/out.log"), "var/log/app/out.log");
  EXPECT_EQ(inherit_key("/dev/pts/3"), "dev/pts/3");
  EXPECT_EQ(inherit_key("pipe:[123]"), "pipe:[123]");
  EXPECT_EQ(inherit_key("socket:[9]"), "socket:[9]");
  EXPECT_EQ(inherit_key("/tmp/x (deleted)"), "");
  EXPECT_EQ(inherit_key("/a (deleted)"), "");
  EXPECT_EQ(inherit_key("anon_inode:[eventfd]"), "");
  EXPECT_EQ(inherit_key("anon_inode:[io_uring]"), "");
  EXPECT_EQ(inherit_key("net:[4026531840]"), "");
}

class CriuLogTest : public ::testing::Test {
 protected:
  stdfs::path log(const std::string& text) {
    auto path = dir.path() / "criu.log";
    write(path, text);
    return path;
  }
  TempDir dir;
};

constexpr const char* kDumpLog =
    "(00.000010) Version: 4.2 (gitid 0)\n"
    "(00.000200) Error (criu/util.c:654): Can't raise RLIMIT_NOFILE to 1048576: Operation not "
    "permitted\n"
    "(00.000300) Error (criu/tun.c:85): tun: Unable to create tun: No such file or directory\n"
    "(00.000500) Dumping path for 3 fd via self 7 [/tmp/a]\n"
    "(00.001) Error (criu/files-reg.c:99): File tmp/a has bad size\n"
    "(00.001100) Error (criu/cr-dump.c:1600): Dump files (pid: 42) failed with -1\n"
    "(00.012345) Error (criu/cr-dump.c:1234): Dumping FAILED.\n";

TEST_F(CriuLogTest, ErrorsSkipHarmlessAndNonErrorLines) {
  EXPECT_EQ(log_errors(log(kDumpLog)),
            (Strings{"(00.001) Error (criu/files-reg.c:99): File tmp/a has bad size",
                     "(00.001100) Error (criu/cr-dump.c:1600): Dump files (pid: 42) failed with -1",
                     "(00.012345) Error (criu/cr-dump.c:1234): Dumping FAILED."}));
}

TEST_F(CriuLogTest, ErrorsKeepTheLastLines) {
  const Strings errors = log_errors(log(kDumpLog), 2);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_TRUE(Contains(errors[0], "Dump files (pid: 42) failed"));
  EXPECT_TRUE(Contains(errors[1], "Dumping FAILED."));
}

TEST_F(CriuLogTest, SummaryIsTheFirstRealErrorWithoutItsPrefix) {
  EXPECT_EQ(summarize_failure(log(kDumpLog)), "File tmp/a has bad size");
}

TEST_F(CriuLogTest, SummarySkipsEarlierFailedLines) {
  EXPECT_EQ(summarize_failure(log("(00.1) Error (criu/cr-restore.c:10): Restoring FAILED.\n"
                                  "(00.2) Error (criu/mount.c:77): Can't mount at ./proc: "
                                  "Permission denied\n")),
            "Can't mount at ./proc: Permission denied");
}

TEST_F(CriuLogTest, SummaryFallsBackToTheLastFailedLine) {
  EXPECT_EQ(summarize_failure(log("(00.1) Error (criu/a.c:1): Dumping FAILED.\n"
                                  "(00.2) Error (criu/b.c:2): Restoring FAILED.\n")),
            "(00.2) Error (criu/b.c:2): Restoring FAILED.");
}

TEST_F(CriuLogTest, SummaryOfLogWithoutErrors) {
  EXPECT_EQ(summarize_failure(log("(00.000010) Version: 4.2\n(00.1) Dumping finished\n")),
            "no error lines in its log");
  EXPECT_EQ(summarize_failure(dir.path() / "never-written.log"), "no error lines in its log");
  EXPECT_TRUE(log_errors(dir.path() / "never-written.log").empty());
}

TEST(CriuImages, HighestTaskIdIsTheLargestIdOfTheCoreImages) {
  TempDir dir;
  for (const char* name : {"core-7.img", "core-912.img", "core-88.img", "pstree.img", "core-.img",
                           "core-12x.img", "mm-4000.img", "core-5000.img.tmp"}) {
    std::ofstream(dir / name) << "x";
  }
  EXPECT_EQ(highest_task_id(dir.path()), 912);
  EXPECT_EQ(highest_task_id(dir / "missing"), 0);
}

class CriuLocateTest : public ::testing::Test {
 protected:
  // A stand-in for criu that answers --version like CRIU does.
  std::string fake_criu(const std::string& name, const std::string& version_output) {
    auto path = dir.path() / name;
    write(path, "#!/bin/sh\necho '" + version_output + "'\n");
    stdfs::permissions(path, stdfs::perms::owner_all);
    return path.string();
  }
  TempDir dir;
};

TEST_F(CriuLocateTest, MissingExplicitPathIsAnEnvironmentErrorNamingIt) {
  Error e = catch_error([] { locate("/nonexistent/criu"); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_STREQ(e.what(), "no usable CRIU >= 4.2: /nonexistent/criu is not an executable file");
  EXPECT_TRUE(Contains(e.hint(), "scripts/install-criu"));
  EXPECT_TRUE(Contains(e.hint(), "--criu"));
}

TEST_F(CriuLocateTest, MissingPathFromEnvironmentIsNamed) {
  ScopedEnv env("GPUSNAP_CRIU", "/nonexistent/env-criu");
  Error e = catch_error([] { locate(); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_STREQ(e.what(), "no usable CRIU >= 4.2: /nonexistent/env-criu is not an executable file");
  EXPECT_TRUE(Contains(e.hint(), "scripts/install-criu"));
}

TEST_F(CriuLocateTest, DirectoryIsNotAnExecutableFile) {
  // A directory passes access(X_OK): it must still be refused, by name.
  Error e = catch_error([&] { locate(dir.path().string()); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_EQ(std::string(e.what()),
            "no usable CRIU >= 4.2: " + dir.path().string() + " is not an executable file");
  EXPECT_TRUE(Contains(e.hint(), "scripts/install-criu"));
}

TEST_F(CriuLocateTest, AcceptsNewEnoughCriu) {
  const auto path = fake_criu("criu", "Version: 4.2.1");
  Binary b = locate(path);
  EXPECT_EQ(b.path, path);
  EXPECT_EQ(b.version, "4.2.1");
}

TEST_F(CriuLocateTest, RefusesOldCriuNamingPathAndVersion) {
  const auto path = fake_criu("criu", "Version: 3.19");
  Error e = catch_error([&] { locate(path); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_EQ(std::string(e.what()), "no usable CRIU >= 4.2: " + path + " is version 3.19");
  EXPECT_TRUE(Contains(e.hint(), "scripts/install-criu"));
}

TEST_F(CriuLocateTest, RefusesProgramThatIsNotCriu) {
  const auto path = fake_criu("criu", "something else entirely");
  Error e = catch_error([&] { locate(path); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_EQ(std::string(e.what()), "no usable CRIU >= 4.2: " + path + " is not working");
}

TEST_F(CriuLocateTest, RefusesFileThatIsNotExecutable) {
  const auto path = dir.path() / "criu";
  write(path, "#!/bin/sh\necho 'Version: 4.2'\n");
  // No execute bit at all: not even root may run it.
  stdfs::permissions(path, stdfs::perms::owner_read | stdfs::perms::owner_write);
  Error e = catch_error([&] { locate(path.string()); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_EQ(std::string(e.what()),
            "no usable CRIU >= 4.2: " + path.string() + " is not an executable file");
  EXPECT_TRUE(Contains(e.hint(), "scripts/install-criu"));
}

// A restore reached through store/reach.h locates CRIU twice (its host check, then the restore):
// `criu --version` runs once per file, and again once the file is another.
TEST_F(CriuLocateTest, AVersionIsAskedOncePerFileAndAgainWhenTheFileChanges) {
  const auto runs = dir.path() / "runs";
  const auto path = dir.path() / "criu";
  const auto install = [&](const std::string& version) {
    write(path,
          "#!/bin/sh\necho run >> '" + runs.string() + "'\necho 'Version: " + version + "'\n");
    stdfs::permissions(path, stdfs::perms::owner_all);
  };
  const auto count = [&] {
    std::ifstream in(runs);
    return std::count(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>(), '\n');
  };
  install("4.2.1");
  EXPECT_EQ(locate(path.string()).version, "4.2.1");
  EXPECT_EQ(locate(path.string()).version, "4.2.1");
  EXPECT_EQ(count(), 1);
  install("4.3.0");  // replaced in place: another size
  EXPECT_EQ(locate(path.string()).version, "4.3.0");
  EXPECT_EQ(count(), 2);
  // Replaced in place by one of the same size with the old mtime set back (as `cp -p` does):
  // its ctime still tells.
  struct stat before {};
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  // A later tick of the file system's clock than the last change (timestamps may be coarse).
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  install("4.3.1");
  const struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  EXPECT_EQ(locate(path.string()).version, "4.3.1");
  EXPECT_EQ(count(), 3);
}

TEST_F(CriuLocateTest, UsesGpusnapCriuFromEnvironment) {
  const auto path = fake_criu("env-criu", "Version: 4.3");
  ScopedEnv env("GPUSNAP_CRIU", path);
  Binary b = locate();
  EXPECT_EQ(b.path, path);
  EXPECT_EQ(b.version, "4.3");
  // An explicit path wins over the environment.
  const auto explicit_path = fake_criu("explicit-criu", "Version: 4.2");
  EXPECT_EQ(locate(explicit_path).path, explicit_path);
}

}  // namespace
}  // namespace gpusnap::criu
