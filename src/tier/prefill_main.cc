// gpusnap-tier-prefill: started by `gpusnap restore` for every copy and every process whose
// memory tier the artifact holds, before CRIU restores the copy (tier/prefill.h).
//
//   gpusnap-tier-prefill DIR PID SOCKET GPU-UUID UID GID TIMEOUT-MS DONE-FD
//
// Listens on SOCKET at once (owned by UID:GID, the workload's user, mode 0600), fills PID's
// memory from DIR on the GPU with GPU-UUID, then offers it to the first connection and exits
// once the copy has mapped it (0), or when anything fails or nobody takes the memory within
// TIMEOUT-MS (non-zero: the copy's tier then fills by itself). One line on stderr says what it
// did; then it closes DONE-FD (-1: none), before its exit tears its CUDA context down, so that
// gpusnap knows the outcome without waiting for that teardown. The settings of the workload's
// tier apply (GPUSNAP_TIER_BUFFER_MIB, ...), but with 8 workers (GPUSNAP_TIER_PREFILL_STREAMS).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "common/fd.h"
#include "gpusnap/error.h"
#include "tier/handover.h"
#include "tier/layout.h"
#include "tier/prefill.h"

namespace {

using gpusnap::Error;
using gpusnap::ErrorKind;
namespace tier = gpusnap::tier;

int device_with_uuid(tier::TierDriver& driver, const std::string& uuid) {
  for (int d = 0; d < driver.device_count(); ++d) {
    if (driver.device_uuid(d) == uuid) return d;
  }
  throw Error(ErrorKind::kIncompatible, "no GPU " + uuid + " here");
}

// Says "done" to gpusnap: the report line is written, what follows is the exit alone.
void close_done_fd(const std::string& text) {
  const int fd = std::stoi(text);
  if (fd > 2) ::close(fd);
}

// The workload's tier settings, but 8 workers instead of its 16: the prefill shares the machine
// with CRIU's and the driver's restores of the copy. On the H200 (16 GiB) 8 filled as fast beside
// them (24-29 GB/s either way) and the copy's first answer came no later (median 1.00 s over
// eight restores, against 1.02 s with 16; docs/benchmarks.md), with half the cores left to the
// restores, and to the other copies' prefills. GPUSNAP_TIER_PREFILL_STREAMS (1-64) sets it.
tier::TierSettings prefill_settings() {
  auto settings = tier::TierSettings::from_environment();
  settings.streams = 8;
  // NOLINTNEXTLINE(concurrency-mt-unsafe): read once, before any thread starts
  if (const char* text = std::getenv("GPUSNAP_TIER_PREFILL_STREAMS"); text != nullptr) {
    char* end = nullptr;
    const long v = std::strtol(text, &end, 10);
    if (*end == '\0' && v >= 1 && v <= 64) settings.streams = static_cast<int>(v);
  }
  return settings;
}

int run(const std::vector<std::string>& a) {
  const std::filesystem::path dir = a[0];
  const std::string& pid = a[1];
  const std::filesystem::path socket = a[2];
  const auto timeout = std::chrono::milliseconds(std::stol(a[6]));
  // Listening before anything else: the copy may connect while the memory is still filled,
  // and then waits for the offer.
  gpusnap::common::UniqueFd listener = tier::listen_for_handover(socket);
  if (::chown(socket.c_str(), static_cast<uid_t>(std::stoul(a[4])),
              static_cast<gid_t>(std::stoul(a[5]))) != 0) {
    throw gpusnap::sys_error("chown " + socket.string(), errno);
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto driver = tier::open_cuda_tier_driver();
  const int device = device_with_uuid(*driver, a[3]);
  tier::TierLayout layout = tier::read_layout(dir / (pid + ".layout"));
  std::vector<std::string> files;
  for (std::size_t k = 0; k < layout.files; ++k)
    files.push_back(pid + "-w" + std::to_string(k) + ".img");
  tier::Prefill prefill(*driver, prefill_settings(), std::move(layout), dir, files, device);
  const auto report = prefill.fill();
  const double filled_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  pollfd p{listener.get(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) {
    throw Error(ErrorKind::kTimeout, "nobody took the memory within " + a[6] + " ms");
  }
  gpusnap::common::UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (conn.get() < 0) throw gpusnap::sys_error("accept", errno);
  const bool taken = prefill.hand_over(conn.get());
  std::fprintf(stderr,
               "gpusnap-tier-prefill: %zu bytes of %s filled in %.3f s (%.1f GB/s copying; "
               "making and mapping the memory %.3f s, pinning %.3f s; ready %.3f s after "
               "start), %s\n",
               report.bytes, pid.c_str(), report.seconds,
               report.seconds > 0 ? static_cast<double>(report.bytes) / report.seconds / 1e9 : 0.0,
               report.map_seconds, report.buffer_seconds, filled_s,
               taken ? "taken by the copy" : "refused by the copy");
  ::unlink(socket.c_str());
  // Before `prefill` and `driver` end: unmapping and releasing the memory and the context is
  // the slow part of the exit, and the copy no longer needs this process.
  close_done_fd(a[7]);
  return taken ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: gpusnap-tier-prefill DIR PID SOCKET GPU-UUID UID GID TIMEOUT-MS "
                         "DONE-FD (started by gpusnap restore)\n");
    return 2;
  }
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpusnap-tier-prefill: %s\n", e.what());
    ::unlink(argv[3]);
    return 1;  // DONE-FD closes with the exit
  }
}
