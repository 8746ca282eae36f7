// The memory tier's readers of bytes gpusnap did not write itself, on arbitrary bytes: the
// drain's layout (PID.layout, read from an artifact by gpusnap-tier-prefill, src/tier/layout.h)
// and the checksums a prefill writes on its SUMS-FD (engine::parse_prefill_sums). The first byte
// picks the reader; the rest is its input.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/tier.h"
#include "gpusnap/error.h"
#include "tier/layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    // read_layout reads a file: an anonymous one, reached by its /proc path.
    const int fd = ::memfd_create("layout", MFD_CLOEXEC);
    if (fd < 0) return 0;
    if (::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size())) {
      try {
        const auto layout = gpusnap::tier::read_layout("/proc/self/fd/" + std::to_string(fd));
        (void)layout;
      } catch (const gpusnap::Error&) {  // NOLINT(bugprone-empty-catch): refusing is the point
      }
    }
    ::close(fd);
  } else {
    for (uint64_t chunk : {uint64_t{1}, uint64_t{4096}, uint64_t{64} << 20}) {
      (void)gpusnap::engine::parse_prefill_sums(text, "7", chunk);
    }
  }
  return 0;
}
