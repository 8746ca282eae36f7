// The byte split of a chunk stored as `zstd-split2` (Encoding::kZstdSplit2): the bytes at even
// offsets, then those at odd offsets, before zstd. Tensors of 16-bit numbers (bf16, fp16: most
// of a model's weights) put the sign and exponent in one byte of each pair and noisy mantissa
// bits in the other; apart, the first half compresses well and the second is stored as zstd's
// raw blocks, which decompress at copying speed. On bf16 weights drawn like a model's
// (docs/store.md, "Chunk encodings") zstd level 1 saves 22 % of the bytes interleaved and 32 %
// split, and decompresses 1.6x faster, the join included.
#pragma once

#include <cstddef>

namespace gpusnap::store {

// out[0, ceil(n/2)) = in's bytes at even offsets, out[ceil(n/2), n) = those at odd offsets.
void split_bytes(const char* in, size_t n, char* out);
// The inverse of split_bytes: `in` split, `out` interleaved again. `in` and `out` do not overlap.
void join_bytes(const char* in, size_t n, char* out);

}  // namespace gpusnap::store
