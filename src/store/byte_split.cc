#include "store/byte_split.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace gpusnap::store {

void split_bytes(const char* in, size_t n, char* out) {
  const size_t evens = (n + 1) / 2;
  char* odd = out + evens;
  size_t i = 0;
#if defined(__SSE2__)
  // 32 bytes a step: the even bytes of each 16-bit lane packed into one register, the odd ones
  // (shifted down) into another.
  const __m128i low = _mm_set1_epi16(0x00ff);
  for (; i + 32 <= n; i += 32) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i + 16));
    const __m128i e = _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low));
    const __m128i o = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), e);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(odd + i / 2), o);
  }
#endif
  for (; i + 1 < n; i += 2) {
    out[i / 2] = in[i];
    odd[i / 2] = in[i + 1];
  }
  if (i < n) out[i / 2] = in[i];
}

void join_bytes(const char* in, size_t n, char* out) {
  const size_t evens = (n + 1) / 2;
  const char* odd = in + evens;
  size_t i = 0;
#if defined(__SSE2__)
  // 32 bytes a step: 16 even and 16 odd bytes interleaved (the inverse of split_bytes's pack).
  for (; i + 32 <= n; i += 32) {
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i / 2));
    const __m128i o = _mm_loadu_si128(reinterpret_cast<const __m128i*>(odd + i / 2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm_unpacklo_epi8(e, o));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i + 16), _mm_unpackhi_epi8(e, o));
  }
#endif
  for (; i + 1 < n; i += 2) {
    out[i] = in[i / 2];
    out[i + 1] = odd[i / 2];
  }
  if (i < n) out[i] = in[i / 2];
}

}  // namespace gpusnap::store
