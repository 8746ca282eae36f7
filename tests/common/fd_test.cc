// UniqueFd: one owner per descriptor, and close_checked() for writers that must see a failed
// close.
#include "common/fd.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>

namespace gpusnap::common {
namespace {

TEST(UniqueFdTest, CloseCheckedClosesOnceAndReportsAFailedClose) {
  UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  const int raw = fd.get();
  EXPECT_EQ(fd.close_checked(), 0);
  EXPECT_FALSE(fd.valid());
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);  // closed, not merely let go
  EXPECT_EQ(fd.close_checked(), 0);      // nothing left to close

  // A descriptor closed behind the owner's back: its close fails, and says so.
  UniqueFd stolen(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(stolen.valid());
  ASSERT_EQ(::close(stolen.get()), 0);
  EXPECT_EQ(stolen.close_checked(), EBADF);
  EXPECT_FALSE(stolen.valid());
}

}  // namespace
}  // namespace gpusnap::common
