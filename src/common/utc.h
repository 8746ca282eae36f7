// Wall-clock time as gpusnap writes it everywhere (the manifest's `created`, the agent's
// operations, the controller's Kubernetes objects and log lines): RFC 3339 in UTC.
#pragma once

#include <cstdint>
#include <string>

namespace gpusnap::utc {

enum class Precision {
  kSeconds,       // "2026-12-01T16:07:56Z"
  kMilliseconds,  // "2026-12-01T16:07:56.042Z": the agent orders operations by it
};

// The current time. Never throws beyond std::bad_alloc.
std::string now(Precision precision = Precision::kSeconds);
// A time given in seconds since the epoch, to the second.
std::string at(int64_t seconds);

}  // namespace gpusnap::utc
