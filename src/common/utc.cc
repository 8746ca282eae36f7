#include "common/utc.h"

#include <time.h>

#include <cstdio>

namespace gpusnap::utc {

namespace {

std::string format(const timespec& ts, Precision precision) {
  struct tm tm {};
  ::gmtime_r(&ts.tv_sec, &tm);
  char buf[64];
  int n = std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d", tm.tm_year + 1900,
                        tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
  if (precision == Precision::kMilliseconds) {
    n += std::snprintf(buf + n, sizeof buf - n, ".%03d", static_cast<int>(ts.tv_nsec / 1000000));
  }
  std::snprintf(buf + n, sizeof buf - n, "Z");
  return buf;
}

}  // namespace

std::string now(Precision precision) {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return format(ts, precision);
}

std::string at(int64_t seconds) {
  return format(timespec{static_cast<time_t>(seconds), 0}, Precision::kSeconds);
}

}  // namespace gpusnap::utc
