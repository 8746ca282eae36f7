// XXH3's updates at every vector width this CPU has (artifact/xxh3.h) against libxxhash's own
// one-shot hashes: the same digest for every length around XXH3's internal boundaries (16, 128,
// 240 bytes; 64-byte stripes; 1 KiB blocks; the 256-byte internal buffer), fed whole and in
// uneven pieces.
#include "artifact/xxh3.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "artifact/chunk_hash.h"

namespace gpusnap::artifact {
namespace {

using Update = void (*)(void*, const void*, std::size_t);

struct Width {
  const char* name;
  bool available;
  Update u128;
  Update u64;
};

std::vector<Width> widths() {
  __builtin_cpu_init();
  return {
      {"dispatched", true,
       [](void* s, const void* d, std::size_t n) {
         xxh3_128_update(static_cast<XXH3_state_t*>(s), d, n);
       },
       [](void* s, const void* d, std::size_t n) {
         xxh3_64_update(static_cast<XXH3_state_t*>(s), d, n);
       }},
      {"avx2", __builtin_cpu_supports("avx2") != 0, detail::xxh3_128_update_avx2,
       detail::xxh3_64_update_avx2},
      {"avx512", __builtin_cpu_supports("avx512f") != 0, detail::xxh3_128_update_avx512,
       detail::xxh3_64_update_avx512},
  };
}

std::vector<unsigned char> bytes(std::size_t n, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> b(n);
  for (auto& c : b) c = static_cast<unsigned char>(rng());
  return b;
}

// Feeds `data` to `update` in pieces whose sizes follow `seed` (0: whole).
template <typename Fn>
void feed(const std::vector<unsigned char>& data, unsigned seed, Fn update) {
  if (seed == 0) {
    update(data.data(), data.size());
    return;
  }
  std::mt19937 rng(seed);
  for (std::size_t at = 0; at < data.size();) {
    const std::size_t n = std::min<std::size_t>(data.size() - at, 1 + rng() % 700);
    update(data.data() + at, n);
    at += n;
  }
}

TEST(Xxh3, EveryWidthHashesAsLibxxhashDoesWholeAndInPieces) {
  const std::vector<std::size_t> lengths = {0,
                                            1,
                                            3,
                                            16,
                                            17,
                                            128,
                                            129,
                                            240,
                                            241,
                                            255,
                                            256,
                                            257,
                                            1023,
                                            1024,
                                            1025,
                                            4096,
                                            4099,
                                            65536 + 7,
                                            (std::size_t{3} << 20) + 13};
  int tried = 0;
  for (const Width& w : widths()) {
    if (!w.available) continue;
    ++tried;
    for (std::size_t n : lengths) {
      const auto data = bytes(n, static_cast<unsigned>(n));
      const XXH128_hash_t want128 = XXH3_128bits(data.data(), data.size());
      const XXH64_hash_t want64 = XXH3_64bits(data.data(), data.size());
      for (unsigned split : {0u, 1u, 2u}) {
        SCOPED_TRACE(std::string(w.name) + " length " + std::to_string(n) + " split " +
                     std::to_string(split));
        std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> s(XXH3_createState(),
                                                                   XXH3_freeState);
        XXH3_128bits_reset(s.get());
        feed(data, split, [&](const void* d, std::size_t k) { w.u128(s.get(), d, k); });
        EXPECT_TRUE(XXH128_isEqual(XXH3_128bits_digest(s.get()), want128));
        XXH3_64bits_reset(s.get());
        feed(data, split, [&](const void* d, std::size_t k) { w.u64(s.get(), d, k); });
        EXPECT_EQ(XXH3_64bits_digest(s.get()), want64);
      }
    }
  }
  EXPECT_GE(tried, 1);
}

TEST(Xxh3, TheChunkHashIsTheManifestsXxh3Of128Bits) {
  const auto data = bytes((std::size_t{1} << 20) + 5, 7);
  ChunkHash h;
  h.update(data.data(), 1000);
  h.update(data.data() + 1000, data.size() - 1000);
  EXPECT_EQ(h.hex(), ChunkHash::hex_of(XXH3_128bits(data.data(), data.size())));
  const std::string vectors = xxh3_vectors();
  EXPECT_TRUE(vectors == "avx512" || vectors == "avx2" || vectors == "sse2") << vectors;
}

}  // namespace
}  // namespace gpusnap::artifact
