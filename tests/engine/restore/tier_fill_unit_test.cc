// The memory tier's part of a restore's check (src/engine/restore/tier_fill.h): which tier files
// the artifact's check leaves to verify-tier, and verify-tier finding a damaged one. The
// prefill program is switched off here (it needs a GPU); what is left is gpusnap's own side.
#include "engine/restore/tier_fill.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "gpusnap/phases.h"
#include "store/plain_artifact.h"
#include "testing/unit.h"

namespace gpusnap::engine {
namespace {

using gpusnap::testing::TempDir;

// An artifact still arriving, as the restore sees it: here every file is there already.
class AllThere final : public ArrivingArtifact {
 public:
  explicit AllThere(std::filesystem::path dir) : dir_(std::move(dir)) {}
  std::filesystem::path staging() override { return dir_; }
  void await_criu_images() override {}
  void await_host_images() override {}
  void watch(Progress) override {}
  std::filesystem::path complete() override { return dir_; }

 private:
  std::filesystem::path dir_;
};

// A tier snapshot's files: process 7's index, layout and two drain files, and a CRIU image.
void tier_artifact(const std::filesystem::path& root) {
  std::filesystem::create_directories(root / "tier");
  std::filesystem::create_directories(root / "criu");
  fs::write_file(root / "tier" / "7.json",
                 R"({"format":"gpusnap-tier","version":1,"pid":7,"bytes":8,"files":[],)"
                 R"("gpus":[{"uuid":"GPU-a","bytes":8}]})");
  fs::write_file(root / "tier" / "7.layout", "x");
  fs::write_file(root / "tier" / "7-w0.img", std::string(8192, 'a'));
  fs::write_file(root / "tier" / "7-w1.img", std::string(4096, 'b'));
  fs::write_file(root / "criu" / "pages-1.img", std::string(4096, 'c'));
  gpusnap::testing::write_plain_manifest(root);
}

class TierFillCheck : public ::testing::Test {
 protected:
  TierFillCheck() {
    ::setenv("GPUSNAP_TIER_PREFILL", "off", 1);
    tier_artifact(artifact.path());
    options.run_dir = run.path();
  }
  ~TierFillCheck() override { ::unsetenv("GPUSNAP_TIER_PREFILL"); }
  TempDir artifact;
  TempDir run;
  RestoreOptions options;
  Reporter quiet;
};

// Arriving, the drain files come after the artifact's check starts: every one is left to
// verify-tier, which reads those no prefill summed, and finds a damaged one.
TEST_F(TierFillCheck, AnArrivingArtifactsDrainFilesAreAllCheckedAtVerifyTier) {
  const Artifact a = Artifact::open(artifact.path());
  AllThere arriving(artifact.path());
  TierFill tier(quiet);
  tier.start_prefills(artifact.path(), a.manifest(), {}, options, &arriving);
  EXPECT_EQ(tier.checked_by_tier(), (std::set<std::string>{"tier/7-w0.img", "tier/7-w1.img"}));
  EXPECT_TRUE(tier.verify(a).empty());
  {
    std::fstream f(artifact / "tier" / "7-w1.img", std::ios::in | std::ios::out);
    f.seekp(100);
    f.put('z');
  }
  const auto problems = tier.verify(a);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].path, "tier/7-w1.img");
}

// All there and no prefill summing: the artifact's own check reads every file, nothing is left
// to verify-tier; with --no-verify nothing is, arriving or not.
TEST_F(TierFillCheck, OtherwiseOnlyWhatThePrefillsSummedIsLeftToVerifyTier) {
  const Artifact a = Artifact::open(artifact.path());
  TierFill local(quiet);
  local.start_prefills(artifact.path(), a.manifest(), {}, options);
  EXPECT_TRUE(local.checked_by_tier().empty());
  options.verify = false;
  AllThere arriving(artifact.path());
  TierFill unverified(quiet);
  unverified.start_prefills(artifact.path(), a.manifest(), {}, options, &arriving);
  EXPECT_TRUE(unverified.checked_by_tier().empty());
}

}  // namespace
}  // namespace gpusnap::engine
