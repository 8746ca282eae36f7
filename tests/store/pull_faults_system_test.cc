// A node's pull path under the faults an operator's node meets: pulls and restores of one
// snapshot at once, a full run directory, pulls killed again and again, a node copy damaged on
// disk, a pull stopped by a signal. The built gpusnap against a real docker-registry on loopback
// (throttled with --max-rate-mib where a kill must land mid-transfer), real CRIU captures and
// restores of the test workload, real signals, a real tmpfs as a small run directory.
#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/room.h"
#include "common/subprocess.h"
#include "store/registry_fixture.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
namespace sfs = std::filesystem;

// One capture of the test workload pushed to a registry of its own, and a node (run directory
// and cache) that has never pulled it.
class PullFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CRIU();
    GPUSNAP_SKIP_IF_BLOCKED(LocalRegistry::blocker());
    registry.emplace(dir, LocalRegistry::Options{});
    {
      Workload w(dir, {"--mib", "40", "--children", "1", "--seed", "7"});
      seed = field(ask(w.port(), "INFO"), "seed");
      port = w.port();
      auto r = gpusnap({"checkpoint", "--pid", std::to_string(w.pid()), "-o", snap.string(), "-q"});
      ASSERT_EQ(r.exit_code, 0) << r.err;
    }
    auto r =
        gpusnap({"push", snap.string(), registry->ref("r/s:v1"), "--plain-http", "--json", "-q"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json pushed = json::parse(r.out);
    reference = pushed.at("reference");
    key = pushed.at("digest").get<std::string>().substr(7);
    chunks = pushed.at("chunks");
    data_bytes = pushed.at("data_bytes");
    auto raw = common::run_capture({"skopeo", "inspect", "--tls-verify=false", "--raw",
                                    "docker://" + registry->host() + "/r/s:v1"});
    ASSERT_TRUE(raw.status.ok()) << raw.output;
    const json manifest = json::parse(raw.output);
    for (const auto& l : manifest.at("layers")) {
      if (l.at("mediaType").get<std::string>().starts_with("application/vnd.gpusnap.chunk.")) {
        chunk_digests.insert(l.at("digest").get<std::string>().substr(7));
      }
    }
    ASSERT_EQ(chunk_digests.size(), chunks);
    sfs::create_directories(run);
  }

  // A pull throttled to one chunk at a time at 8 MiB/s, SIGKILLed (or sent `signal`) once what
  // it staged in `folder` holds `more` bytes beyond `before`; its status.
  common::ExitStatus stop_mid_transfer(const std::string& name, std::vector<std::string> args,
                                       const sfs::path& folder, uint64_t before, uint64_t more,
                                       int signal = SIGKILL) const {
    args.insert(args.end(), {"--jobs", "1", "--max-rate-mib", "8", "-q"});
    Started p = start(name, std::move(args));
    const bool reached = eventually(
        [&] {
          uint64_t n = 0;
          for (const auto& s : stagings(folder)) n += fs::allocated_bytes(s);
          return n >= before + more;
        },
        std::chrono::seconds(60));
    p.process.kill(signal);
    auto status = p.process.wait(std::chrono::seconds(30));
    EXPECT_TRUE(reached) << p.printed();
    EXPECT_TRUE(status.has_value());
    return status.value_or(common::ExitStatus{});
  }

  // gpusnap's arguments for the node: its run directory and cache, the registry in plain HTTP.
  std::vector<std::string> node(std::vector<std::string> args) const {
    args.insert(args.end(), {"--run-dir", run.string(), "--cache", cache.string(), "--plain-http"});
    return args;
  }

  // A gpusnap started with these arguments, its stdout and stderr in files named `name`.
  struct Started {
    common::Subprocess process;
    sfs::path out;
    sfs::path err;
    // What it printed, stdout and stderr, once it ended.
    std::string printed() const { return fs::read_file(out) + fs::read_file(err); }
  };
  Started start(const std::string& name, std::vector<std::string> args) const {
    const sfs::path out_path = dir / (name + ".out");
    const sfs::path err_path = dir / (name + ".err");
    common::UniqueFd out(::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    common::UniqueFd err(::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    common::SpawnOptions o;
    o.argv = std::move(args);
    o.argv.insert(o.argv.begin(), gpusnap_bin());
    o.stdout_fd = out.get();
    o.stderr_fd = err.get();
    return {common::Subprocess(o), out_path, err_path};
  }

  // The staging directories (hidden) in `folder`.
  static std::vector<sfs::path> stagings(const sfs::path& folder) {
    std::vector<sfs::path> out;
    std::error_code ec;
    for (const auto& e : sfs::directory_iterator(folder, ec)) {
      const std::string name = e.path().filename().string();
      if (name.starts_with(".") && name.find(".staging-") != std::string::npos) {
        out.push_back(e.path());
      }
    }
    return out;
  }

  // How often the registry served each of the snapshot's chunks (its access log; the layout,
  // which every resolution of the tag reads, aside).
  std::map<std::string, int> chunk_gets() const {
    std::map<std::string, int> n;
    const std::string log = registry->log();
    const std::string get = "\"GET /v2/r/s/blobs/sha256:";
    for (size_t at = 0; (at = log.find(get, at)) != std::string::npos; ++at) {
      const std::string digest = log.substr(at + get.size(), 64);
      if (chunk_digests.count(digest)) ++n[digest];
    }
    return n;
  }

  // Every file of an artifact (manifest aside) with its bytes.
  static std::map<std::string, std::string> contents(const sfs::path& root) {
    std::map<std::string, std::string> out;
    for (const auto& e : sfs::recursive_directory_iterator(root)) {
      if (e.is_regular_file() && e.path().filename() != "manifest.json") {
        out[sfs::relative(e.path(), root).string()] = fs::read_file(e.path());
      }
    }
    return out;
  }

  TempDir dir;
  std::optional<LocalRegistry> registry;  // stopped before `dir` goes
  const sfs::path snap = dir / "snap";
  const sfs::path run = dir / "run";
  const sfs::path pulled = run / "pulled";
  const sfs::path cache = dir / "cache";
  std::string seed;
  uint16_t port = 0;
  std::string reference;  // by digest
  std::string key;        // the manifest's digest, hex
  size_t chunks = 0;
  std::set<std::string> chunk_digests;  // hex
  uint64_t data_bytes = 0;
};

// A tmpfs of `mib` MiB mounted at a new folder, unmounted at the end.
class SmallTmpfs {
 public:
  SmallTmpfs(const sfs::path& at, uint64_t mib) : at_(at) {
    sfs::create_directories(at);
    const std::string size = "size=" + std::to_string(mib) + "m";
    if (::mount("tmpfs", at.c_str(), "tmpfs", 0, size.c_str()) != 0) {
      throw std::runtime_error("mount tmpfs at " + at.string() + ": " + std::strerror(errno));
    }
  }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;
  ~SmallTmpfs() { ::umount2(at_.c_str(), MNT_DETACH); }

 private:
  sfs::path at_;
};

// Fills the filesystem of `folder` to the last byte (a file of zeros written until ENOSPC).
void fill(const sfs::path& folder) {
  common::UniqueFd fd(::open((folder / "filler").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
  const std::string block(1 << 16, '\1');
  while (::write(fd.get(), block.data(), block.size()) > 0) {
  }
}

// Pulls and restores of one snapshot on one node at once take turns on it (a lock per snapshot
// under RUN_DIR/locks): every one exits 0, each chunk leaves the registry once, the later ones
// say they waited, no staging is left.
TEST_F(PullFaults, TwoRestoresOfOneSnapshotAtOnceTakeTurns) {
  std::vector<Started> runs;
  for (int i = 0; i < 2; ++i) {
    // Throttled: the first is still pulling when the second asks (~3 s for the ~50 MB at
    // 16 MiB/s; both start at once, and the second asks within a request of its start).
    runs.push_back(
        start("restore" + std::to_string(i),
              node({"restore", registry->ref("r/s:v1"), "--max-rate-mib", "16", "--json", "-q"})));
  }
  std::vector<std::unique_ptr<Copies>> copies;
  std::string errs;
  for (auto& r : runs) {
    auto status = r.process.wait(std::chrono::minutes(3));
    errs += r.printed();
    ASSERT_TRUE(status && status->ok()) << r.printed();
    copies.push_back(std::make_unique<Copies>(json::parse(fs::read_file(r.out))));
  }
  EXPECT_NE(errs.find("waiting for another pull of sha256:" + key), std::string::npos) << errs;
  for (const auto& [digest, gets] : chunk_gets()) EXPECT_EQ(gets, 1) << digest;
  EXPECT_EQ(chunk_gets().size(), chunks);
  EXPECT_TRUE(stagings(pulled).empty());
  EXPECT_TRUE(sfs::exists(pulled / key / "manifest.json"));
}

TEST_F(PullFaults, EightPullsAndRestoresOfOneSnapshotAtOnceTakeTurns) {
  std::vector<Started> runs;
  for (int i = 0; i < 8; ++i) {
    const bool restore = i % 2 == 1;
    runs.push_back(start(std::string(restore ? "restore" : "pull") + std::to_string(i),
                         node({restore ? "restore" : "pull", registry->ref("r/s:v1"),
                               "--max-rate-mib", "16", "--json", "-q"})));
  }
  std::vector<std::unique_ptr<Copies>> copies;
  std::string errs;
  uint64_t fetched = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    auto status = runs[i].process.wait(std::chrono::minutes(4));
    errs += runs[i].printed();
    ASSERT_TRUE(status && status->ok()) << i << ": " << runs[i].printed();
    const json doc = json::parse(fs::read_file(runs[i].out));
    if (i % 2 == 1) {
      copies.push_back(std::make_unique<Copies>(doc));
    } else {
      fetched += doc.at("chunks_fetched").get<uint64_t>();
    }
  }
  EXPECT_NE(errs.find("waiting for another pull of sha256:" + key), std::string::npos) << errs;
  for (const auto& [digest, gets] : chunk_gets()) EXPECT_EQ(gets, 1) << digest;
  EXPECT_EQ(chunk_gets().size(), chunks);
  EXPECT_LE(fetched, chunks);
  EXPECT_TRUE(stagings(pulled).empty());
  EXPECT_EQ(contents(pulled / key), contents(snap));
}

// Issue 39, 2: a pull that will not fit refuses before its first chunk (exit 10, the numbers
// and a fix); one that finds no space in the middle removes what it staged.
TEST_F(PullFaults, APullThatDoesNotFitRefusesBeforeFetching) {
  const uint64_t mib = (data_bytes >> 20) / 2;
  SmallTmpfs small(run, mib);
  auto r = gpusnap(node({"pull", registry->ref("r/s:v1"), "-q"}));
  EXPECT_EQ(r.exit_code, 10) << r.err;
  EXPECT_NE(r.err.find("pulling " + reference + " needs "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" free (fix: free space there"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(chunk_gets().empty()) << "a chunk was fetched";
  EXPECT_TRUE(stagings(pulled).empty());
}

TEST_F(PullFaults, APullThatRunsOutOfSpaceRemovesWhatItStaged) {
  SmallTmpfs small(run, (data_bytes >> 20) + 16);
  // Room at the start; none once it has staged a few MiB (the filesystem filled meanwhile).
  Started p =
      start("pull", node({"pull", registry->ref("r/s:v1"), "--jobs", "1", "--max-rate-mib", "8"}));
  ASSERT_TRUE(eventually(
      [&] { return !stagings(pulled).empty() && fs::allocated_bytes(pulled) >= (4u << 20); },
      std::chrono::seconds(60)))
      << p.printed();
  fill(run);
  auto status = p.process.wait(std::chrono::seconds(60));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->exited && status->code == 10) << status->describe() << p.printed();
  EXPECT_NE(p.printed().find("No space left on device"), std::string::npos) << p.printed();
  EXPECT_TRUE(stagings(pulled).empty());
  EXPECT_FALSE(sfs::exists(pulled / key));
  // Space again: the next pull completes.
  sfs::remove(run / "filler");
  auto again = gpusnap(node({"pull", registry->ref("r/s:v1"), "-q"}));
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(contents(pulled / key), contents(snap));
}

// Issue 39, 2: `gpusnap recover` removes what dead pulls staged, of a node copy and of -o DIR.
TEST_F(PullFaults, RecoverRemovesWhatKilledPullsStaged) {
  stop_mid_transfer("node", node({"pull", registry->ref("r/s:v1")}), pulled, 0, 4u << 20);
  const sfs::path out = dir / "out";
  stop_mid_transfer("output",
                    {"pull", registry->ref("r/s:v1"), "-o", out.string(), "--run-dir", run.string(),
                     "--cache", (dir / "cache2").string(), "--plain-http"},
                    dir.path(), 0, 4u << 20);
  ASSERT_EQ(stagings(pulled).size(), 1u);
  ASSERT_EQ(stagings(dir.path()).size(), 1u);
  const sfs::path node_staging = stagings(pulled).front();
  const sfs::path output_staging = stagings(dir.path()).front();
  auto r = gpusnap({"recover", "--run-dir", run.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("removed the staging directory " + node_staging.string()), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("removed the staging directory " + output_staging.string()),
            std::string::npos)
      << r.out;
  EXPECT_TRUE(stagings(pulled).empty()) << r.out;
  EXPECT_TRUE(stagings(dir.path()).empty()) << r.out;
  EXPECT_FALSE(sfs::exists(out));
}

// Issue 39, 3: however often a pull of a node copy is killed, one staging directory of it is
// left at most, and the next pull resumes from it.
TEST_F(PullFaults, FivePullsKilledInARowLeaveOneStagingAndTheNextResumes) {
  for (int i = 0; i < 5; ++i) {
    const uint64_t before = fs::allocated_bytes(pulled);
    auto status =
        stop_mid_transfer("pull" + std::to_string(i), node({"pull", registry->ref("r/s:v1")}),
                          pulled, before, 2u << 20);
    EXPECT_FALSE(status.exited) << "ended before the kill: " << status.describe();
    EXPECT_LE(stagings(pulled).size(), 1u) << "after kill " << i;
  }
  ASSERT_EQ(stagings(pulled).size(), 1u);
  auto r = gpusnap(node({"pull", registry->ref("r/s:v1"), "--json", "-q"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json doc = json::parse(r.out);
  EXPECT_GE(doc.at("bytes_from_cache").get<uint64_t>(), 10u << 20) << r.out;
  EXPECT_LT(doc.at("chunks_fetched").get<size_t>(), chunks) << r.out;
  EXPECT_TRUE(stagings(pulled).empty());
  EXPECT_EQ(contents(pulled / key), contents(snap));
}

// The largest file of an artifact, and a byte in the middle of its data flipped.
sfs::path flip_a_byte(const sfs::path& artifact) {
  sfs::path largest;
  uint64_t most = 0;
  for (const auto& e : sfs::recursive_directory_iterator(artifact)) {
    struct stat st {};
    if (e.is_regular_file() && ::lstat(e.path().c_str(), &st) == 0 &&
        static_cast<uint64_t>(st.st_blocks) > most) {
      most = static_cast<uint64_t>(st.st_blocks);
      largest = e.path();
    }
  }
  ::chmod(largest.c_str(), 0600);
  common::UniqueFd fd(::open(largest.c_str(), O_RDWR | O_CLOEXEC));
  const off_t at = ::lseek(fd.get(), static_cast<off_t>(sfs::file_size(largest) / 2), SEEK_DATA);
  char byte = 0;
  if (at < 0 || ::pread(fd.get(), &byte, 1, at) != 1) throw std::runtime_error("no data");
  byte = static_cast<char>(byte ^ 0x5a);
  if (::pwrite(fd.get(), &byte, 1, at) != 1) throw std::runtime_error("write");
  return largest;
}

// Issue 39, 4: a node copy damaged on disk is set aside and pulled again (what is intact in it
// kept), with a note, and the restore goes on; `pull` does not answer "pulled before" for it.
TEST_F(PullFaults, ADamagedNodeCopyIsSetAsideAndPulledAgain) {
  auto first = gpusnap(node({"pull", registry->ref("r/s:v1"), "-q"}));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const auto gets = chunk_gets();

  flip_a_byte(pulled / key);
  auto rs = gpusnap(node(
      {"restore", registry->ref("r/s:v1"), "--publish", std::to_string(port), "--json", "-q"}));
  ASSERT_EQ(rs.exit_code, 0) << rs.err;
  const json doc = json::parse(rs.out);
  Copies copies{doc};
  EXPECT_EQ(field(ask(copies.port(0), "INFO"), "seed"), seed);
  const std::string notes = doc.at("notes").dump();
  EXPECT_NE(notes.find("the node's copy " + (pulled / key).string() + " is damaged ("),
            std::string::npos)
      << notes;
  EXPECT_NE(notes.find("set aside, pulling it again"), std::string::npos) << notes;
  EXPECT_EQ(contents(pulled / key), contents(snap));
  EXPECT_TRUE(stagings(pulled).empty());
  // Of the chunks, at most the damaged one left the registry again.
  int again = 0;
  for (const auto& [digest, n] : chunk_gets())
    again += n - (gets.count(digest) ? gets.at(digest) : 0);
  EXPECT_LE(again, 1);

  // pull on a damaged copy: verified, set aside, pulled again, said on stderr.
  flip_a_byte(pulled / key);
  auto pull = gpusnap(node({"pull", registry->ref("r/s:v1")}));
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  EXPECT_NE(pull.err.find("is damaged ("), std::string::npos) << pull.err;
  EXPECT_EQ(pull.out.find("already at"), std::string::npos) << pull.out;
  EXPECT_EQ(contents(pulled / key), contents(snap));
  // And on an intact one: says what it checked.
  auto intact = gpusnap(node({"pull", registry->ref("r/s:v1")}));
  ASSERT_EQ(intact.exit_code, 0) << intact.err;
  EXPECT_NE(intact.out.find("already at " + (pulled / key).string() +
                            ", verified (every byte against its manifest)"),
            std::string::npos)
      << intact.out;
}

// Issue 39, 7: `pull -o DIR` stopped by SIGTERM removes its hidden staging and ends by the
// signal; nothing is left for `recover`.
TEST_F(PullFaults, ASigtermedPullIntoADirectoryRemovesItsStaging) {
  const sfs::path out = dir / "out";
  auto status = stop_mid_transfer("output",
                                  {"pull", registry->ref("r/s:v1"), "-o", out.string(), "--run-dir",
                                   run.string(), "--cache", cache.string(), "--plain-http"},
                                  dir.path(), 0, 2u << 20, SIGTERM);
  EXPECT_FALSE(status.exited) << status.describe();
  EXPECT_EQ(status.code, SIGTERM) << status.describe();
  EXPECT_TRUE(stagings(dir.path()).empty());
  EXPECT_FALSE(sfs::exists(out));
  EXPECT_TRUE(!sfs::exists(run / "staging") || sfs::is_empty(run / "staging"));
}

}  // namespace
}  // namespace gpusnap::testing
