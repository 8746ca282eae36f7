#include "common/chunk_memory.h"

#include <malloc.h>

namespace gpusnap::common {

namespace {
// Above the largest chunk a snapshot holds (store/chunker.h: 8 MiB), and the most glibc takes
// (half its 64 MiB heaps).
constexpr int kMmapThreshold = 32 << 20;
// Freed memory at a heap's top kept up to this much before it is trimmed: some 32 transfer
// threads' chunks, compressed and not.
constexpr int kTrimThreshold = 1 << 30;
}  // namespace

void keep_chunk_memory() {
  // Best effort: a refusal leaves glibc's defaults, which are only slower.
  (void)mallopt(M_MMAP_THRESHOLD, kMmapThreshold);
  (void)mallopt(M_TRIM_THRESHOLD, kTrimThreshold);
}

void release_free_memory() noexcept { (void)malloc_trim(0); }

}  // namespace gpusnap::common
