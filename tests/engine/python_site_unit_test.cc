// Where `gpusnap run --memory-tier` finds its Python site folder, and what it puts into the
// workload's environment (engine/python_site.h). What the folder's sitecustomize does in a real
// Python is tests/handshake/test_python_site.py; the whole route under `gpusnap run`,
// tests/cli/handshake_system_test.cc.
#include "engine/python_site.h"

#include <unistd.h>

#include "testing/unit.h"

namespace gpusnap::engine {
namespace {

using testing::Contains;
using testing::ScopedEnv;

class PythonSite : public ::testing::Test {
 protected:
  // A complete site folder, and one without its handshake module.
  PythonSite() {
    testing::write(dir_ / "site" / "sitecustomize.py", "# gpusnap's\n");
    testing::write(dir_ / "site" / "gpusnap_handshake.py", "# gpusnap's\n");
    testing::write(dir_ / "partial" / "sitecustomize.py", "# gpusnap's\n");
  }
  testing::TempDir dir_;
};

TEST_F(PythonSite, NamedByTheVariable) {
  ScopedEnv env(kPythonSiteEnv, (dir_ / "site").string());
  EXPECT_EQ(find_python_site(), dir_ / "site");
}

TEST_F(PythonSite, AFolderWithoutBothFilesIsAUsageError) {
  for (const char* folder : {"partial", "missing"}) {
    ScopedEnv env(kPythonSiteEnv, (dir_ / folder).string());
    const Error e = testing::catch_error([] { find_python_site(); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage);
    EXPECT_EQ(std::string(e.what()),
              "GPUSNAP_PYTHON_SITE names " + (dir_ / folder).string() +
                  ", which holds no readable sitecustomize.py and gpusnap_handshake.py");
    EXPECT_TRUE(Contains(e.hint(), "or run without --memory-tier and call "
                                   "gpusnap_handshake.use_memory_tier() in the workload"));
  }
}

TEST_F(PythonSite, WithoutTheVariableBesideTheBinaryElseInstalledElseAUsageError) {
  // The unit test binary is build/tests/...: no python/ beside it. So /opt/gpusnap/python, where
  // this host has one installed, or an error naming both places.
  ScopedEnv env(kPythonSiteEnv, "");
  if (::access((std::filesystem::path(kInstalledPythonSite) / "sitecustomize.py").c_str(), R_OK) ==
      0) {
    EXPECT_EQ(find_python_site(), kInstalledPythonSite);
    return;
  }
  const Error e = testing::catch_error([] { find_python_site(); });
  EXPECT_EQ(e.kind(), ErrorKind::kUsage);
  const auto beside = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "python";
  EXPECT_EQ(std::string(e.what()), "--memory-tier needs gpusnap's Python site folder: neither " +
                                       beside.string() +
                                       " nor /opt/gpusnap/python holds sitecustomize.py and "
                                       "gpusnap_handshake.py");
  EXPECT_TRUE(Contains(e.hint(), "point GPUSNAP_PYTHON_SITE at gpusnap's Python folder"));
}

TEST_F(PythonSite, TheFolderGoesFirstOnPythonPathBeforeGpusnapsOwn) {
  const auto site = dir_ / "site";
  {
    ScopedEnv path("PYTHONPATH", "/srv/app:/srv/lib");
    EXPECT_EQ(memory_tier_environment(site),
              (std::vector<std::string>{"PYTHONPATH=" + site.string() + ":/srv/app:/srv/lib",
                                        "GPUSNAP_MEMORY_TIER=1"}));
  }
  ScopedEnv path("PYTHONPATH", "");
  EXPECT_EQ(memory_tier_environment(site),
            (std::vector<std::string>{"PYTHONPATH=" + site.string(), "GPUSNAP_MEMORY_TIER=1"}));
}

}  // namespace
}  // namespace gpusnap::engine
