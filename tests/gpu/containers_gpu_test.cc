// GPU tests of PyTorch workloads in runc containers (ctest label `gpu`): a source container run
// by `gpusnap init`, captured with `gpusnap checkpoint --container`, restored with
// `gpusnap restore --into-container` into a placeholder started beforehand, the copy asked from
// inside the placeholder's network namespace. The containers' root is the host's programs
// (testing/containers.h, make_python_bundle), with the NVIDIA devices. "skipped: no GPU" without
// one, "skipped: runc ..." without runc on the PATH (the GPU machine has none: carry Debian's).
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "gpu/driver.h"
#include "testing/containers.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
namespace stdfs = std::filesystem;

std::optional<std::string> blocker() {
  if (auto why = host_container_blocker()) return why;
  auto driver = gpu::open_nvidia_driver();
  if (!driver->available()) return "no GPU (" + driver->reason() + ")";
  if (driver->facts().gpus.empty()) return "no GPU";
  return std::nullopt;
}

// One source container of tests/torch_tier.py (`tier_flag`, `gib` GiB) under `gpusnap init
// INIT_FLAGS --`, captured (the source stopped) and restored into a placeholder; the copy must
// replay its CUDA graph to the answer and hold every weight bit for bit. Returns the capture's
// manifest; `notes`, when given, gets the capture's notes.
json capture_and_restore(const std::string& tier_flag, double gib,
                         const std::vector<std::string>& init_flags = {},
                         std::string* notes = nullptr) {
  TempDir dir;
  const auto data = dir / "data";
  stdfs::create_directories(data);
  const std::string root = (dir / "runc").string();
  const std::string id = "gpusnap-gpu-" + fs::random_id().substr(0, 6);
  std::vector<std::string> args = {kPythonBundleGpusnap, "init"};
  args.insert(args.end(), init_flags.begin(), init_flags.end());
  for (const std::string& a :
       {std::string("--"), std::string("python3"), std::string("/tests/torch_tier.py"), tier_flag,
        std::string("--gib"), std::to_string(gib), std::string("--weights"),
        std::string("/data/weights.bin"), std::string("--port"), std::to_string(kContainerPort),
        std::string("--ready-file"), std::string("/data/ready")}) {
    args.push_back(a);
  }
  Container source(root, id + "-source", make_python_bundle(dir / "source", args, true, data));
  EXPECT_TRUE(source.started());
  if (!eventually([&] { return stdfs::exists(data / "ready"); }, std::chrono::minutes(5))) {
    ADD_FAILURE() << "the workload did not say READY in its container";
    return json();
  }
  const auto snap = dir / "snap";
  auto cp = gpusnap({"checkpoint", "--container", source.id(), "--runtime-root", root, "-o",
                     snap.string(), "--json"},
                    std::chrono::minutes(5));
  EXPECT_EQ(cp.exit_code, 0) << cp.out << cp.err;
  if (cp.exit_code != 0) return json();
  std::cout << "RESULT container" << tier_flag << "-checkpoint " << cp.out << std::endl;
  if (notes != nullptr) *notes = json::parse(cp.out).value("notes", json::array()).dump();

  Container placeholder(
      root, id + "-placeholder",
      make_python_bundle(dir / "placeholder", {kPythonBundleGpusnap, "init", "--placeholder"}, true,
                         data));
  EXPECT_TRUE(placeholder.started());
  auto rs = gpusnap({"restore", snap.string(), "--into-container", placeholder.id(),
                     "--runtime-root", root, "--run-dir", (dir / "run").string(), "--json"},
                    std::chrono::minutes(5));
  EXPECT_EQ(rs.exit_code, 0) << rs.out << rs.err;
  if (rs.exit_code != 0) return json();
  std::cout << "RESULT container" << tier_flag << "-restore " << rs.out << std::endl;
  const auto check = ask_in(placeholder.pid(), "CHECK", std::chrono::seconds(60));
  EXPECT_EQ(check.substr(0, 13), "OK max_err=0 ") << check;
  const auto verify = ask_in(placeholder.pid(), "VERIFY", std::chrono::seconds(300));
  EXPECT_EQ(verify.substr(0, 3), "OK ") << verify;
  return json::parse(fs::read_file(snap / "manifest.json"));
}

// The bytes of the artifact's tier files (tier/...), from its manifest.
uint64_t tier_bytes(const json& manifest) {
  uint64_t total = 0;
  for (const auto& f : manifest.at("files")) {
    if (f.at("path").get<std::string>().rfind("tier/", 0) == 0) {
      total += f.at("size").get<uint64_t>();
    }
  }
  return total;
}

// The tier's folders are mounted into the containers (docs/containers.md): the
// weights go through the tier's files, and the copy fills from them.
TEST(GpuContainer, WithTheMemoryTierRestoresIntoAPlaceholderBitExact) {
  GPUSNAP_SKIP_IF_BLOCKED(blocker());
  const json manifest = capture_and_restore("--tier", 4);
  ASSERT_FALSE(manifest.is_null());
  EXPECT_GE(tier_bytes(manifest), 4ULL << 30);
}

// `gpusnap init --memory-tier`: the workload never calls use_memory_tier() (--tier-by-gpusnap
// exits when no tier was installed at its `import torch`); the site folder beside the
// container's gpusnap installs it, and its memory goes through the tier's files.
TEST(GpuContainer, InitWithMemoryTierInstallsTheTierWithoutTheOneLine) {
  GPUSNAP_SKIP_IF_BLOCKED(blocker());
  const json manifest = capture_and_restore("--tier-by-gpusnap", 4, {"--memory-tier"});
  ASSERT_FALSE(manifest.is_null());
  EXPECT_GE(tier_bytes(manifest), 4ULL << 30);
}

// Without the tier the driver's host copy goes into host images through a mount in the
// container's /tmp, not through CRIU's pages: written there by the driver's checkpoint itself,
// through the preload library's request in a mount of its own.
TEST(GpuContainer, OnTheTransparentPathRestoresIntoAPlaceholderThroughHostImages) {
  GPUSNAP_SKIP_IF_BLOCKED(blocker());
  std::string notes;
  const json manifest = capture_and_restore("--no-tier", 2, {}, &notes);
  ASSERT_FALSE(manifest.is_null());
  EXPECT_NE(notes.find("written into the artifact by the driver's checkpoint itself"),
            std::string::npos)
      << notes;
  uint64_t imaged = 0;
  for (const auto& image : manifest.at("host_images")) {
    imaged += image.at("end").get<uint64_t>() - image.at("start").get<uint64_t>();
  }
  EXPECT_GE(imaged, 2ULL << 30);
}

}  // namespace
}  // namespace gpusnap::testing
