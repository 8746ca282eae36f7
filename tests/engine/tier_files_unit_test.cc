// gpusnap's side of the memory tier (src/engine/tier_files.h): the folder handed to the workload,
// the checks of what it left there, and how its memory is counted and named to copies.
#include "engine/tier_files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "testing/unit.h"

namespace gpusnap::engine {
namespace {

using namespace gpusnap::testing;  // testing/unit.h
using nlohmann::json;

constexpr const char* kIndex =
    R"({"format":"gpusnap-tier","version":1,"pid":7,"bytes":12,"files":[{"path":"7-w0.img","size":8},{"path":"7-w1.img","size":4}],"gpus":[{"uuid":"GPU-a","bytes":8},{"uuid":"GPU-b","bytes":4}]})";

class TierDirTest : public ::testing::Test {
 protected:
  TierDirTest() : tier(make_tier_dir(staging.path(), ::getpid())) {}
  void drained() {
    write(tier / "7-w0.img", "12345678");
    write(tier / "7-w1.img", "abcd");
    write(tier / "7.json", kIndex);
  }
  TempDir staging;
  std::filesystem::path tier;
};

TEST_F(TierDirTest, TheFolderBelongsToTheWorkloadAndNobodyElse) {
  struct stat st {};
  ASSERT_EQ(::stat(tier.c_str(), &st), 0);
  EXPECT_EQ(tier, staging / "tier");
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(st.st_gid, ::getegid());
}

TEST_F(TierDirTest, AnEmptyFolderIsRemovedSoArtifactsWithoutATierDoNotChange) {
  const TierContents c = check_tier_dir(tier);
  EXPECT_EQ(c.files, 0u);
  EXPECT_FALSE(std::filesystem::exists(tier));
  EXPECT_EQ(tier_member(tier), "");
}

TEST_F(TierDirTest, TheIndexesSayHowMuchMemoryIsOnEachGpu) {
  drained();
  const TierContents c = check_tier_dir(tier);
  EXPECT_EQ(c.files, 3u);
  EXPECT_EQ(c.bytes, 12u);
  EXPECT_EQ(c.gpu_bytes, (std::map<std::string, uint64_t>{{"GPU-a", 8}, {"GPU-b", 4}}));
  EXPECT_EQ(tier_member(tier), tier.string());
}

TEST_F(TierDirTest, AnythingButTheTiersFilesIsRefused) {
  drained();
  std::filesystem::create_symlink("/etc/passwd", tier / "7-w2.img");
  const Error link = catch_error([&] { check_tier_dir(tier); });
  EXPECT_EQ(link.kind(), ErrorKind::kHandshake);
  EXPECT_EQ(std::string(link.what()), "the workload left " + (tier / "7-w2.img").string() +
                                          " in its memory tier's folder: not a regular file");
  std::filesystem::remove(tier / "7-w2.img");
  write(tier / "notes.txt", "x");
  EXPECT_EQ(std::string(catch_error([&] { check_tier_dir(tier); }).what()),
            "the workload left " + (tier / "notes.txt").string() +
                " in its memory tier's folder: not a file of the tier (PID-wN.img, PID.json or "
                "PID.layout)");
}

TEST_F(TierDirTest, AnIndexMustMatchTheFilesThere) {
  drained();
  std::filesystem::resize_file(tier / "7-w1.img", 3);
  EXPECT_EQ(std::string(catch_error([&] { check_tier_dir(tier); }).what()),
            "the workload left " + (tier / "7.json").string() +
                " in its memory tier's folder: an index naming 7-w1.img, which is not there at "
                "4 bytes");
  write(tier / "7.json", "{\"format\":\"gpusnap-tier\"");
  EXPECT_TRUE(Contains(catch_error([&] { check_tier_dir(tier); }).what(),
                       "in its memory tier's folder: a malformed index ("));
}

TEST_F(TierDirTest, ItsFilesAreHashedInTheBackgroundAsTheManifestWouldRecordThem) {
  drained();
  write(tier / "7.layout", std::string(5000, 'L'));
  TierChecksums sums(tier, 4, 2);
  const std::vector<FileRecord> got = sums.join();
  // What the capture's checksum phase computes for the same files, under the artifact's paths.
  std::map<std::string, FileRecord> expected;
  for (FileRecord f : checksum_tree(staging.path(), 4)) expected[f.path] = f;
  ASSERT_EQ(got.size(), 4u);
  for (const auto& f : got) {
    ASSERT_EQ(expected.count(f.path), 1u) << f.path;
    EXPECT_EQ(f.size, expected[f.path].size) << f.path;
    EXPECT_EQ(f.chunks, expected[f.path].chunks) << f.path;
  }
  EXPECT_EQ(got[0].path, "tier/7-w0.img");
  EXPECT_EQ(got[0].chunks.size(), 2u);  // 8 bytes in chunks of 4
}

TEST_F(TierDirTest, AFileThatCannotBeReadFailsTheJoinAndAnUnjoinedHashingStops) {
  drained();
  std::filesystem::remove_all(tier);
  TierChecksums gone(tier, 4, 2);
  const Error e = catch_error([&] { gone.join(); });
  EXPECT_EQ(e.kind(), ErrorKind::kBadArtifact);
  EXPECT_TRUE(Contains(e.what(), "cannot list the files of " + tier.string())) << e.what();
  // A capture that fails before the join destroys it with the hashing under way: it stops.
  std::filesystem::create_directories(tier);
  for (int i = 0; i < 8; ++i)
    write(tier / ("7-w" + std::to_string(i) + ".img"), std::string(1 << 20, 'x'));
  { TierChecksums unjoined(tier, 4096, 1); }
  std::stop_source stop;
  stop.request_stop();
  VerifyOptions stopped;
  stopped.stop = stop.get_token();
  EXPECT_EQ(catch_error([&] { checksum_tree(tier, 4096, stopped); }).what(),
            "the checksums of " + tier.string() + " were stopped");
}

TEST(TierMemory, IsCountedOnTheWorkloadsProcessForTheRestoresFreeMemoryCheck) {
  std::optional<GpuFacts> gpu = GpuFacts{};
  gpu->gpus.resize(2);
  gpu->gpus[0].uuid = "GPU-a";
  gpu->gpus[1].uuid = "GPU-b";
  gpu->gpus[1].used = false;
  gpu->processes = {{5, 100, {{"GPU-a", 100}}}, {7, 50, {{"GPU-a", 50}}}};
  TierContents tier;
  tier.bytes = 12;
  tier.gpu_bytes = {{"GPU-a", 8}, {"GPU-b", 4}};
  add_tier_memory(gpu, 7, tier);
  const auto& seven = gpu->processes.at(1);
  EXPECT_EQ(seven.pid, 7);
  EXPECT_EQ(seven.bytes, 62u);
  ASSERT_EQ(seven.gpus.size(), 2u);
  EXPECT_EQ(seven.gpus[0].uuid, "GPU-a");
  EXPECT_EQ(seven.gpus[0].bytes, 58u);
  EXPECT_EQ(seven.gpus[1].uuid, "GPU-b");
  EXPECT_EQ(seven.gpus[1].bytes, 4u);
  EXPECT_EQ(gpu->processes.at(0).bytes, 100u);
  EXPECT_TRUE(gpu->gpus.at(1).used);
  // A root that is not a CUDA process (a launcher): the first process carries it.
  add_tier_memory(gpu, 99, tier);
  EXPECT_EQ(gpu->processes.at(0).bytes, 112u);
  // No GPU facts (no CUDA process): nothing to count on.
  std::optional<GpuFacts> none;
  add_tier_memory(none, 7, tier);
  EXPECT_FALSE(none);
}

TEST(TierMemory, CopiesAreToldTheArtifactsFolderOnlyWhenItHoldsTierFiles) {
  Manifest m;
  m.files.push_back({"criu/pages-1.img", 10, {}});
  EXPECT_EQ(artifact_tier_dir("/srv/a", m), "");
  m.files.push_back({"tier/7-w0.img", 8, {}});
  EXPECT_EQ(artifact_tier_dir("/srv/a", m), "/srv/a/tier");
  EXPECT_EQ(artifact_tier_dir("rel", m),
            (std::filesystem::current_path() / "rel" / "tier").string());
}

// An artifact's tier/ with process PID's index (its memory on GPU-a alone) and layout.
void drained_on_one_gpu(const TempDir& artifact, const std::string& pid) {
  std::filesystem::create_directories(artifact / "tier");
  write(artifact / "tier" / (pid + ".json"),
        R"({"format":"gpusnap-tier","version":1,"pid":)" + pid +
            R"(,"bytes":8,"files":[],"gpus":[{"uuid":"GPU-a","bytes":8}]})");
  write(artifact / "tier" / (pid + ".layout"), "x");
}

// gpusnap's side of the fill done ahead: a prefill per copy and per process with a layout, told
// the artifact's folder, the process, a socket in the copy's own folder, the GPU the copy maps
// its memory to and the owner of the tier's files; only the first copy's prefill is given a
// pipe for its checksums and the chunk to compute them in (the others read the same files);
// each copy's context names its folder; the prefills' reports come back as notes; nothing is
// left behind. The program is a stand-in script here (the real one needs a GPU;
// docs/status.md).
TEST(TierPrefills, OnePerCopyAndProcessToldWhereAndOnWhichGpu) {
  TempDir artifact;
  TempDir run;
  drained_on_one_gpu(artifact, "7");
  // Process 9's tier spans two GPUs: no prefill for it, its copies fill by themselves.
  write(artifact / "tier" / "9.json", kIndex);
  write(artifact / "tier" / "9.layout", "x");
  const auto script = run / "prefill.sh";
  write(script, "#!/bin/sh\necho \"$@\" >> " + (run / "calls").string() +
                    "\necho \"prefill of $2 on $4 done\" >&2\n");
  ASSERT_EQ(::chmod(script.c_str(), 0755), 0);
  ::setenv("GPUSNAP_TIER_PREFILL", script.c_str(), 1);
  std::filesystem::path root;
  {
    TierPrefills prefills(artifact.path(), {{"GPU-a", "GPU-z"}}, 2, run / "state", 4096);
    const std::string copy0 = prefills.context_dir(0).get<std::string>();
    const std::string copy1 = prefills.context_dir(1).get<std::string>();
    ASSERT_FALSE(copy0.empty());
    EXPECT_NE(copy0, copy1);
    EXPECT_EQ(prefills.context_dir(2).get<std::string>(), "");
    root = std::filesystem::path(copy0).parent_path();
    const auto lines = prefills.finish();
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_EQ(lines[0], "tier prefill (copy 0, process 7): prefill of 7 on GPU-z done");
    std::string calls;
    ASSERT_TRUE(fs::try_read_file(run / "calls", &calls));
    struct stat st {};
    ASSERT_EQ(::stat((artifact / "tier" / "7.json").c_str(), &st), 0);
    const std::string owner = std::to_string(st.st_uid) + " " + std::to_string(st.st_gid);
    const std::string tier = std::filesystem::absolute(artifact / "tier").string();
    EXPECT_NE(calls.find(tier + " 7 " + copy0 + "/7.sock GPU-z " + owner + " 60000 3 4 4096 -1\n"),
              std::string::npos)
        << calls;
    EXPECT_NE(calls.find(tier + " 7 " + copy1 + "/7.sock GPU-z " + owner + " 60000 3 -1 0 -1\n"),
              std::string::npos)
        << calls;
    EXPECT_EQ(calls.find(" 9 "), std::string::npos) << calls;
  }
  EXPECT_FALSE(std::filesystem::exists(root)) << "the prefills' folder outlived the restore";
  // Switched off: none, and the copies' contexts name nothing.
  ::setenv("GPUSNAP_TIER_PREFILL", "off", 1);
  TierPrefills none(artifact.path(), {}, 1, run / "state");
  EXPECT_EQ(none.context_dir(0).get<std::string>(), "");
  EXPECT_TRUE(none.finish().empty());
  ::unsetenv("GPUSNAP_TIER_PREFILL");
}

// An artifact still arriving (a pull the restore overlaps): each prefill reaches the tier's
// folder through a descriptor, which the artifact's rename to its final name leaves valid, and
// is told on a socket of its own how much of each of its process's drain files is written; what
// is not its own (CRIU's images, another process's files) it is not told. The stand-in reads the
// socket until the file is whole, as the real one's fill waits for each byte (tier/arrival.h).
TEST(TierPrefills, OfAnArtifactStillArrivingAreToldWhatIsWrittenAndFollowItsRename) {
  TempDir parent;
  TempDir run;
  const auto staging = parent / "staging";
  const auto final_name = parent / "artifact";
  std::filesystem::create_directories(staging / "tier");
  write(staging / "tier" / "7.json",
        R"({"format":"gpusnap-tier","version":1,"pid":7,"bytes":8,"files":[],)"
        R"("gpus":[{"uuid":"GPU-a","bytes":8}]})");
  write(staging / "tier" / "7.layout", "x");
  const auto script = run / "prefill.sh";
  write(script, "#!/bin/bash\necho \"$1 ${11}\" >> " + (run / "calls").string() +
                    "\nwhile IFS= read -r line <&6; do echo \"$line\" >> " +
                    (run / "told").string() +
                    "; [[ $line == '7-w0.img 8' ]] && break; done\nls \"$1\" >> " +
                    (run / "listed").string() + "\necho \"prefill of $2 filled\" >&2\n");
  ASSERT_EQ(::chmod(script.c_str(), 0755), 0);
  ::setenv("GPUSNAP_TIER_PREFILL", script.c_str(), 1);
  std::function<void(const std::string&, uint64_t)> feed;
  {
    TierPrefills prefills(staging, {}, 1, run / "state", 0, /*arriving=*/true);
    feed = prefills.arrival_feed();
    // The pull commits: the staging directory takes the artifact's name.
    std::filesystem::rename(staging, final_name);
    feed("criu/pages-1.img", 4096);
    feed("tier/9-w0.img", 8);
    feed("tier/7.layout", 1);
    feed("tier/7-w0.img", 4);
    feed("tier/7-w0.img", 8);
    // finish() waits half a second for a prefill: on a loaded machine the stand-in's start may
    // take longer than its real counterpart's fill would.
    for (int i = 0; i < 200 && !std::filesystem::exists(run / "listed"); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const auto lines = prefills.finish();
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0], "tier prefill (copy 0, process 7): prefill of 7 filled");
  }
  feed("tier/7-w0.img", 8);  // the pull outlived the restore: nothing left to tell
  std::string calls, told, listed;
  ASSERT_TRUE(fs::try_read_file(run / "calls", &calls));
  ASSERT_TRUE(fs::try_read_file(run / "told", &told));
  ASSERT_TRUE(fs::try_read_file(run / "listed", &listed));
  EXPECT_EQ(calls, "/proc/self/fd/5 6\n");
  EXPECT_EQ(told, "7-w0.img 4\n7-w0.img 8\n");
  EXPECT_EQ(listed, "7.json\n7.layout\n");
  ::unsetenv("GPUSNAP_TIER_PREFILL");
}

// The prefills start before the artifact's checksums are checked, so an index is read bounded:
// one nested too deep or larger than an index can be starts no prefill (that copy fills by
// itself, from files its own checks cover), and the others go on.
TEST(TierPrefills, AnIndexNoCaptureWroteStartsNoPrefill) {
  TempDir artifact;
  TempDir run;
  drained_on_one_gpu(artifact, "7");
  drained_on_one_gpu(artifact, "8");
  drained_on_one_gpu(artifact, "9");
  write(artifact / "tier" / "8.json",
        R"({"gpus":)" + std::string(100000, '[') + std::string(100000, ']') + "}");
  write(artifact / "tier" / "9.json", R"({"gpus":[{"uuid":"GPU-a","bytes":8}],"pad":")" +
                                          std::string(tier::folder::kMaxIndexBytes, 'x') + "\"}");
  const auto script = run / "prefill.sh";
  write(script, "#!/bin/sh\necho \"$2\" >> " + (run / "calls").string() +
                    "\necho \"prefill of $2 done\" >&2\n");
  ASSERT_EQ(::chmod(script.c_str(), 0755), 0);
  ::setenv("GPUSNAP_TIER_PREFILL", script.c_str(), 1);
  {
    TierPrefills prefills(artifact.path(), {}, 1, run / "state");
    const auto lines = prefills.finish();
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0], "tier prefill (copy 0, process 7): prefill of 7 done");
  }
  std::string calls;
  ASSERT_TRUE(fs::try_read_file(run / "calls", &calls));
  EXPECT_EQ(calls, "7\n");
  ::unsetenv("GPUSNAP_TIER_PREFILL");
}

