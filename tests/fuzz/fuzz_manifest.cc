// The manifest reader on arbitrary bytes: a manifest comes from a directory anyone with write
// access to the storage may have forged. Parsing and validating it must throw Error or
// succeed: no crash, no hang, no allocation a forged size or count could drive.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "artifact/validate.h"
#include "common/json.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto doc = gpusnap::json_text::parse(text);
  if (!doc) return 0;
  try {
    auto m = gpusnap::Manifest::from_json(*doc);
    // What is accepted is within bounds, and writes back out.
    if (m.chunk_bytes < gpusnap::artifact::kMinChunkBytes) __builtin_trap();
    (void)m.to_json().dump();
    (void)m.total_bytes();
  } catch (const gpusnap::Error&) {
  }
  return 0;
}
