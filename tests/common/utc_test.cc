// The one RFC 3339 time gpusnap writes: its form at each precision, and that it is now.
#include "common/utc.h"

#include <gtest/gtest.h>
#include <time.h>

#include <ctime>
#include <regex>
#include <string>

namespace gpusnap::utc {
namespace {

TEST(UtcTest, SecondsAndMillisecondsForms) {
  EXPECT_TRUE(std::regex_match(now(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)"))) << now();
  EXPECT_TRUE(std::regex_match(now(Precision::kMilliseconds),
                               std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)")))
      << now(Precision::kMilliseconds);
}

// The seconds of the clock now() reads. Not time(): the C library answers it from the kernel's
// coarse clock, which can still show the last second when the precise one has passed it.
std::time_t realtime_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec;
}

TEST(UtcTest, IsTheCurrentTimeInUtc) {
  const std::time_t before = realtime_seconds();
  const std::string text = now();
  const std::time_t after = realtime_seconds();
  std::tm tm{};
  ASSERT_NE(::strptime(text.c_str(), "%Y-%m-%dT%H:%M:%SZ", &tm), nullptr) << text;
  const std::time_t parsed = ::timegm(&tm);
  EXPECT_GE(parsed, before) << text;
  EXPECT_LE(parsed, after) << text;
}

}  // namespace
}  // namespace gpusnap::utc
