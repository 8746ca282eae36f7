// The handshake's messages on arbitrary bytes, both ways: the workload's client library
// (clients/include/gpusnap/handshake_client.h, in the workload's process) parses what gpusnap
// writes, and gpusnap parses what the workload writes (engine/handshake.cc, through json_text).
// Either side may be buggy or hostile to the other.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/json.h"
#include "gpusnap/handshake_client.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // gpusnap's side: a message is an object; its strings are read through brief().
  if (auto doc = gpusnap::json_text::parse(text); doc && doc->is_object()) {
    for (const auto& [key, value] : doc->items()) (void)gpusnap::json_text::brief(value);
  }
  // The workload's side: every request kind gpusnap may write.
  using gpusnap::handshake::Request;
  (void)gpusnap::handshake::detail::parse_json(text);
  for (auto kind : {Request::Kind::kPause, Request::Kind::kResume}) {
    Request req;
    std::string why;
    (void)gpusnap::handshake::detail::parse_request(kind, text, req, why);
  }
  return 0;
}
