#include "store/peer_request.h"

#include <algorithm>
#include <regex>

#include "gpusnap/error.h"
#include "store/digest.h"
#include "store/layout.h"

namespace gpusnap::store {

namespace {

static_assert(kMaxPeerBlobBytes == kMaxChunkBytes + 4096);

Error bad(const std::string& why) {
  return Error(ErrorKind::kUsage, "bad chunk request: " + why,
               "ask GET /v1/chunks/sha256:HEX?size=N&repository=HOST/REPO");
}

// HOST[:PORT]/REPO as OciRef::parse accepts them (store/registry.h).
bool valid_repository(const std::string& s) {
  static const std::regex kRepository(
      R"([A-Za-z0-9][A-Za-z0-9.-]{0,252}(:[0-9]{1,5})?/)"
      "[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*)*");
  const size_t slash = s.find('/');
  return slash != std::string::npos && s.size() - slash - 1 <= 255 &&
         std::regex_match(s, kRepository);
}

}  // namespace

PeerRequest PeerRequest::parse(std::string_view target) {
  if (target.size() > kMaxPeerTargetBytes) throw bad("longer than 1 KiB");
  if (!target.starts_with(kPeerChunksPath)) throw bad("not a path under /v1/chunks/");
  target.remove_prefix(kPeerChunksPath.size());
  const size_t question = target.find('?');
  PeerRequest r;
  r.digest = std::string(target.substr(0, question));
  if (!valid_digest(r.digest)) throw bad("the digest is not sha256: and 64 lower-case hex digits");
  if (question == std::string_view::npos) throw bad("no size and repository");
  std::string_view query = target.substr(question + 1);
  bool has_size = false;
  bool has_repository = false;
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view{} : query.substr(amp + 1);
    const size_t eq = pair.find('=');
    if (eq == std::string_view::npos) throw bad("a parameter without a value");
    const std::string_view name = pair.substr(0, eq);
    const std::string value(pair.substr(eq + 1));
    if (name == "size") {
      if (has_size) throw bad("size given twice");
      has_size = true;
      // Digits only, and few enough that they cannot overflow before the bound is checked.
      if (value.empty() || value.size() > 12 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        throw bad("the size is not a decimal number");
      }
      r.size = std::stoull(value);
      if (r.size == 0 || r.size > kMaxPeerBlobBytes) {
        throw bad("the size is 0 or larger than any chunk of a snapshot");
      }
    } else if (name == "repository") {
      if (has_repository) throw bad("repository given twice");
      has_repository = true;
      if (!valid_repository(value)) throw bad("the repository is not HOST[:PORT]/REPO");
      r.repository = value;
    } else {
      throw bad("unknown parameter");
    }
  }
  if (!has_size || !has_repository) throw bad("size and repository are both required");
  return r;
}

std::string PeerRequest::target() const {
  return std::string(kPeerChunksPath) + digest + "?size=" + std::to_string(size) +
         "&repository=" + repository;
}

std::vector<std::string> rank_peers(const std::vector<std::string>& peers,
                                    std::string_view digest) {
  std::vector<std::pair<std::string, std::string>> ranked;  // hash, peer
  ranked.reserve(peers.size());
  for (const auto& p : peers) {
    ranked.emplace_back(sha256_digest(p + "\n" + std::string(digest)), p);
  }
  std::sort(ranked.begin(), ranked.end(), std::greater<>());
  std::vector<std::string> out;
  out.reserve(ranked.size());
  for (auto& [hash, peer] : ranked) out.push_back(std::move(peer));
  return out;
}

}  // namespace gpusnap::store
