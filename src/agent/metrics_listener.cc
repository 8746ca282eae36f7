#include "agent/metrics_listener.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <httplib.h>

#include "agent/agent.h"
#include "agent/metrics.h"
#include "gpusnap/error.h"

namespace gpusnap::agent {

namespace {

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

// The bytes of the regular files under `dir` (0 when it is not there): their sizes, or with
// `allocated` the blocks they occupy (a sparse node copy's holes cost nothing).
uint64_t bytes_under(const std::filesystem::path& dir, bool allocated = false) {
  uint64_t total = 0;
  std::error_code ec;
  for (std::filesystem::recursive_directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    total += allocated ? static_cast<uint64_t>(st.st_blocks) * 512 : st.st_size;
  }
  return total;
}

// The process families, from /proc/self (Prometheus' own names, as its client libraries write
// them).
void process_families(std::string& out) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const long ticks = ::sysconf(_SC_CLK_TCK);
  std::ifstream statm("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  if (statm >> size >> resident) {
    header(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
    out += "process_resident_memory_bytes " + std::to_string(resident * page) + "\n";
  }
  std::error_code ec;
  uint64_t fds = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++fds;
  }
  header(out, "process_open_fds", "gauge", "Number of open file descriptors.");
  out += "process_open_fds " + std::to_string(fds) + "\n";
  // /proc/self/stat: the fields after the command's closing parenthesis; utime and stime are
  // the 14th and 15th fields, starttime the 22nd (proc(5)).
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  std::ifstream uptime_file("/proc/uptime");
  double uptime = 0;
  if (close != std::string::npos && (uptime_file >> uptime) && ticks > 0) {
    std::istringstream fields(stat.substr(close + 2));
    std::string field;
    std::map<int, double> wanted;
    for (int i = 3; fields >> field && i <= 22; ++i) {
      if (i == 14 || i == 15 || i == 22) wanted[i] = std::strtod(field.c_str(), nullptr);
    }
    if (wanted.size() == 3) {
      const double now =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      char text[64];
      header(out, "process_cpu_seconds_total", "counter",
             "Total user and system CPU time spent in seconds.");
      std::snprintf(text, sizeof text, "%.2f",
                    (wanted[14] + wanted[15]) / static_cast<double>(ticks));
      out += std::string("process_cpu_seconds_total ") + text + "\n";
      header(out, "process_start_time_seconds", "gauge",
             "Start time of the process since unix epoch in seconds.");
      std::snprintf(text, sizeof text, "%.2f",
                    now - uptime + wanted[22] / static_cast<double>(ticks));
      out += std::string("process_start_time_seconds ") + text + "\n";
    }
  }
}

}  // namespace

std::string node_families(const Agent& agent) {
  std::string out;
  header(out, "gpusnap_build_info", "gauge", "The agent's version; the value is always 1.");
  out += "gpusnap_build_info{version=\"" + escape_label(GPUSNAP_VERSION) + "\"} 1\n";

  // From the operations' history, newest last: pending ones are the queue.
  int64_t queued = 0;
  const auto history = agent.operations();  // kept: the loop reads into it
  for (const auto& op : history.at("operations")) {
    if (op.value("state", "") == "pending") ++queued;
  }
  header(out, "gpusnap_operations_queued", "gauge", "Operations waiting to run.");
  out += "gpusnap_operations_queued " + std::to_string(queued) + "\n";

  if (const auto& remote = agent.config().remote) {
    // What the budget counts (store/blob_store.h): the chunks in the cache, and the node copies
    // of pulled snapshots, which hold their uncompressed chunks in place of the cache.
    header(out, "gpusnap_node_cache_bytes", "gauge",
           "Bytes the node cache holds on disk: its chunks, and the node copies of pulled "
           "snapshots (blocks allocated).");
    out += "gpusnap_node_cache_bytes " +
           std::to_string(bytes_under(remote->cache) +
                          bytes_under(remote->pulled, /*allocated=*/true)) +
           "\n";
    header(out, "gpusnap_node_cache_budget_bytes", "gauge",
           "The node cache's budget (--cache-budget-mib), in bytes.");
    out += "gpusnap_node_cache_budget_bytes " + std::to_string(remote->cache_budget) + "\n";
  }
  process_families(out);
  return out;
}

std::string exposition(const Agent& agent) { return agent.metrics() + node_families(agent); }

MetricsListener::MetricsListener(const std::string& address, int port)
    : server_(std::make_unique<httplib::Server>()) {
  // A scraper gets a few seconds per request: one that trickles its bytes only holds a thread
  // of this server, never the agent's API.
  server_->set_read_timeout(5, 0);
  server_->set_write_timeout(5, 0);
  server_->set_keep_alive_max_count(10);
  if (port == 0) {
    port_ = server_->bind_to_any_port(address);
  } else if (server_->bind_to_port(address, port)) {
    port_ = port;
  }
  if (port_ <= 0) {
    throw Error(ErrorKind::kUsage,
                "cannot listen for metrics on " + address + ":" + std::to_string(port),
                "give --metrics-listen a local address and a free port, e.g. 0.0.0.0:9464");
  }
}

MetricsListener::~MetricsListener() { stop(); }

void MetricsListener::start(const Agent& agent) {
  server_->Get("/metrics", [&agent](const httplib::Request&, httplib::Response& res) {
    res.set_content(exposition(agent), "text/plain; version=0.0.4; charset=utf-8");
  });
  // Everything else: not here (GET), or not allowed (any other method): it is read-only.
  server_->set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    if (req.method == "GET" || req.method == "HEAD") {
      if (req.path == "/metrics") return httplib::Server::HandlerResponse::Unhandled;
      res.status = 404;
      res.set_content("only /metrics is served here\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    }
    res.status = 405;
    res.set_header("Allow", "GET, HEAD");
    res.set_content("read-only: GET /metrics\n", "text/plain");
    return httplib::Server::HandlerResponse::Handled;
  });
  thread_ = std::jthread([this] {
    server_->listen_after_bind();
    done_ = true;
  });
}

void MetricsListener::stop() noexcept {
  if (!thread_.joinable()) return;
  // A stop() before the loop has begun is not remembered by httplib: repeat it until it ends.
  while (!done_) {
    server_->stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  thread_.join();
}

}  // namespace gpusnap::agent