// finish() takes a prefill's word, not its exit: one that reported and closed its DONE-FD is
// left to end by itself (its exit tears down a CUDA context: nobody waits for that), and is
// reaped; one that says nothing within the grace is killed.
TEST(TierPrefills, TheReportIsWaitedForNotTheExitAndASilentPrefillIsStopped) {
  TempDir artifact;
  TempDir run;
  drained_on_one_gpu(artifact, "7");
  const auto pid_file = run / "pid";
  // Reports, says done on its DONE-FD ($8), then takes 3 s to end.
  const auto slow_exit = run / "slow-exit.sh";
  write(slow_exit, "#!/bin/sh\necho $$ > " + pid_file.string() +
                       "\necho \"taken by the copy\" >&2\neval \"exec $8>&-\"\nsleep 3\n");
  ASSERT_EQ(::chmod(slow_exit.c_str(), 0755), 0);
  ::setenv("GPUSNAP_TIER_PREFILL", slow_exit.c_str(), 1);
  {
    TierPrefills prefills(artifact.path(), {}, 1, run / "state");
    const auto t0 = std::chrono::steady_clock::now();
    while (!std::filesystem::exists(pid_file)) ::usleep(10000);
    const auto lines = prefills.finish();
    const auto waited = std::chrono::steady_clock::now() - t0;
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0], "tier prefill (copy 0, process 7): taken by the copy");
    EXPECT_LT(waited, std::chrono::milliseconds(1500)) << "finish() waited for the exit";
  }
  std::string text;
  ASSERT_TRUE(fs::try_read_file(pid_file, &text));
  const auto proc = "/proc/" + std::to_string(std::stoi(text));
  EXPECT_TRUE(std::filesystem::exists(proc)) << "the prefill was killed, not left to end";
  // Reaped in the background once it ends: not even a zombie is left.
  for (int i = 0; i < 100 && std::filesystem::exists(proc); ++i) ::usleep(100000);
  EXPECT_FALSE(std::filesystem::exists(proc)) << "the prefill was not reaped";

  // Says nothing: stopped after the grace, its line says so.
  const auto silent = run / "silent.sh";
  write(silent, "#!/bin/sh\necho $$ > " + pid_file.string() + "\nexec sleep 60\n");
  ASSERT_EQ(::chmod(silent.c_str(), 0755), 0);
  ::setenv("GPUSNAP_TIER_PREFILL", silent.c_str(), 1);
  std::filesystem::remove(pid_file);
  {
    TierPrefills prefills(artifact.path(), {}, 1, run / "state");
    while (!std::filesystem::exists(pid_file)) ::usleep(10000);
    const auto lines = prefills.finish();
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0], "tier prefill (copy 0, process 7): stopped");
  }
  ASSERT_TRUE(fs::try_read_file(pid_file, &text));
  EXPECT_FALSE(std::filesystem::exists("/proc/" + std::to_string(std::stoi(text))));
  ::unsetenv("GPUSNAP_TIER_PREFILL");
}

