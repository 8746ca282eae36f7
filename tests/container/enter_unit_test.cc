// How CRIU is named from inside a container's mount namespace: host paths through the host
// root descriptor, and the private prefix's loader in place of its shell wrapper.
#include "container/enter.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include "testing/unit.h"

namespace gpusnap::container {
namespace {

TEST(ContainerEnterTest, HostPathsGoThroughTheHostRootDescriptor) {
  EXPECT_EQ(host_path("/run/gpusnap/copies/x/../y/restore.log"),
            "/proc/self/fd/9/run/gpusnap/copies/y/restore.log");
}

TEST(ContainerEnterTest, CriuFromAPrefixRunsThroughItsOwnLoader) {
  testing::TempDir dir;
  for (const char* f : {"usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", "usr/sbin/criu"}) {
    std::filesystem::create_directories((dir / f).parent_path());
    testing::write(dir / f, "");
  }
  testing::write(dir / "criu", "#!/bin/sh\n");
  auto p = dir.path().string();
  auto argv = criu_argv_inside(criu::Binary{p + "/criu", "4.2"}, {p + "/criu", "dump", "-v4"});
  EXPECT_EQ(argv, (std::vector<std::string>{
                      "/proc/self/fd/9" + p + "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
                      "--inhibit-cache", "--library-path",
                      "/proc/self/fd/9" + p + "/usr/lib/x86_64-linux-gnu:/proc/self/fd/9" + p +
                          "/lib/x86_64-linux-gnu",
                      "/proc/self/fd/9" + p + "/usr/sbin/criu", "dump", "-v4"}));
}

TEST(ContainerEnterTest, CriuThatIsNotAPrefixIsRefusedNamingTheFix) {
  auto error = testing::error_of([] { criu_command(criu::Binary{"/bin/true", "4.2"}); });
  ASSERT_TRUE(error);
  EXPECT_EQ(error->one_line(),
            "CRIU at /bin/true is not a private prefix with its own loader, which a container "
            "capture needs (CRIU runs inside the container's mount namespace) (fix: run "
            "scripts/install-criu and use /opt/gpusnap/criu/criu)");
  EXPECT_EQ(error->kind(), ErrorKind::kEnvironment);
}

}  // namespace
}  // namespace gpusnap::container
