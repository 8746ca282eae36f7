#include "store/fanout.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <thread>

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

}  // namespace

std::optional<std::string> Fanout::blocker() {
  if (auto b = LocalRegistry::blocker()) return b;
  if (auto b = NodeNetwork::blocker()) return b;
  if (::access("/usr/sbin/tc", X_OK) != 0 && ::access("/sbin/tc", X_OK) != 0) {
    return std::string("tc is missing (iproute2)");
  }
  return std::nullopt;
}

Fanout::Fanout(const TempDir& dir, const sfs::path& artifact, const FanoutOptions& options)
    : dir_(dir), options_(options) {
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
                    const std::optional<sfs::path>& conf, FanoutRun& run) {
  struct Running {
    common::Subprocess process;
    sfs::path log;
  };
  std::vector<Running> pulls;
  const auto start = Clock::now();
  for (size_t i = first; i < last; ++i) {
    const sfs::path base = dir_ / (tag + "-node" + std::to_string(i));
    std::vector<std::string> argv = {gpusnap_bin(),
                                     "pull",
                                     reference_,
                                     "-o",
                                     (base / "copy").string(),
                                     "--plain-http",
                                     "--cache",
                                     (base / "cache").string(),
                                     "-q"};
    if (conf) argv.insert(argv.end(), {"--registries-conf", conf->string()});
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
  run.last_done_s = pull(0, 1, "alone" + std::to_string(runs_++), std::nullopt, run);
  run.origin_bytes = origin_blob_bytes() - before;
  return run;
}

FanoutRun Fanout::without_mirror() {
  FanoutRun run;
  run.configuration = std::to_string(nodes_.size()) + " nodes, no mirror";
  const uint64_t before = origin_blob_bytes();
  run.last_done_s = pull(0, nodes_.size(), "direct" + std::to_string(runs_++), std::nullopt, run);
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
  run.last_done_s = pull(0, first_wave, tag + "a", conf, run);
  if (first_wave < nodes_.size())
    run.last_done_s += pull(first_wave, nodes_.size(), tag + "b", conf, run);
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

}  // namespace gpusnap::testing
