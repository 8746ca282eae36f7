// The checksum of one chunk of an artifact file, as the manifest records it (XXH3-128, hex).
// Exposed so that a writer that already holds a chunk's bytes in memory (host images) can
// record its checksum without reading the file back.
#pragma once

#include <xxhash.h>

#include <cstddef>
#include <cstdio>
#include <memory>
#include <string>

#include "artifact/xxh3.h"

namespace gpusnap::artifact {

class ChunkHash {
 public:
  ChunkHash() : state_(XXH3_createState(), XXH3_freeState) { reset(); }
  void reset() { XXH3_128bits_reset(state_.get()); }
  void update(const void* data, size_t size) { xxh3_128_update(state_.get(), data, size); }
  // The digest of what was added since the last reset, as the manifest writes it.
  std::string hex() const { return hex_of(XXH3_128bits_digest(state_.get())); }
  static std::string hex_of(const XXH128_hash_t& h) {
    char buf[33];
    std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                  static_cast<unsigned long long>(h.low64));
    return buf;
  }

 private:
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state_;
};

}  // namespace gpusnap::artifact
