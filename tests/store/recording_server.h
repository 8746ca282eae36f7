// An HTTP server of a test's own that records every request it answers (its method, path and
// Authorization header): object storage behind a registry's redirects, or a registry that
// misbehaves. Header-only: the including file chooses httplib's settings, as the code it tests
// does (CPPHTTPLIB_RECV_BUFSIZ in store/registry.cc).
#pragma once

#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <httplib.h>

#include "common/fs.h"

namespace gpusnap::testing {

// One request as a RecordingServer saw it.
struct Seen {
  std::string method;
  std::string path;  // with its query, as sent
  std::string authorization;
  std::string user_agent;
};

// Answers every request with `handler`, recording what each request was and which
// Authorization header it carried.
class RecordingServer {
 public:
  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;
  // Listens on `address` (another than loopback for clients in a node's network namespace,
  // testing/node_network.h) at a port of its choosing.
  explicit RecordingServer(Handler handler, std::string address = "127.0.0.1")
      : handler_(std::move(handler)), address_(std::move(address)) {
    auto record = [this](const httplib::Request& req, httplib::Response& res) {
      {
        std::lock_guard lock(mu_);
        seen_.push_back({req.method, req.target, req.get_header_value("Authorization"),
                         req.get_header_value("User-Agent")});
      }
      handler_(req, res);
    };
    server_.Get(".*", record);
    server_.Put(".*", record);
    server_.Post(".*", record);
    port_ = server_.bind_to_any_port(address_);  // listening from here on
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  RecordingServer(const RecordingServer&) = delete;
  RecordingServer& operator=(const RecordingServer&) = delete;
  ~RecordingServer() {
    server_.stop();
    thread_.join();
  }
  std::string host() const { return address_ + ":" + std::to_string(port_); }
  std::vector<Seen> seen() const {
    std::lock_guard lock(mu_);
    return seen_;
  }

 private:
  Handler handler_;
  std::string address_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  mutable std::mutex mu_;
  std::vector<Seen> seen_;
};

// Serves the files under `root` by path: what object storage behind a registry's redirect
// middleware does with the registry's own storage.
inline RecordingServer::Handler serve_files(const std::filesystem::path& root) {
  return [root](const httplib::Request& req, httplib::Response& res) {
    std::string data;
    if (req.path.find("..") != std::string::npos ||
        !fs::try_read_file(root / req.path.substr(1), &data)) {
      res.status = 404;
      return;
    }
    res.set_content(data, "application/octet-stream");
  };
}

// docker-registry's configuration that sends its blobs' GETs to `base_url` by redirect, as a
// registry in front of object storage or a CDN does.
inline std::string redirect_middleware(const std::string& base_url) {
  return "middleware:\n  storage:\n    - name: redirect\n      options:\n        baseurl: " +
         base_url + "\n";
}

}  // namespace gpusnap::testing
