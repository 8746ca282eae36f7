// What a registry serves for a snapshot, on arbitrary bytes: its OCI manifest and its layout blob
// (src/store/snapshot_manifest.h). A registry is outside gpusnap's trust; reading either must
// throw Error or succeed, and what it accepts must be writable again (a value nested too deep
// would overflow the stack in dump()). The first byte picks the reader (modulo 3: the manifest,
// the layout, an encrypted layout's envelope read without a key, store/encryption.h); the rest
// is its input.
#include <cstddef>
#include <cstdint>
#include <string>

#include "gpusnap/error.h"
#include "store/encryption.h"
#include "store/snapshot_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 3 == 0) {
      const auto m = gpusnap::store::read_snapshot_manifest(text, "fuzz");
      (void)m.doc.dump();
    } else if (data[0] % 3 == 1) {
      const auto layout = gpusnap::store::read_snapshot_layout(text, "fuzz");
      (void)layout.to_json().dump();
    } else {
      // Without a key nothing opens: what is checked is everything read before the key is.
      (void)gpusnap::store::open_layout(text, nullptr, "fuzz");
    }
  } catch (const gpusnap::Error&) {  // NOLINT(bugprone-empty-catch): refusing is the point
  }
  return 0;
}
