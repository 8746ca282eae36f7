// XXH3 at the widest vectors this CPU has. gpusnap links Debian's libxxhash.a statically, and it
// is built for the x86-64 baseline (SSE2) without runtime dispatch; XXH3 built for AVX2 hashes
// twice as fast from memory and 3-4 times from the cache (docs/benchmarks.md, "Checksum
// throughput"). The updates, where the bytes go, are compiled here for AVX2 and AVX-512 from
// xxHash's own header and chosen once, at run time; states are made, reset and digested by
// libxxhash as before. Every vector width computes the same hash over the same state structure.
#pragma once

#include <xxhash.h>

#include <cstddef>

namespace gpusnap::artifact {

void xxh3_128_update(XXH3_state_t* state, const void* data, std::size_t size);
void xxh3_64_update(XXH3_state_t* state, const void* data, std::size_t size);

// Which the updates use on this CPU: "avx512", "avx2" or "sse2" (libxxhash's own).
const char* xxh3_vectors();

namespace detail {
// One pair per width (artifact/xxh3_wide.inc); `state` is an XXH3_state_t.
void xxh3_128_update_avx2(void* state, const void* data, std::size_t size);
void xxh3_64_update_avx2(void* state, const void* data, std::size_t size);
void xxh3_128_update_avx512(void* state, const void* data, std::size_t size);
void xxh3_64_update_avx512(void* state, const void* data, std::size_t size);
}  // namespace detail

}  // namespace gpusnap::artifact
