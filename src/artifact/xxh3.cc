#include "artifact/xxh3.h"

namespace gpusnap::artifact {
namespace {

using Update = void (*)(void*, const void*, std::size_t);

void baseline_128(void* state, const void* data, std::size_t size) {
  (void)XXH3_128bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
void baseline_64(void* state, const void* data, std::size_t size) {
  (void)XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}

struct Updates {
  const char* name;
  Update u128;
  Update u64;
};

// libgcc's CPU check also asks the kernel (XGETBV) whether it saves the wide registers.
Updates choose() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    return {"avx512", detail::xxh3_128_update_avx512, detail::xxh3_64_update_avx512};
  }
  if (__builtin_cpu_supports("avx2")) {
    return {"avx2", detail::xxh3_128_update_avx2, detail::xxh3_64_update_avx2};
  }
  return {"sse2", baseline_128, baseline_64};
}

const Updates& chosen() {
  static const Updates updates = choose();
  return updates;
}

}  // namespace

void xxh3_128_update(XXH3_state_t* state, const void* data, std::size_t size) {
  chosen().u128(state, data, size);
}

void xxh3_64_update(XXH3_state_t* state, const void* data, std::size_t size) {
  chosen().u64(state, data, size);
}

const char* xxh3_vectors() { return chosen().name; }

}  // namespace gpusnap::artifact