// What a prefill writes on its SUMS-FD is read strictly: any line out of form, a file of another
// process, a repeated file, a count of chunks that does not fit the size, or text cut short gives
// nothing (gpusnap then reads the files itself).
TEST(TierPrefills, ItsSumsAreReadStrictly) {
  const std::string h1(32, 'a');
  const std::string h2(32, 'b');
  auto ok =
      parse_prefill_sums("7-w0.img 10 " + h1 + "\n7-w1.img 5 " + h1 + " " + h2 + "\n", "7", 4);
  EXPECT_FALSE(ok.has_value());  // 5 bytes in chunks of 4 are 2 chunks, but 10 bytes are 3
  ok = parse_prefill_sums("7-w0.img 8 " + h1 + " " + h2 + "\n7-w1.img 0 " + h1 + "\n", "7", 4);
  ASSERT_TRUE(ok.has_value());
  ASSERT_EQ(ok->size(), 2u);
  EXPECT_EQ((*ok)[0].path, "tier/7-w0.img");
  EXPECT_EQ((*ok)[0].size, 8u);
  EXPECT_EQ((*ok)[0].chunks, (std::vector<std::string>{h1, h2}));
  EXPECT_EQ((*ok)[1].chunks.size(), 1u);  // an empty file has one chunk, as in the manifest
  EXPECT_TRUE(parse_prefill_sums("", "7", 4).has_value());  // it read nothing whole
  for (const std::string& bad : std::vector<std::string>{
           "8-w0.img 4 " + h1 + "\n", "7-w0.img 4 " + h1 + "\n7-w0.img 4 " + h1 + "\n",
           "7-w0.img 4 " + h1, "7-w0.img 4 " + h1 + " " + h2 + "\n", "7-w0.img 4 XYZ\n",
           "7-w0.img -4 " + h1 + "\n", "../7-w0.img 4 " + h1 + "\n", "7-w0.img 4\n",
           "7-w0.img 99999999999999999 " + h1 + "\n", "7-w0.img 4 " + h1.substr(1) + "A\n"}) {
    EXPECT_FALSE(parse_prefill_sums(bad, "7", 4).has_value()) << bad;
  }
  EXPECT_FALSE(parse_prefill_sums(std::string(kMaxPrefillSumsBytes + 1, '\n'), "7", 4));
  EXPECT_FALSE(parse_prefill_sums("7-w0.img 4 " + h1 + "\n", "7", 0));
}

