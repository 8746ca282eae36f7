#include "store/fanout.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/subprocess.h"
#include "testing/harness.h"

namespace gpusnap::testing {

namespace {

namespace sfs = std::filesystem;
using Clock = std::chrono::steady_clock;

void must_run(const std::vector<std::string>& argv) {
  auto r = common::run_capture(argv, std::chrono::seconds(30));
  if (!r.status.ok()) {
    std::string line;
    for (const auto& a : argv) line += a + " ";
    throw std::runtime_error(line + "failed: " + r.output);
  }
}

// A token bucket on the link's egress: `rate` sustained, bursts of 128 KiB (more than one
// GSO segment of a veth, so tbf never drops a packet for being too large).
std::vector<std::string> tbf(const std::string& dev, int rate_mbit) {
  return {"tc",    "qdisc", "replace",
          "dev",   dev,     "root",
          "tbf",   "rate",  std::to_string(rate_mbit) + "mbit",
          "burst", "128kb", "latency",
          "50ms"};
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Where every node's agent serves its peers: the namespace is the node's alone.
constexpr int kAgentPort = 7070;
constexpr const char* kPeerToken = "fanout-peer-token-0123456789abcdef";

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : ",") + i;
  return out;
}

}  // namespace

std::optional<std::string> Fanout::blocker() {
  if (auto b = LocalRegistry::blocker()) return b;
  if (auto b = NodeNetwork::blocker()) return b;
  if (::access("/usr/sbin/tc", X_OK) != 0 && ::access("/sbin/tc", X_OK) != 0) {
    return std::string("tc is missing (iproute2)");
  }
  return std::nullopt;
}

// A gpusnap-agent on a node, serving its peers on the node's address; killed with the object.
struct Fanout::Agent {
  common::Subprocess process;
  sfs::path log;
};

Fanout::Fanout(const TempDir& dir, const sfs::path& artifact, const FanoutOptions& options)
    : dir_(dir), options_(options), artifact_(artifact) {
  // The origin's namespace and the nodes', five to a /29.
  std::vector<const Node*> all;
  for (int left = options.nodes + 1; left > 0; left -= 5) {
    networks_.push_back(std::make_unique<NodeNetwork>(std::min(left, 5)));
    const int here = std::min(left, 5);
    for (int i = 0; i < here; ++i) {
      const Node& n = networks_.back()->node(static_cast<size_t>(i));
      all.push_back(&n);
      // Every namespace reaches the others through the host, which forwards between the links.
      must_run(n.enter({"ip", "route", "add", "10.213.0.0/16", "via",
                        networks_.back()->host_address(), "dev", "eth0"}));
      must_run({"sysctl", "-qw", "net.ipv4.conf." + n.link() + ".forwarding=1"});
    }
  }
  origin_node_ = all.front();
  nodes_.assign(all.begin() + 1, all.end());
  // The origin's link, limited where it sends; each node's where the host sends to it.
  must_run(origin_node_->enter(tbf("eth0", options.rate_mbit)));
  for (const Node* n : nodes_) must_run(tbf(n->link(), options.rate_mbit));

  LocalRegistry::Options ro;
  ro.node = origin_node_;
  origin_.emplace(dir, ro);
  reference_ = origin_->ref("fanout/snap:v1");
  auto r = gpusnap({"push", artifact.string(), reference_, "--plain-http", "--json", "-q"},
                   std::chrono::minutes(30));
  if (r.exit_code != 0) throw std::runtime_error("push to the origin failed: " + r.err);
  stored_bytes_ = nlohmann::json::parse(r.out).at("stored_bytes").get<uint64_t>();
  token_file_ = dir_ / "peer-token";
  fs::write_file(token_file_, std::string(kPeerToken) + "\n");
  sfs::permissions(token_file_, sfs::perms::owner_read | sfs::perms::owner_write);
}

Fanout::~Fanout() = default;

