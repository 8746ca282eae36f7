// Finding a container's runc root from its ID, on directories laid out as runc, containerd's
// runc v2 shim and containerd's task state lay them out (the system tests run the real ones).
#include "container/runtime_root.h"

#include <gtest/gtest.h>

#include "testing/unit.h"

namespace gpusnap::container {
namespace {

namespace stdfs = std::filesystem;

class RuntimeRootTest : public ::testing::Test {
 protected:
  // A container's runc state in `root`, as runc writes it.
  void container_in(const stdfs::path& root, const std::string& id) {
    testing::write(root / id / "state.json", "{}");
  }
  // A containerd task in `ns` whose runtime options name `root` (the `Root` option).
  void task_with_root(const std::string& ns, const std::string& id, const stdfs::path& root) {
    testing::write(dir_ / "containerd/io.containerd.runtime.v2.task" / ns / id / "options.json",
                   "{\"root\":\"" + root.string() + "\"}");
  }

  testing::TempDir dir_;
  RootSearch search_{{dir_ / "runc"}, {dir_ / "containerd/runc"}, {dir_ / "containerd"}};
};

TEST_F(RuntimeRootTest, FindsTheRootThatHoldsTheId) {
  container_in(dir_ / "runc", "plain");
  container_in(dir_ / "containerd/runc/k8s.io", "pod-a");
  container_in(dir_ / "containerd/runc/default", "other");
  EXPECT_EQ(find_runtime_root("plain", search_), dir_ / "runc");
  EXPECT_EQ(find_runtime_root("pod-a", search_), dir_ / "containerd/runc/k8s.io");
  EXPECT_EQ(find_runtime_root("other", search_), dir_ / "containerd/runc/default");
}

TEST_F(RuntimeRootTest, FollowsARootThatContainerdsTaskOptionsName) {
  // The shim runs runc with --root ROOT/NAMESPACE when the task's options name ROOT.
  task_with_root("k8s.io", "pod-b", dir_ / "elsewhere");
  container_in(dir_ / "elsewhere/k8s.io", "pod-b");
  EXPECT_EQ(find_runtime_root("pod-b", search_), dir_ / "elsewhere/k8s.io");
  // Options that are not an object with a string root are passed over.
  testing::write(dir_ / "containerd/io.containerd.runtime.v2.task/k8s.io/bad/options.json", "[1");
  EXPECT_EQ(find_runtime_root("pod-b", search_), dir_ / "elsewhere/k8s.io");
}

TEST_F(RuntimeRootTest, RefusesAnIdInNoRootOrInTwoNamingThem) {
  container_in(dir_ / "containerd/runc/k8s.io", "twin");
  container_in(dir_ / "runc", "twin");
  auto missing = testing::catch_error([&] { find_runtime_root("nosuch", search_); });
  EXPECT_EQ(missing.kind(), ErrorKind::kNotFound);
  EXPECT_STREQ(missing.what(),
               ("container nosuch was not found in the runtime roots searched (" +
                (dir_ / "runc").string() + ", " + (dir_ / "containerd/runc/k8s.io").string() + ")")
                   .c_str());
  auto twin = testing::catch_error([&] { find_runtime_root("twin", search_); });
  EXPECT_EQ(twin.kind(), ErrorKind::kUsage);
  EXPECT_STREQ(twin.what(), ("container twin is in 2 runtime roots (" + (dir_ / "runc").string() +
                             ", " + (dir_ / "containerd/runc/k8s.io").string() + ")")
                                .c_str());
}

TEST_F(RuntimeRootTest, RefusesWhatRuncWouldNotTakeAsAnId) {
  for (const char* id : {"", "..", ".", "a/b", "../runc", "a b"}) {
    auto e = testing::catch_error([&] { find_runtime_root(id, search_); });
    EXPECT_EQ(e.kind(), ErrorKind::kUsage) << id;
    EXPECT_STREQ(e.what(), ("'" + std::string(id) + "' is not a container id").c_str()) << id;
  }
}

TEST_F(RuntimeRootTest, NoRootsAtAll) {
  auto e = testing::catch_error([&] { find_runtime_root("x", search_); });
  EXPECT_STREQ(e.what(), "container x was not found in the runtime roots searched (none exists)");
}

}  // namespace
}  // namespace gpusnap::container
