// The agent's request parsing on arbitrary bodies: what POST /v1/checkpoints, /v1/restores and
// /v1/prefetch receive from any local caller (or any TCP caller with the token). Must throw Error
// or succeed; what it accepts must become the engine's options without another exception.
#include <cstddef>
#include <cstdint>
#include <string>

#include "agent/request.h"
#include "gpusnap/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  gpusnap::agent::EngineSettings settings;
  settings.storage = "/var/lib/gpusnap/snapshots";
  try {
    const auto body = gpusnap::agent::parse_body(text);
    // The first byte picks the endpoint, so that one corpus covers all three: in the corpus,
    // '{' a checkpoint, a newline then '{' a restore, a space then '{' a prefetch.
    const int endpoint = size > 0 ? data[0] % 3 : 0;
    if (endpoint == 0) {
      auto r = gpusnap::agent::parse_checkpoint_request(body);
      (void)gpusnap::agent::to_json(r).dump();
      (void)gpusnap::agent::checkpoint_options(r, settings);
    } else if (endpoint == 1) {
      auto r = gpusnap::agent::parse_restore_request(body);
      (void)gpusnap::agent::to_json(r).dump();
      (void)gpusnap::agent::restore_options(r, settings);
    } else {
      auto r = gpusnap::agent::parse_prefetch_request(body);
      (void)gpusnap::agent::to_json(r).dump();
    }
  } catch (const gpusnap::Error&) {
  }
  return 0;
}