uint64_t Fanout::origin_blob_bytes() const {
  // The access log's lines, one per request, in the combined log format:
  //   ADDR - - [TIME] "GET /v2/REPO/blobs/sha256:HEX HTTP/1.1" STATUS BYTES "REFERER" "AGENT"
  const std::string log = origin_->log();
  uint64_t total = 0;
  const std::string needle = "\"GET /v2/fanout/snap/blobs/";
  for (size_t at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) {
    const size_t close = log.find("\" ", at + 1);
    if (close == std::string::npos) break;
    int status = 0;
    unsigned long long bytes = 0;
    if (std::sscanf(log.c_str() + close + 2, "%d %llu", &status, &bytes) == 2 &&
        (status == 200 || status == 206)) {
      total += bytes;
    }
  }
  return total;
}

double Fanout::pull(size_t first, size_t last, const std::string& tag,
                    const std::vector<std::string>& extra, FanoutRun& run) {
  struct Running {
    common::Subprocess process;
    sfs::path log;
  };
  std::vector<Running> pulls;
  const auto start = Clock::now();
  for (size_t i = first; i < last; ++i) {
    const sfs::path base = dir_ / (tag + "-node" + std::to_string(i));
    // A reference among `extra` pulls that one instead of the snapshot's.
    const auto named = std::find_if(extra.begin(), extra.end(),
                                    [](const std::string& a) { return a.starts_with("oci://"); });
    std::vector<std::string> argv = {gpusnap_bin(),
                                     "pull",
                                     named != extra.end() ? *named : reference_,
                                     "-o",
                                     (base / "copy").string(),
                                     "--plain-http",
                                     "--cache",
                                     (base / "cache").string(),
                                     "-q"};
    for (const auto& a : extra) {
      if (!a.starts_with("oci://")) argv.push_back(a);
    }
    sfs::create_directories(base);
    common::UniqueFd log(
        ::open((base / "pull.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    common::SpawnOptions so;
    so.argv = nodes_[i]->enter(argv);
    so.stdout_fd = log.get();
    so.stderr_fd = log.get();
    pulls.push_back({common::Subprocess(so), base / "pull.log"});
    run.copies.push_back(base / "copy");
  }
  for (auto& p : pulls) {
    auto st = p.process.wait(std::chrono::minutes(30));
    if (!st || !st->ok()) {
      std::string text;
      fs::try_read_file(p.log, &text);
      throw std::runtime_error("a node's pull failed: " + text);
    }
  }
  return seconds_since(start);
}

FanoutRun Fanout::alone() {
  FanoutRun run;
  run.configuration = "one node alone";
  const uint64_t before = origin_blob_bytes();
  run.last_done_s = pull(0, 1, "alone" + std::to_string(runs_++), {}, run);
  run.origin_bytes = origin_blob_bytes() - before;
  return run;
}

FanoutRun Fanout::without_mirror() {
  FanoutRun run;
  run.configuration = std::to_string(nodes_.size()) + " nodes, no mirror";
  const uint64_t before = origin_blob_bytes();
  run.last_done_s = pull(0, nodes_.size(), "direct" + std::to_string(runs_++), {}, run);
  run.origin_bytes = origin_blob_bytes() - before;
  return run;
}

FanoutRun Fanout::through_mirror(const std::string& name, size_t first_wave) {
  FanoutRun run;
  run.configuration = name;
  const std::string tag = "mirror" + std::to_string(runs_++);
  const TempDir& dir = dir_;
  // A fresh mirror on the host, empty: it fills from the origin as the nodes ask.
  LocalRegistry::Options mo;
  mo.address = networks_.front()->host_address();
  mo.proxy_remote = "http://" + origin_->host();
  LocalRegistry mirror(dir, mo);
  const sfs::path conf = dir_ / (tag + "-registries.conf");
  fs::write_file(conf, "[[registry]]\nlocation = \"" + origin_->host() +
                           "\"\n\n[[registry.mirror]]\nlocation = \"" + mirror.host() +
                           "\"\ninsecure = true\n");
  const uint64_t before = origin_blob_bytes();
  const std::vector<std::string> extra = {"--registries-conf", conf.string()};
  run.last_done_s = pull(0, first_wave, tag + "a", extra, run);
  if (first_wave < nodes_.size())
    run.last_done_s += pull(first_wave, nodes_.size(), tag + "b", extra, run);
  run.origin_bytes = origin_blob_bytes() - before;
  return run;
}

FanoutRun Fanout::with_mirror() {
  return through_mirror(std::to_string(nodes_.size()) + " nodes, mirror", nodes_.size());
}

FanoutRun Fanout::with_mirror_warmed_by_one() {
  return through_mirror(std::to_string(nodes_.size()) + " nodes, mirror warmed by one node first",
                        1);
}

std::string Fanout::agent_address(size_t i) const {
  return nodes_.at(i)->address() + ":" + std::to_string(kAgentPort);
}

sfs::path Fanout::agent_cache(size_t i) const {
  return dir_ / (agents_tag_ + "-agent" + std::to_string(i)) / "cache";
}

std::string Fanout::origin_repository() const { return origin_->host() + "/fanout/snap"; }

void Fanout::start_agents(const std::string& tag, const std::string& peers) {
  agents_.clear();  // SIGKILL: their nodes' ports are free again at once
  agents_tag_ = tag;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const sfs::path base = dir_ / (tag + "-agent" + std::to_string(i));
    sfs::create_directories(base);
    common::UniqueFd log(
        ::open((base / "agent.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    common::SpawnOptions so;
    so.argv = nodes_[i]->enter({build_path("gpusnap-agent"),
                                "--socket",
                                (base / "agent.sock").string(),
                                "--storage",
                                (base / "snapshots").string(),
                                "--state-dir",
                                (base / "state").string(),
                                "--run-dir",
                                (base / "run").string(),
                                "--cache",
                                (base / "cache").string(),
                                "--listen",
                                agent_address(i),
                                "--token-file",
                                token_file_.string(),
                                "--registry",
                                "oci://" + origin_repository(),
                                "--registry-plain-http",
                                "--serve-peers",
                                "--peers",
                                peers,
                                "--peer-token-file",
                                token_file_.string()});
    so.stdout_fd = log.get();
    so.stderr_fd = log.get();
    auto a = std::make_unique<Agent>(Agent{common::Subprocess(so), base / "agent.log"});
    agents_.push_back(std::move(a));
  }
  // Up when each answers its healthz over TCP with the token, as a peer would ask.
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const std::string addr = nodes_[i]->address();
    const bool up = eventually(
        [&] {
          if (!agents_[i]->process.running()) return true;
          httplib::Client c(addr, kAgentPort);
          c.set_connection_timeout(std::chrono::seconds(1));
          auto r = c.Get("/v1/healthz", {{"Authorization", std::string("Bearer ") + kPeerToken}});
          return r && r->status == 200;
        },
        std::chrono::seconds(30));
    if (!up || !agents_[i]->process.running()) {
      std::string text;
      fs::try_read_file(agents_[i]->log, &text);
      throw std::runtime_error("node " + std::to_string(i) + "'s agent did not start: " + text);
    }
  }
}

FanoutRun Fanout::through_peers(const std::string& name, const std::string& reference,
                                const std::vector<std::string>& down,
                                const std::vector<std::string>& pull_flags) {
  FanoutRun run;
  run.configuration = std::to_string(nodes_.size()) + " nodes, agents serving peers" + name;
  if (!down.empty()) run.configuration += ", " + std::to_string(down.size()) + " peer down";
  const std::string tag = "peers" + std::to_string(runs_++);
  std::vector<std::string> peers;
  for (size_t i = 0; i < nodes_.size(); ++i) peers.push_back(agent_address(i));
  peers.insert(peers.end(), down.begin(), down.end());
  start_agents(tag, joined(peers));
  std::vector<std::string> extra = {reference, "--peers", joined(peers), "--peer-token-file",
                                    token_file_.string()};
  extra.insert(extra.end(), pull_flags.begin(), pull_flags.end());
  const uint64_t before = origin_blob_bytes();
  run.last_done_s = pull(0, nodes_.size(), tag, extra, run);
  run.origin_bytes = origin_blob_bytes() - before;
  return run;
}

FanoutRun Fanout::with_peers(const std::vector<std::string>& down) {
  return through_peers("", reference_, down, {});
}

FanoutRun Fanout::with_peers_encrypted() {
  const sfs::path key = dir_ / "fanout-key.pem";
  const sfs::path pub = dir_ / "fanout-key.pub";
  if (!sfs::exists(key)) {
    openssl({"genpkey", "-algorithm", "X25519", "-out", key.string()});
    openssl({"pkey", "-in", key.string(), "-pubout", "-out", pub.string()});
    sfs::permissions(key, sfs::perms::owner_read | sfs::perms::owner_write,
                     sfs::perm_options::replace);
  }
  const std::string reference = origin_->ref("fanout/snap:sealed");
  auto r = gpusnap({"push", artifact_.string(), reference, "--plain-http", "--encrypt",
                    pub.string(), "--dedup-secret", (dir_ / "dedup-secret").string(), "-q"},
                   std::chrono::minutes(30));
  if (r.exit_code != 0) throw std::runtime_error("encrypted push failed: " + r.err);
  return through_peers(", encrypted", reference, {}, {"--decryption-key", key.string()});
}

FanoutRun Fanout::with_peers_through_agents() {
  FanoutRun run;
  run.configuration = std::to_string(nodes_.size()) + " nodes, agents serving peers, prefetch";
  const std::string tag = "agentpeers" + std::to_string(runs_++);
  std::vector<std::string> peers;
  for (size_t i = 0; i < nodes_.size(); ++i) peers.push_back(agent_address(i));
  start_agents(tag, joined(peers));
  const httplib::Headers bearer = {{"Authorization", std::string("Bearer ") + kPeerToken}};
  const std::string body =
      nlohmann::json{{"reference", "oci://" + origin_repository() + ":v1"}}.dump();
  const uint64_t before = origin_blob_bytes();
  const auto start = Clock::now();
  std::vector<std::string> operations;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    httplib::Client c(nodes_[i]->address(), kAgentPort);
    auto r = c.Post("/v1/prefetch", bearer, body, "application/json");
    if (!r || r->status != 202) {
      throw std::runtime_error("node " + std::to_string(i) + "'s agent refused the prefetch: " +
                               (r ? r->body : httplib::to_string(r.error())));
    }
    operations.push_back(r->get_header_value("Location"));
  }
  for (size_t i = 0; i < nodes_.size(); ++i) {
    httplib::Client c(nodes_[i]->address(), kAgentPort);
    nlohmann::json op;
    const bool ended = eventually(
        [&] {
          auto r = c.Get(operations[i], bearer);
          op = r ? nlohmann::json::parse(r->body, nullptr, false) : nlohmann::json();
          const std::string state = op.is_object() ? op.value("state", "") : "";
          return state == "succeeded" || state == "failed";
        },
        std::chrono::minutes(30));
    if (!ended || op.value("state", "") != "succeeded") {
      throw std::runtime_error("node " + std::to_string(i) +
                               "'s prefetch did not succeed: " + op.dump());
    }
    run.copies.emplace_back(op.at("result").at("artifact").get<std::string>());
  }
  run.last_done_s = seconds_since(start);
  run.origin_bytes = origin_blob_bytes() - before;
  return run;
}

FanoutRun Fanout::alone_with_peers(size_t node, const std::vector<std::string>& peers) {
  FanoutRun run;
  run.configuration = "one node, peers " + joined(peers);
  const std::string tag = "alonepeers" + std::to_string(runs_++);
  const uint64_t before = origin_blob_bytes();
  run.last_done_s =
      pull(node, node + 1, tag,
           {"--peers", joined(peers), "--peer-token-file", token_file_.string()}, run);
  run.origin_bytes = origin_blob_bytes() - before;
  return run;
}

}  // namespace gpusnap::testing
