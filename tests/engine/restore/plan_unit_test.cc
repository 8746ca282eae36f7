// The restore's order (src/engine/restore/plan.h), for every combination of its flags: the
// exact steps for the common cases, and for all 32 the invariants the order exists for.
#include "engine/restore/plan.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace gpusnap::engine {
namespace {

using S = RestoreStep;

std::vector<std::string> phases_of(const std::vector<S>& steps) {
  std::vector<std::string> names;
  for (S s : steps) {
    if (!phase_name(s).empty()) names.emplace_back(phase_name(s));
  }
  return names;
}

RestoreFlags flags(bool gpu, bool handshake, bool arriving, bool verify, bool into) {
  return {gpu, handshake, arriving, verify, into};
}

TEST(RestorePlan, ACpuSnapshotIsCheckedBeforeCriuLetsItRun) {
  EXPECT_EQ(plan_restore(flags(false, false, false, true, false)),
            (std::vector<S>{S::kVerify, S::kCriuRestore, S::kLocate, S::kRelease}));
  EXPECT_EQ(plan_restore(flags(false, false, false, false, false)),
            (std::vector<S>{S::kCriuRestore, S::kLocate, S::kRelease}));
}

TEST(RestorePlan, ACpuSnapshotStillArrivingIsAwaitedWholeFirst) {
  EXPECT_EQ(phases_of(plan_restore(flags(false, true, true, true, true))),
            (std::vector<std::string>{"placeholder", "await-artifact", "verify", "criu-restore",
                                      "locate", "resume", "release"}));
}

TEST(RestorePlan, AGpuSnapshotIsCheckedBesideCriuAndItsTierFilledAhead) {
  EXPECT_EQ(
      plan_restore(flags(true, true, false, true, false)),
      (std::vector<S>{S::kStartGpuInit, S::kStartTierPrefills, S::kStartVerify, S::kCriuRestore,
                      S::kLocate, S::kGpuInit, S::kAwaitVerify, S::kGpuRestore, S::kVerifyTier,
                      S::kResume, S::kTierPrefills, S::kRelease}));
}

TEST(RestorePlan, AGpuSnapshotStillArrivingGivesCriuItsImagesFirstAndItsTierFillsAsItArrives) {
  EXPECT_EQ(plan_restore(flags(true, true, true, true, false)),
            (std::vector<S>{S::kStartGpuInit, S::kAwaitCriuImages, S::kStartTierPrefills,
                            S::kCriuRestore, S::kLocate, S::kAwaitHostImages, S::kStartVerify,
                            S::kGpuInit, S::kAwaitVerify, S::kGpuRestore, S::kAwaitArtifact,
                            S::kVerifyTier, S::kResume, S::kTierPrefills, S::kRelease}));
}

TEST(RestorePlan, EveryStepHasTheNameItIsReportedUnder) {
  EXPECT_EQ(phases_of(plan_restore(flags(true, true, false, true, true))),
            (std::vector<std::string>{"placeholder", "criu-restore", "locate", "gpu-init", "verify",
                                      "gpu-restore", "verify-tier", "resume", "tier-prefills",
                                      "release"}));
}

// All 32 combinations of the flags.
class EveryRestorePlan : public ::testing::TestWithParam<int> {
 protected:
  EveryRestorePlan()
      : f(flags(GetParam() & 1, GetParam() & 2, GetParam() & 4, GetParam() & 8, GetParam() & 16)),
        steps(plan_restore(f)) {}
  size_t count(S s) const { return std::count(steps.begin(), steps.end(), s); }
  bool has(S s) const { return count(s) > 0; }
  // Where `s` runs; fails the test when it does not.
  ptrdiff_t at(S s) const {
    auto it = std::find(steps.begin(), steps.end(), s);
    EXPECT_NE(it, steps.end()) << "no step " << static_cast<int>(s);
    return it - steps.begin();
  }
  const RestoreFlags f;
  const std::vector<S> steps;
};

// Which steps run, each exactly once where it runs (the order is checked below).
TEST_P(EveryRestorePlan, RunsEachStepOnceWhereItsFeatureIs) {
  const bool prefills = f.gpu_state && f.handshake;
  const std::vector<std::pair<S, bool>> expected = {
      {S::kStartGpuInit, f.gpu_state},
      {S::kPlaceholder, f.into_container},
      {S::kAwaitArtifact, f.arriving},
      {S::kStartTierPrefills, prefills},
      {S::kVerify, f.verify && !f.gpu_state},
      {S::kStartVerify, f.verify && f.gpu_state},
      {S::kAwaitCriuImages, f.arriving && f.gpu_state},
      {S::kAwaitHostImages, f.arriving && f.gpu_state},
      {S::kCriuRestore, true},
      {S::kLocate, true},
      {S::kGpuInit, f.gpu_state},
      {S::kAwaitVerify, f.verify && f.gpu_state},
      {S::kGpuRestore, f.gpu_state},
      {S::kVerifyTier, f.verify && prefills},
      {S::kResume, f.handshake},
      {S::kTierPrefills, prefills},
      {S::kRelease, true},
  };
  size_t total = 0;
  for (const auto& [step, runs] : expected) {
    EXPECT_EQ(count(step), runs ? 1u : 0u) << "step " << static_cast<int>(step);
    total += runs ? 1 : 0;
  }
  EXPECT_EQ(steps.size(), total);
  // One "verify" phase where verifying, none with --no-verify; no phase name twice.
  const auto names = phases_of(steps);
  EXPECT_EQ(std::count(names.begin(), names.end(), "verify"), f.verify ? 1 : 0);
  auto sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
}

TEST_P(EveryRestorePlan, CriuRestoresBetweenWhatItNeedsAndWhatNeedsTheCopies) {
  EXPECT_LT(at(S::kCriuRestore), at(S::kLocate));
  EXPECT_EQ(steps.back(), S::kRelease);
  if (f.into_container) {
    EXPECT_LT(at(S::kPlaceholder), at(S::kCriuRestore));
  }
  if (f.arriving && f.gpu_state) {
    EXPECT_LT(at(S::kAwaitCriuImages), at(S::kCriuRestore));
    // CRIU reads the staging directory by its path until the copies are located.
    EXPECT_GT(at(S::kAwaitHostImages), at(S::kLocate));
    EXPECT_GT(at(S::kAwaitArtifact), at(S::kAwaitHostImages));
  }
  if (f.handshake) {
    EXPECT_GT(at(S::kResume), at(S::kLocate));
  }
}

TEST_P(EveryRestorePlan, NothingRunsUncheckedOrBeforeItsBytesArrived) {
  if (f.arriving && !f.gpu_state) {
    if (has(S::kVerify)) {
      EXPECT_LT(at(S::kAwaitArtifact), at(S::kVerify));
    }
    EXPECT_LT(at(S::kAwaitArtifact), at(S::kCriuRestore));
  }
  if (f.arriving && f.gpu_state) {
    // The check and the driver's restore read every file but the tier's drain files...
    if (has(S::kStartVerify)) {
      EXPECT_LT(at(S::kAwaitHostImages), at(S::kStartVerify));
    }
    EXPECT_LT(at(S::kAwaitHostImages), at(S::kGpuRestore));
    // ...which are all there, and checked, before a copy resumes and its tier reads them.
    if (has(S::kVerifyTier)) {
      EXPECT_LT(at(S::kAwaitArtifact), at(S::kVerifyTier));
    }
    if (f.handshake) {
      EXPECT_LT(at(S::kAwaitArtifact), at(S::kResume));
    }
  }
  if (f.verify && !f.gpu_state) {
    EXPECT_LT(at(S::kVerify), at(S::kCriuRestore));
  }
  if (f.verify && f.gpu_state) {
    EXPECT_LT(at(S::kStartVerify), at(S::kAwaitVerify));
    EXPECT_LT(at(S::kAwaitVerify), at(S::kGpuRestore));
  }
  if (has(S::kVerifyTier)) {
    EXPECT_LT(at(S::kGpuRestore), at(S::kVerifyTier));
    if (f.handshake) {
      EXPECT_LT(at(S::kVerifyTier), at(S::kResume));
    }
  }
}

TEST_P(EveryRestorePlan, BackgroundWorkStartsBeforeCriuAndIsAwaitedBeforeItIsUsed) {
  if (f.gpu_state) {
    EXPECT_LT(at(S::kStartGpuInit), at(S::kCriuRestore));
    EXPECT_GT(at(S::kGpuInit), at(S::kCriuRestore));
    EXPECT_LT(at(S::kGpuInit), at(S::kGpuRestore));
  }
  if (has(S::kStartTierPrefills)) {
    EXPECT_LT(at(S::kStartTierPrefills), at(S::kCriuRestore));
    // The prefills start from the tier's layouts, which arrive with CRIU's images.
    if (f.arriving) {
      EXPECT_LT(at(S::kAwaitCriuImages), at(S::kStartTierPrefills));
    }
    // The background check leaves out what the prefills read: they must have started.
    if (has(S::kStartVerify)) {
      EXPECT_LT(at(S::kStartTierPrefills), at(S::kStartVerify));
    }
    EXPECT_LT(at(S::kResume), at(S::kTierPrefills));
  }
  if (has(S::kStartVerify) && !f.arriving) {
    EXPECT_LT(at(S::kStartVerify), at(S::kCriuRestore));
  }
}

// The phases engine/restore.cc's head comment lists, in order, for snapshots without GPU state
// (`gpu` false) or with it: the text after "without GPU state:" or "with GPU state:", up to the
// next list or the first line that is not a continuation.
std::vector<std::string> head_comment_list(bool gpu) {
  std::ifstream in(std::string(GPUSNAP_SOURCE_DIR) + "/src/engine/restore.cc");
  const std::string label = gpu ? "//   with GPU state:" : "//   without GPU state:";
  std::string line, text;
  bool inside = false;
  while (std::getline(in, line)) {
    if (line.rfind(label, 0) == 0) {
      inside = true;
      text = line.substr(label.size());
    } else if (inside && line.rfind("//      ", 0) == 0) {
      text += " " + line.substr(2);
    } else if (inside) {
      break;
    }
  }
  std::vector<std::string> names;
  std::istringstream words(text);
  for (std::string w; words >> w;) names.push_back(w.back() == ',' ? w.substr(0, w.size() - 1) : w);
  return names;
}

// The flow's head comment is the plan: every plan's phases are its list, less the phases of the
// features that plan has not.
TEST_P(EveryRestorePlan, IsTheListAtTheHeadOfTheFlow) {
  const auto listed = head_comment_list(f.gpu_state);
  ASSERT_FALSE(listed.empty());
  auto planned = phases_of(steps);
  planned.insert(planned.begin(), "open");
  std::vector<std::string> filtered;
  for (const auto& name : listed) {
    if (std::find(planned.begin(), planned.end(), name) != planned.end()) filtered.push_back(name);
  }
  EXPECT_EQ(filtered, planned);
}

INSTANTIATE_TEST_SUITE_P(AllFlags, EveryRestorePlan, ::testing::Range(0, 32),
                         [](const ::testing::TestParamInfo<int>& info) {
                           const int b = info.param;
                           std::string name;
                           name += (b & 1) ? "Gpu" : "Cpu";
                           name += (b & 2) ? "Handshake" : "";
                           name += (b & 4) ? "Arriving" : "";
                           name += (b & 8) ? "Verify" : "NoVerify";
                           name += (b & 16) ? "IntoContainer" : "";
                           return name;
                         });

}  // namespace
}  // namespace gpusnap::engine
