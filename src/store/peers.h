// Agents that serve each other the chunks of a snapshot, so that many nodes pulling one
// snapshot at once cost the origin about one copy of it (docs/store.md, "Fan-out").
//
// Each chunk digest has one owner among the configured peers (rendezvous hashing,
// store/peer_request.h). A pulling node asks the owner for each chunk it lacks, before its
// mirrors and the origin; an owner that lacks the chunk fetches it once, through its own mirrors
// and origin with its own credentials, into its node cache, and serves it from there. Concurrent
// asks for one digest wait on that one fetch (PeerChunks), whether they come from peers or from
// the agent's own pulls, so a node never fetches a chunk twice and each chunk leaves the origin
// about once.
//
// Trust: a peer is never trusted. What it serves is checked against the digest and size the
// manifest names, as a mirror's blobs are, and a chunk it lacks, damages or fails to send is
// fetched from the mirrors and the origin instead. The peers share one bearer token, the one
// the agents' TCP API demands (agent/tcp_front.h); an owner fetches only from the repositories
// it is configured for (its own registry storage) and as its registries.conf allows.
//
// Off unless configured: `--peers ADDR:PORT,...`, `--peers-file FILE` or `--peers-dns NAME:PORT`
// with
// `--peer-token-file FILE` (gpusnap pull, restore oci://, gpusnap-agent), `--serve-peers`
// (gpusnap-agent: the GET /v1/chunks/ route).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "store/peer_request.h"
#include "store/registry.h"

namespace gpusnap::store {

class PullRegistries;  // store/mirrors.h

// At most this many peers: a list is read from a flag or a file a node is handed.
inline constexpr size_t kMaxPeers = 4096;

// "ADDR:PORT,ADDR:PORT" (a flag) or one ADDR:PORT a line with # comments (a file), each ADDR
// an IPv4 address, a host name or a bracketed IPv6 address. Throws Error(kUsage) naming
// `where`.
std::vector<std::string> parse_peer_list(std::string_view text, const std::string& where);

// ADDR:PORT as peers name each other: an IPv6 address in brackets ("[fd00::5]:7070"), any other
// as it is ("10.0.0.5:7070"), so that an agent's --listen=$(POD_IP):PORT matches the name a
// peers list or --peers-dns gives it whatever the pod's address family.
std::string peer_name(const std::string& address, int port);

// What --peers, --peers-file, --peers-dns and --peer-token-file say; null when no peers are
// named. Throws Error(kUsage) for a list without a token or a token without a list, and for a
// token file that is missing, readable by others or shorter than 16 characters.
std::shared_ptr<class Peers> read_peers(const std::string& list, const std::string& file,
                                        const std::string& dns, const std::string& token_file);

// The serving side: the chunks an agent hands its peers and its own pulls, each fetched once.
struct PeerServing {
  std::filesystem::path cache = "/var/lib/gpusnap/cache";  // the node cache (store/blob_store.h)
  RegistryOptions registry;  // the node's own (its peers are not asked: no loops)
  // HOST[:PORT]/REPO it fetches for; any other is refused.
  std::vector<std::string> repositories;
  int max_fetches = 16;  // distinct chunks fetched at once; more asks wait for a slot
};

class PeerChunks {
 public:
  explicit PeerChunks(PeerServing serving);
  ~PeerChunks();
  PeerChunks(const PeerChunks&) = delete;
  PeerChunks& operator=(const PeerChunks&) = delete;

  // The blob `r` names, from the node cache, else fetched (single-flight) through the node's
  // mirrors and origin and kept in the cache. Throws Error: kUsage for a repository it does not
  // fetch for or that the registries configuration blocks, kBadArtifact when the registry's
  // blob fails its digest or size, others as the registry fails. Thread-safe.
  std::string get(const PeerRequest& r);

  uint64_t bytes_served() const { return served_; }
  uint64_t bytes_fetched() const { return fetched_; }

 private:
  struct Flight;
  std::string fetch(const PeerRequest& r);
  // The blob from the node cache, when it holds it whole; a damaged one is removed there.
  std::optional<std::string> from_cache(const PeerRequest& r) const;
  std::shared_ptr<PullRegistries> registries_for(const PeerRequest& r);

  PeerServing serving_;
  std::mutex mu_;
  std::condition_variable slot_free_;
  int fetching_ = 0;
  std::map<std::string, std::shared_ptr<Flight>> flights_;  // by digest
  // By repository, made again every kRegistriesFor: a mirror a PullRegistries found down is
  // left out for its lifetime, which here would be the agent's.
  struct Registries {
    std::shared_ptr<PullRegistries> registries;
    std::chrono::steady_clock::time_point made;
  };
  std::map<std::string, Registries> registries_;
  static constexpr std::chrono::minutes kRegistriesFor{5};
  std::atomic<uint64_t> served_{0};
  std::atomic<uint64_t> fetched_{0};
};

// The pulling side: asks each chunk's owner. Thread-safe; one per program, shared by its pulls.
class Peers {
 public:
  // `dns`: NAME:PORT entries standing for every address NAME resolves to (a Kubernetes
  // headless Service of the agents), looked up again every kResolveEvery.
  Peers(std::vector<std::string> peers, std::string token, std::vector<std::string> dns = {});

  // `self` (one of the peers, the agent's own --listen) is answered by `local` in-process: the
  // agent's own pulls and its peers' asks then share one fetch of each chunk.
  void serve_self(const std::string& self, std::shared_ptr<PeerChunks> local);
  const std::vector<std::string>& list() const { return peers_; }
  // The peers now: the list and what the DNS names resolve to, each once, sorted.
  std::vector<std::string> members();
  const std::string& token() const { return token_; }

  // The blob from its owner, or from the next peer in its rank while those before are down
  // (they failed to connect: left out for kDownFor), checked against `digest` and `size`.
  // nullopt when no peer served it (a peer lacked it, failed, or sent a damaged copy), with a
  // line for the pull's notes through `note`: the caller fetches it elsewhere.
  std::optional<std::string> fetch(const OciRef& ref, const std::string& digest, uint64_t size,
                                   const std::function<void(const std::string&)>& note);

  static constexpr std::chrono::seconds kDownFor{30};
  static constexpr std::chrono::seconds kResolveEvery{30};
  // How long one ask may take: an owner may be waiting on its own fetch from the origin.
  static constexpr std::chrono::seconds kReadTimeout{120};

 private:
  struct Answer;
  Answer ask(const std::string& peer, const PeerRequest& r) const;
  bool down(const std::string& peer);

  std::vector<std::string> peers_;
  std::string token_;
  std::string self_;
  std::shared_ptr<PeerChunks> local_;
  std::mutex mu_;
  std::map<std::string, std::chrono::steady_clock::time_point> down_until_;
  std::vector<std::string> dns_;
  std::vector<std::string> members_;  // under mu_: the last resolution's
  std::chrono::steady_clock::time_point resolved_{};
};

}  // namespace gpusnap::store
