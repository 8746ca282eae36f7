// Fan-out: four nodes, each its own network namespace behind a link limited by tc, pull the
// same snapshot at once from an origin registry whose link is limited the same way; without a
// mirror and through a pull-through docker-registry named by a registries.conf (store/fanout.h).
#include "store/fanout.h"

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

namespace sfs = std::filesystem;

// Every file of an artifact (manifest included) with its bytes.
std::map<std::string, std::string> contents(const sfs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : sfs::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) out[sfs::relative(e.path(), root).string()] = fs::read_file(e.path());
  }
  return out;
}

void print_result(const FanoutRun& run, uint64_t stored) {
  nlohmann::json doc = {{"configuration", run.configuration},
                        {"origin_bytes", run.origin_bytes},
                        {"x_stored", static_cast<double>(run.origin_bytes) / stored},
                        {"last_done_s", run.last_done_s}};
  std::printf("RESULT fanout %s\n", doc.dump().c_str());
}

TEST(StoreFanout, FourNodesCostTheOriginFourCopiesWithoutAMirrorAndTwoThroughAWarmedOne) {
  SKIP_WITHOUT_CRIU();
  GPUSNAP_SKIP_IF_BLOCKED(Fanout::blocker());
  TempDir dir;
  const sfs::path artifact = dir / "snap";
  {
    Workload w(dir, {"--mib", "32", "--children", "1", "--seed", "37"});
    auto r =
        gpusnap({"checkpoint", "--pid", std::to_string(w.pid()), "-o", artifact.string(), "-q"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  const auto want = contents(artifact);
  Fanout fanout(dir, artifact, {.nodes = 4, .rate_mbit = 200});
  const double stored = static_cast<double>(fanout.stored_bytes());
  auto check = [&](const FanoutRun& run) {
    print_result(run, fanout.stored_bytes());
    for (const auto& copy : run.copies) {
      // Named by file, not printed: a failure would otherwise dump the snapshot's bytes.
      const auto got = contents(copy);
      std::vector<std::string> differ;
      for (const auto& [name, bytes] : want) {
        auto it = got.find(name);
        if (it == got.end() || it->second != bytes) differ.push_back(name);
      }
      EXPECT_EQ(got.size(), want.size()) << copy;
      EXPECT_TRUE(differ.empty()) << copy << ": " << ::testing::PrintToString(differ);
    }
  };

  const FanoutRun alone = fanout.alone();
  check(alone);
  EXPECT_NEAR(alone.origin_bytes / stored, 1.0, 0.05);

  const FanoutRun direct = fanout.without_mirror();
  check(direct);
  EXPECT_NEAR(direct.origin_bytes / stored, 4.0, 0.2);

  // docker-registry's proxy fetches a blob it lacks twice from the origin (once streamed to the
  // node, once to keep), and every node missing the same blob at once gets its own stream
  // (4 nodes at once through an empty mirror: 5x, measured; `bench/run fanout` shows it).
  // One node first fills the mirror at 2x; the other three then cost the origin nothing.
  const FanoutRun warmed = fanout.with_mirror_warmed_by_one();
  check(warmed);
  EXPECT_GE(warmed.origin_bytes / stored, 1.9);
  EXPECT_LE(warmed.origin_bytes / stored, 2.2);
}

}  // namespace
}  // namespace gpusnap::testing
