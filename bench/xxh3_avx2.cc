// XXH3-128 from the header alone, compiled for AVX2 (bench/CMakeLists.txt adds -mavx2 to this
// file only). A reference row for gpusnap-checksum-bench: Debian's libxxhash.a, which gpusnap
// links, is built for the x86-64 baseline (SSE2) without runtime dispatch, so this shows what
// XXH3 does when it may use AVX2. Only called when the CPU has AVX2.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

uint64_t bench_xxh3_128_avx2(const void* data, size_t size) {
  XXH128_hash_t h = XXH3_128bits(data, size);
  // GCC 12 emits no vzeroupper after xxHash 0.8.1's AVX2 loop. Left dirty, the upper halves of
  // the ymm registers make the SSE2 code that runs next (libxxhash.a's XXH3 among it) about 4x
  // slower on this machine's AMD EPYC: clear them, or every row after this one is wrong.
  _mm256_zeroupper();
  return h.low64 ^ h.high64;
}
