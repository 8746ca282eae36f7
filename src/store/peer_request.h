// What one agent asks another for when they serve each other chunks (store/peers.h): one blob
// by digest, its size, and the repository it belongs to, as the request target
//
//     /v1/chunks/sha256:HEX?size=N&repository=HOST[:PORT]/REPO
//
// and which peer owns a digest (rendezvous hashing). The parser reads bytes from the network
// before anything else does, so it stands alone (no HTTP library, no registry) and is fuzzed
// (tests/fuzz/fuzz_peer_request.cc).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace gpusnap::store {

inline constexpr std::string_view kPeerChunksPath = "/v1/chunks/";
// A request target longer than this is refused unread: a digest, a size and a repository of
// at most 255 characters behind a host of at most 260 fit in well under it.
inline constexpr size_t kMaxPeerTargetBytes = 1024;
// The largest blob a peer is asked for or serves: a chunk (store/layout.h), or a sealed chunk
// (store/encryption.h), its chunk and a nonce and tag. A larger blob (a layout beyond it) is
// fetched from the registries.
inline constexpr uint64_t kMaxPeerBlobBytes = (32ull << 20) + 4096;

struct PeerRequest {
  std::string digest;      // sha256:HEX
  uint64_t size = 0;       // 1 .. kMaxChunkBytes (a sealed chunk's few bytes more allowed)
  std::string repository;  // HOST[:PORT]/REPO, as OciRef spells them

  // Throws Error(kUsage) naming what is wrong: a path that is not kPeerChunksPath and a digest,
  // a parameter missing, repeated, unknown or malformed, a size of 0 or beyond the largest
  // blob a snapshot holds, a target longer than kMaxPeerTargetBytes.
  static PeerRequest parse(std::string_view target);
  std::string target() const;
};

// The configured peers (ADDR:PORT each) in the order in which they own `digest`: the first owns
// it, the next takes it when the first is down. Rendezvous hashing: each peer's rank is the
// sha256 of "PEER\nDIGEST", so every node computes the same order from the same list, and a
// peer that leaves the list moves only the chunks it owned.
std::vector<std::string> rank_peers(const std::vector<std::string>& peers, std::string_view digest);

}  // namespace gpusnap::store
