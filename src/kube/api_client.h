// A small client for the Kubernetes API: the handful of calls the controller makes (get, list,
// create, update, merge-patch, delete, watch), JSON in and out. Not a general client: no
// discovery, no protobuf, no kubeconfig. It connects in-cluster (the pod's service-account
// token and CA, KUBERNETES_SERVICE_HOST/PORT) or to an explicit server URL with a token file,
// which is how the tests reach their local API server.
#pragma once

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/url.h"

namespace httplib {
class Client;
enum class Error;
}  // namespace httplib

namespace gpusnap::kube {

using nlohmann::json;

struct ApiConfig {
  // "https://10.96.0.1:443" or "http://127.0.0.1:8080".
  std::string server;
  // Bearer token, read again from this file at most every token_reload: projected
  // service-account tokens expire and the kubelet rewrites the file before they do.
  std::filesystem::path token_file;
  std::filesystem::path ca_file;  // the server's CA (https only); empty: the system's store
  std::chrono::seconds request_timeout{30};
  std::chrono::seconds token_reload{60};

  // The pod's own service account, as every in-cluster client finds it. Throws kEnvironment
  // outside a pod (no KUBERNETES_SERVICE_HOST, or no token file).
  static ApiConfig in_cluster();
};

// One API response: the HTTP status and the body as JSON (a Status object for errors).
struct Response {
  int status = 0;
  json body;

  bool ok() const { return status >= 200 && status < 300; }
  // The Status object's message, or the status code when there is none.
  std::string message() const;
  // The Status object's reason ("NotFound", "Conflict", "Expired", ...), or "".
  std::string reason() const;
};

// Thread-safe: each call opens its own connection (the controller makes a few calls a second),
// so a long watch never blocks the other calls.
class ApiClient {
 public:
  explicit ApiClient(ApiConfig config);
  ~ApiClient();
  ApiClient(const ApiClient&) = delete;
  ApiClient& operator=(const ApiClient&) = delete;

  const ApiConfig& config() const { return config_; }

  // Each throws Error(kEnvironment) when the server cannot be reached or answers with
  // something that is not JSON; an HTTP error is a Response, for the caller to judge.
  Response get(const std::string& path);
  Response create(const std::string& path, const json& object);      // POST
  Response update(const std::string& path, const json& object);      // PUT
  Response merge_patch(const std::string& path, const json& patch);  // PATCH merge-patch+json
  Response remove(const std::string& path);                          // DELETE

  // One watch request, `path` with its query. Calls on_event for each event line (the decoded
  // JSON object {"type","object"}) until the server ends the stream, on_event returns false,
  // or cancel() is called from another thread. Returns the HTTP status and, for an error
  // status, the error body; 200 for a stream that ended.
  Response watch(const std::string& path, const std::function<bool(const json&)>& on_event,
                 std::chrono::seconds read_timeout);
  // Cuts the watch in progress (if any) short, from any thread. Used to stop promptly.
  void cancel_watches() noexcept;

 private:
  std::unique_ptr<httplib::Client> connect(std::chrono::seconds read_timeout);
  std::string token();
  Response send(const char* method, const std::string& path, const json* body,
                const std::string& content_type);

  ApiConfig config_;
  std::mutex token_mu_;
  std::string token_;
  std::chrono::steady_clock::time_point token_read_{};
  std::mutex watch_mu_;
  std::vector<httplib::Client*> watches_;
};

// A transport failure in words ("could not connect", "the TLS handshake failed").
std::string transport_error_text(httplib::Error error);

// Percent-encodes a query value ("spec.nodeName=node-1" → "spec.nodeName%3Dnode-1").
using gpusnap::common::url_encode;

}  // namespace gpusnap::kube
