// The agent's metrics for a cluster to scrape (--metrics-listen ADDR:PORT, off by default).
//
// The agent's API on TCP (--listen) needs the bearer token that can checkpoint and restore any
// process as root: a Prometheus holding it would hold root on every node. This listener is a
// second, separate HTTP server that answers GET /metrics and nothing else, without a token:
// what it gives away is what the metrics say (operation counts and durations, queue length,
// cache sizes), never a way to act. It has its own threads, so a slow or hostile scraper
// cannot delay the API on the socket.
//
// The exposition adds, to the operation families of agent/metrics.h, the families that come
// from the agent's state when scraped (see node_families()).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

namespace httplib {
class Server;
}

namespace gpusnap::agent {

class Agent;

// The whole text exposition (format 0.0.4) the agent serves on /metrics, on its socket and on
// the metrics listener alike: the operation families (Metrics::render) and node_families().
std::string exposition(const Agent& agent);

// Families read from the agent's state and the process when scraped:
//   gpusnap_build_info{version}                         1
//   gpusnap_operations_queued                           operations waiting to run
//   gpusnap_node_cache_bytes, _budget_bytes             the registry storage's node cache: its
//                                                       size on disk (its chunks and the node
//                                                       copies, as the budget counts them) and
//                                                       its budget (with --registry only)
//   process_resident_memory_bytes, process_open_fds,
//   process_start_time_seconds, process_cpu_seconds_total   the agent process (/proc/self)
std::string node_families(const Agent& agent);

class MetricsListener {
 public:
  // Binds ADDRESS:PORT (port 0: any free one). Call before any thread is started. Throws
  // Error(kUsage) when it cannot bind.
  MetricsListener(const std::string& address, int port);
  MetricsListener(const MetricsListener&) = delete;
  MetricsListener& operator=(const MetricsListener&) = delete;
  ~MetricsListener();

  int port() const { return port_; }
  // Serves `agent`'s metrics on a thread of its own until stop(); `agent` must outlive that.
  void start(const Agent& agent);
  void stop() noexcept;

 private:
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  std::atomic<bool> done_{false};
  std::jthread thread_;
};

}  // namespace gpusnap::agent
