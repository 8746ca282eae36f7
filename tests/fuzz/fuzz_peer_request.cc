// What one agent asks another for when they serve each other chunks, on arbitrary bytes: the
// request target of GET /v1/chunks/ (src/store/peer_request.h). Peers are outside gpusnap's
// trust; the parser must throw Error or succeed, and what it accepts must name a chunk no larger
// than a snapshot holds and write back to a target that reads the same.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "gpusnap/error.h"
#include "store/peer_request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto r = gpusnap::store::PeerRequest::parse(text);
    if (r.size == 0 || r.size > gpusnap::store::kMaxPeerBlobBytes) std::abort();
    const auto back = gpusnap::store::PeerRequest::parse(r.target());
    if (back.digest != r.digest || back.size != r.size || back.repository != r.repository) {
      std::abort();
    }
  } catch (const gpusnap::Error&) {  // NOLINT(bugprone-empty-catch): refusing is the point
  }
  return 0;
}