// An artifact whose tier/ holds process 7's drain file (16 KiB in chunks of 4 KiB), its index and
// layout; sealed into a manifest as the writer does.
class PrefilledArtifact : public ::testing::Test {
 protected:
  static constexpr uint64_t kChunk = 4096;
  PrefilledArtifact() {
    drained_on_one_gpu(artifact, "7");
    std::string bytes;
    for (int i = 0; i < 4 * 4096; ++i) bytes.push_back(static_cast<char>(i * 7));
    write(artifact / "tier" / "7-w0.img", bytes);
    Manifest m;
    m.id = "prefilled";
    m.chunk_bytes = kChunk;
    m.files = checksum_tree(artifact.path(), kChunk);
    write(artifact / kManifestName, m.to_json().dump());
  }
  // The sums line of tier/7-w0.img as it is on disk now.
  std::string sums_line() const {
    for (const auto& f : checksum_tree(artifact.path(), kChunk)) {
      if (f.path != "tier/7-w0.img") continue;
      std::string line = "7-w0.img " + std::to_string(f.size);
      for (const auto& c : f.chunks) line += " " + c;
      return line + "\n";
    }
    return {};
  }
  // A stand-in prefill that writes `text` on its SUMS-FD ($9; -1: none) and ends.
  void prefill_writes(const std::string& text) {
    const auto script = run / "prefill.sh";
    write(run / "sums", text);
    write(script,
          "#!/bin/sh\n[ \"$9\" = -1 ] || eval \"cat " + (run / "sums").string() + " >&$9\"\n");
    ASSERT_EQ(::chmod(script.c_str(), 0755), 0);
    ::setenv("GPUSNAP_TIER_PREFILL", script.c_str(), 1);
  }
  void damage() {
    std::string bytes;
    ASSERT_TRUE(fs::try_read_file(artifact / "tier" / "7-w0.img", &bytes));
    bytes[5000] ^= 1;
    write(artifact / "tier" / "7-w0.img", bytes);
  }
  std::vector<VerifyProblem> check(int copies) {
    TierPrefills prefills(artifact.path(), {}, copies, run / "state", kChunk);
    const Artifact opened = Artifact::open(artifact.path());
    const auto files = prefills.files_read(opened.manifest());
    EXPECT_EQ(files, (std::set<std::string>{"tier/7-w0.img"}));
    // Beside CRIU's restore the file is left out; its size is still checked.
    VerifyScope scope;
    scope.deferred = files;
    EXPECT_TRUE(opened.verify({}, scope).empty());
    auto problems = verify_prefilled(opened, prefills, files,
                                     std::chrono::steady_clock::now() + std::chrono::seconds(10));
    prefills.finish();
    return problems;
  }
  ~PrefilledArtifact() override { ::unsetenv("GPUSNAP_TIER_PREFILL"); }
  TempDir artifact;
  TempDir run;
};

