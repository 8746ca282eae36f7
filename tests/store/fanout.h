// Many nodes pulling one snapshot at once, each over a link limited by tc, from an origin
// registry whose own link is limited the same way: with and without a pull-through mirror.
// What it measures: the bytes of blobs the origin served (from its access log) and the time
// until the last node holds its copy, against one node alone.
//
//     origin ns (docker-registry) ══ tbf ══ host ══ tbf ══ node 0 .. node N-1 (gpusnap pull)
//                                            │
//                                            └─ mirror (docker-registry, proxy: the origin)
//
// With peers, each node also runs a real gpusnap-agent in its namespace (--serve-peers, every
// node's agent in --peers, one token), and each pull asks the agents for the chunks they own
// (store/peers.h):
//
//     node i: gpusnap pull --peers ──► node j's agent ──(a chunk it lacks, once)──► origin
//
// The origin and the nodes are namespaces of testing/node_network.h (several /29s when there
// are more than four nodes); the nodes reach the origin through the host, which forwards on
// those links alone (per-link forwarding, not net.ipv4.ip_forward). The mirror runs on the host,
// so what it sends a node crosses that node's limited link. Root.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "store/registry_fixture.h"
#include "testing/node_network.h"
#include "testing/unit.h"

namespace gpusnap::testing {

struct FanoutOptions {
  int nodes = 4;
  int rate_mbit = 100;  // every node's link and the origin's
};

// One configuration's run.
struct FanoutRun {
  std::string configuration;
  uint64_t origin_bytes = 0;  // blob bytes the origin sent during the run
  double last_done_s = 0;     // from the first pull's start to the last pull's end
  // Every node's copy (`gpusnap pull -o`), in node order.
  std::vector<std::filesystem::path> copies;
};

class Fanout {
 public:
  // Why it cannot run here: no root, no registry, no namespaces, no tc.
  static std::optional<std::string> blocker();

  // Sets up the origin and the nodes, and pushes `artifact` to the origin.
  Fanout(const TempDir& dir, const std::filesystem::path& artifact, const FanoutOptions& options);
  Fanout(const Fanout&) = delete;
  Fanout& operator=(const Fanout&) = delete;
  ~Fanout();

  uint64_t stored_bytes() const { return stored_bytes_; }

  // Node 0 alone, from the origin.
  FanoutRun alone();
  // Every node at once, from the origin.
  FanoutRun without_mirror();
  // Every node at once, through a fresh pull-through mirror named by a registries.conf.
  FanoutRun with_mirror();
  // Through a fresh mirror: node 0 first, then the others at once (the time counts both).
  FanoutRun with_mirror_warmed_by_one();
  // Every node at once, each `gpusnap pull --peers` with a fresh gpusnap-agent on every node
  // serving the others (store/peers.h). `down`: peers named in the list whose agent does not
  // run (ADDR:PORT). The agents keep serving until the next run or the end.
  FanoutRun with_peers(const std::vector<std::string>& down = {});
  // The same for the artifact pushed again encrypted (push --encrypt) for a key pair made here,
  // the pulls opening it with the private key: the peers serve the sealed blobs as stored.
  FanoutRun with_peers_encrypted();
  // The same through the agents: each asked over TCP to prefetch the snapshot (POST
  // /v1/prefetch) at once, its own pull and its peers' asks sharing one fetch of each chunk it
  // owns. The copies are the agents' node copies.
  FanoutRun with_peers_through_agents();
  // Node `node` alone, `gpusnap pull --peers` naming only `peers` (which may lie), its copy and
  // cache fresh.
  FanoutRun alone_with_peers(size_t node, const std::vector<std::string>& peers);

  // The peers' TCP API: where node `i`'s agent listens, the token file, its node cache.
  std::string agent_address(size_t i) const;
  const std::filesystem::path& token_file() const { return token_file_; }
  std::filesystem::path agent_cache(size_t i) const;
  // The origin's HOST:PORT and the snapshot's repository on it (HOST:PORT/REPO).
  std::string origin_repository() const;
  // An address of the host every node reaches (where a test's own server may listen).
  std::string host_address() const { return networks_.front()->host_address(); }

 private:
  struct Pull;
  // Pulls on nodes [first, last) at once into fresh copies and caches; throws when one fails.
  // Returns the seconds until the last one finished.
  double pull(size_t first, size_t last, const std::string& tag,
              const std::vector<std::string>& extra, FanoutRun& run);
  // Every node at once with `gpusnap pull --peers` of `reference`, through fresh agents.
  FanoutRun through_peers(const std::string& name, const std::string& reference,
                          const std::vector<std::string>& down,
                          const std::vector<std::string>& pull_flags);
  // Fresh agents on every node, serving `peers`; the old ones stopped first.
  void start_agents(const std::string& tag, const std::string& peers);
  FanoutRun through_mirror(const std::string& name, size_t first_wave);
  uint64_t origin_blob_bytes() const;

  const TempDir& dir_;
  FanoutOptions options_;
  std::vector<std::unique_ptr<NodeNetwork>> networks_;
  std::vector<const Node*> nodes_;  // the pulling nodes
  const Node* origin_node_ = nullptr;
  std::vector<std::string> forwarding_links_;
  std::optional<LocalRegistry> origin_;
  std::string reference_;
  std::filesystem::path artifact_;
  uint64_t stored_bytes_ = 0;
  int runs_ = 0;
  std::filesystem::path token_file_;
  struct Agent;
  std::vector<std::unique_ptr<Agent>> agents_;  // node i's, while a peers run's agents serve
  std::string agents_tag_;
};

}  // namespace gpusnap::testing
