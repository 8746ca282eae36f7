// The C++ handshake client's reading of every request in tests/handshake/requests: each
// NAME.pause or NAME.resume is a message gpusnap may write, NAME.answer what the client makes
// of it (ignored, failed with its reason, or the request's fields). The Python client reads the
// same files (test_python_client.py, RequestCorpus), so the two clients answer alike.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "gpusnap/handshake_client.h"

namespace {

namespace hs = gpusnap::handshake;
using nlohmann::json;

std::string read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The client's answer to `text`, in the corpus's form.
json answer(hs::Request::Kind kind, const std::string& text) {
  hs::Request req;
  std::string error;
  if (!hs::detail::parse_request(kind, text, req, error)) {
    // No id: a message that cannot be answered, ignored.
    return req.id.empty() ? json{{"ignored", true}} : json{{"failed", error}};
  }
  if (kind == hs::Request::Kind::kPause) {
    return {
        {"pause", {{"id", req.id}, {"timeout_ms", req.timeout_ms}, {"tier_dir", req.tier_dir}}}};
  }
  const auto& c = req.context;
  return {{"resume",
           {{"id", req.id},
            {"restored", c.restored},
            {"copy", c.copy},
            {"copies", c.copies},
            {"artifact_id", c.artifact_id},
            {"gpu_map", c.gpu_map},
            {"settings", c.settings},
            {"tier_dir", c.tier_dir},
            {"tier_prefill_dir", c.tier_prefill_dir}}}};
}

TEST(HandshakeRequestCorpus, EveryRequestGetsItsAnswer) {
  std::vector<std::filesystem::path> requests;
  for (const auto& e : std::filesystem::directory_iterator(GPUSNAP_HANDSHAKE_REQUESTS)) {
    const auto ext = e.path().extension();
    if (ext == ".pause" || ext == ".resume") requests.push_back(e.path());
  }
  ASSERT_GT(requests.size(), 20u);
  for (const auto& path : requests) {
    SCOPED_TRACE(path.filename().string());
    const auto kind =
        path.extension() == ".pause" ? hs::Request::Kind::kPause : hs::Request::Kind::kResume;
    auto expected = path;
    expected.replace_extension(".answer");
    EXPECT_EQ(answer(kind, read(path)), json::parse(read(expected)));
  }
}

}  // namespace