// The sums the first copy's prefill computed as it read the file are what is checked, once for
// every copy: read as the manifest says, it passes; read otherwise, the restore is refused, once,
// naming the file, the bytes and the copy whose prefill read them.
TEST_F(PrefilledArtifact, TheFirstCopysSumsAreCheckedAgainstTheManifest) {
  prefill_writes(sums_line());
  EXPECT_TRUE(check(2).empty());
  damage();  // what a prefill reads now is not what the manifest says
  prefill_writes(sums_line());
  for (const int copies : {1, 3}) {
    const auto problems = check(copies);
    ASSERT_EQ(problems.size(), 1u) << copies << " copies";
    EXPECT_EQ(problems[0].path, "tier/7-w0.img");
    EXPECT_EQ(problems[0].problem,
              "checksum mismatch in bytes 4096-8192 (as the tier prefill of copy 0, process 7 "
              "read it)");
  }
}

// A prefill that gives no sums (it failed, or wrote nonsense): its copy fills from the file
// itself, so gpusnap reads the file, and finds it intact or damaged.
TEST_F(PrefilledArtifact, AFileWithoutSumsIsReadByGpusnap) {
  prefill_writes("");
  EXPECT_TRUE(check(2).empty());
  prefill_writes("nonsense\n");
  EXPECT_TRUE(check(1).empty());
  damage();
  prefill_writes("");
  const auto problems = check(1);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].problem, "checksum mismatch in bytes 4096-8192");
}

// A prefill folder that cannot be made: the constructor says so (the restore then goes on
// without prefills, a note saying why) and leaves nothing started.
TEST(TierPrefills, AFolderThatCannotBeMadeStartsNone) {
  TempDir artifact;
  TempDir run;
  drained_on_one_gpu(artifact, "7");
  const auto script = run / "prefill.sh";
  write(script, "#!/bin/sh\necho started >> " + (run / "calls").string() + "\n");
  ASSERT_EQ(::chmod(script.c_str(), 0755), 0);
  write(run / "state", "a file where the run directory should be");
  ::setenv("GPUSNAP_TIER_PREFILL", script.c_str(), 1);
  EXPECT_THROW(TierPrefills(artifact.path(), {}, 2, run / "state"), Error);
  ::unsetenv("GPUSNAP_TIER_PREFILL");
  EXPECT_FALSE(std::filesystem::exists(run / "calls"));
}

}  // namespace
}  // namespace gpusnap::engine
