// gpusnap-tier-prefill: started by `gpusnap restore` for every copy and every process whose
// memory tier the artifact holds, before CRIU restores the copy (tier/prefill.h).
//
//   gpusnap-tier-prefill DIR PID SOCKET GPU-UUID UID GID TIMEOUT-MS DONE-FD SUMS-FD CHUNK-BYTES
//                        ARRIVAL-FD
//
// Listens on SOCKET at once (owned by UID:GID, the workload's user, mode 0600), fills PID's
// memory from DIR on the GPU with GPU-UUID, then offers it to the first connection and exits
// once the copy has mapped it (0), or when anything fails or nobody takes the memory within
// TIMEOUT-MS (non-zero: the copy's tier then fills by itself). One line on stderr says what it
// did; then it closes DONE-FD (-1: none), before its exit tears its CUDA context down, so that
// gpusnap knows the outcome without waiting for that teardown. Once filled, and before it offers
// the memory, it writes on SUMS-FD (-1: none) the checksums of the files it read, in chunks of
// CHUNK-BYTES (0: none), one line per file read whole, "NAME SIZE HEX...", and closes it: gpusnap
// compares them with the manifest instead of reading the files again. ARRIVAL-FD (-1: every
// file is there) is a socket on which gpusnap says how much of each drain file a pull has
// written ("NAME BYTES" lines, tier/arrival.h): the fill reads each byte once it is there. The
// settings of the
// workload's tier apply (GPUSNAP_TIER_BUFFER_KIB, ...), with 16 workers
// (GPUSNAP_TIER_PREFILL_STREAMS).
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/fd.h"
#include "gpusnap/error.h"
#include "tier/arrival.h"
#include "tier/folder_format.h"
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

// Writes the checksums of every file read whole on `fd_text`'s descriptor, then closes it.
void write_sums(const std::string& fd_text, const std::vector<tier::FileSums>& sums) {
  const int fd = std::stoi(fd_text);
  if (fd <= 2) return;
  std::string text;
  for (const auto& f : sums) {
    if (!f.complete) continue;  // gpusnap reads that one itself
    text += f.name + " " + std::to_string(f.size);
    for (const auto& c : f.chunks) text += " " + c;
    text += "\n";
  }
  for (std::size_t at = 0; at < text.size();) {
    const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // gpusnap is gone or stopped listening: it reads the files itself
    at += static_cast<std::size_t>(n);
  }
  ::close(fd);
}

// The workload's tier settings, with 16 workers (GPUSNAP_TIER_PREFILL_STREAMS, 1-64): each
// reads its own files and checksums them as it reads, so the work per byte is CPU work. On the
// H200 (16 GiB, docs/memory-tier.md, "Measured: the prefill's workers and checksums") 16 filled
// in 0.55-0.72 s beside CRIU's and the driver's restores, 8 in 0.86-1.03 s; the copy's first answer
// came after 0.89-1.03 s (median 0.95 s) with 16, against 0.94-1.03 s when gpusnap read the files a
// second time to verify them.
tier::TierSettings prefill_settings() {
  auto settings = tier::TierSettings::from_environment();
  settings.streams = 16;
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
  tier::TierLayout layout = tier::read_layout(dir / tier::folder::layout_name(pid));
  std::vector<std::string> files;
  for (std::size_t k = 0; k < layout.files; ++k)
    files.push_back(tier::folder::drain_file_name(pid, k));
  // Read from the start, before CUDA's initialisation: gpusnap's lines wait in the socket
  // meanwhile, and its buffer is not unbounded.
  std::optional<tier::ArrivingFiles> arriving;
  if (const int feed = std::stoi(a[10]); feed > 2) {
    std::vector<std::uint64_t> sizes;
    for (const auto& name : files) sizes.push_back(std::filesystem::file_size(dir / name));
    arriving.emplace(gpusnap::common::UniqueFd(feed), files, std::move(sizes));
  }
  auto driver = tier::open_cuda_tier_driver();
  const int device = device_with_uuid(*driver, a[3]);
  const auto settings = prefill_settings();
  tier::Prefill prefill(*driver, settings, std::move(layout), dir, files, device, std::stoull(a[9]),
                        arriving ? &*arriving : nullptr);
  const auto report = prefill.fill();
  write_sums(a[8], prefill.sums());
  const double filled_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  pollfd p{listener.get(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) {
    throw Error(ErrorKind::kTimeout, "nobody took the memory within " + a[6] + " ms");
  }
  gpusnap::common::UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (conn.get() < 0) throw gpusnap::sys_error("accept", errno);
  const bool taken = prefill.hand_over(conn.get());
  std::fprintf(
      stderr,
      "gpusnap-tier-prefill: %zu bytes of %s filled in %.3f s by %d workers (%.1f GB/s copying; "
      "making and mapping the memory %.3f s, pinning %.3f s; %zu bytes read in place; ready "
      "%.3f s after start), %s\n",
      report.bytes, pid.c_str(), report.seconds, settings.streams,
      report.seconds > 0 ? static_cast<double>(report.bytes) / report.seconds / 1e9 : 0.0,
      report.map_seconds, report.buffer_seconds, report.in_place_bytes, filled_s,
      taken ? "taken by the copy" : "refused by the copy");
  ::unlink(socket.c_str());
  // Before `prefill` and `driver` end: unmapping and releasing the memory and the context is
  // the slow part of the exit, and the copy no longer needs this process.
  close_done_fd(a[7]);
  return taken ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 12) {
    std::fprintf(stderr, "usage: gpusnap-tier-prefill DIR PID SOCKET GPU-UUID UID GID TIMEOUT-MS "
                         "DONE-FD SUMS-FD CHUNK-BYTES ARRIVAL-FD (started by gpusnap restore)\n");
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
