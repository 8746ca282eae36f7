#include "kube/api_client.h"

#include <cstdlib>

#include <httplib.h>

#include "common/fs.h"
#include "common/json.h"
#include "gpusnap/error.h"

namespace gpusnap::kube {

namespace {

constexpr const char* kServiceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount";

Error unreachable(const std::string& server, const std::string& method, const std::string& path,
                  httplib::Error err) {
  return Error(ErrorKind::kEnvironment,
               "Kubernetes API server " + server + " did not answer " + method + " " + path + ": " +
                   transport_error_text(err),
               "check --api-server (or KUBERNETES_SERVICE_HOST) and the network to it");
}

json parse_body(const std::string& body) {
  if (body.empty()) return json::object();
  // Bounded in depth like every document from outside (common/json.h): the objects read here
  // are written out again into events and status.
  if (auto doc = json_text::parse(body)) return std::move(*doc);
  // A proxy or a server that is not the API server: keep the text for the message.
  return json{{"kind", "Status"}, {"message", body.substr(0, 200)}};
}

}  // namespace

ApiConfig ApiConfig::in_cluster() {
  const char* host = std::getenv("KUBERNETES_SERVICE_HOST");  // NOLINT(concurrency-mt-unsafe)
  const char* port = std::getenv("KUBERNETES_SERVICE_PORT");  // NOLINT(concurrency-mt-unsafe)
  if (host == nullptr || *host == '\0') {
    throw Error(ErrorKind::kEnvironment, "KUBERNETES_SERVICE_HOST is not set: not in a pod",
                "run inside a pod, or give --api-server URL --token-file FILE");
  }
  ApiConfig c;
  std::string h = host;
  if (h.find(':') != std::string::npos) h = "[" + h + "]";  // an IPv6 service address
  c.server = "https://" + h + ":" + (port != nullptr && *port != '\0' ? port : "443");
  c.token_file = std::filesystem::path(kServiceAccountDir) / "token";
  c.ca_file = std::filesystem::path(kServiceAccountDir) / "ca.crt";
  if (!std::filesystem::exists(c.token_file)) {
    throw Error(ErrorKind::kEnvironment, "no service-account token at " + c.token_file.string(),
                "give the pod a service account with automountServiceAccountToken: true");
  }
  return c;
}

std::string Response::message() const {
  if (body.is_object() && body.contains("message") && body["message"].is_string()) {
    return body["message"].get<std::string>();
  }
  return "HTTP " + std::to_string(status);
}

std::string Response::reason() const {
  if (body.is_object() && body.contains("reason") && body["reason"].is_string()) {
    return body["reason"].get<std::string>();
  }
  return "";
}

ApiClient::ApiClient(ApiConfig config) : config_(std::move(config)) {}
ApiClient::~ApiClient() = default;

std::string ApiClient::token() {
  if (config_.token_file.empty()) return "";
  std::lock_guard lock(token_mu_);
  auto now = std::chrono::steady_clock::now();
  if (token_.empty() || now - token_read_ >= config_.token_reload) {
    std::string text;
    if (!fs::try_read_file(config_.token_file, &text)) {
      if (token_.empty()) {
        throw Error(ErrorKind::kEnvironment,
                    "cannot read the API token file " + config_.token_file.string(),
                    "give --token-file a readable file holding a bearer token");
      }
      return token_;  // keep the last one: a rewrite may be in progress
    }
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    token_ = text;
    token_read_ = now;
  }
  return token_;
}

std::unique_ptr<httplib::Client> ApiClient::connect(std::chrono::seconds read_timeout) {
  auto client = std::make_unique<httplib::Client>(config_.server);
  if (!client->is_valid()) {
    throw Error(ErrorKind::kUsage, "bad API server URL " + config_.server,
                "give a URL such as https://10.96.0.1:443 or http://127.0.0.1:8080");
  }
  if (!config_.ca_file.empty()) client->set_ca_cert_path(config_.ca_file.string());
  client->enable_server_certificate_verification(true);
  client->set_connection_timeout(config_.request_timeout);
  client->set_read_timeout(read_timeout);
  client->set_write_timeout(config_.request_timeout);
  client->set_keep_alive(false);
  if (auto t = token(); !t.empty()) client->set_bearer_token_auth(t);
  return client;
}

Response ApiClient::send(const char* method, const std::string& path, const json* body,
                         const std::string& content_type) {
  auto client = connect(config_.request_timeout);
  httplib::Request req;
  req.method = method;
  req.path = path;
  req.headers.emplace("Accept", "application/json");
  if (body != nullptr) {
    req.body = body->dump();
    req.headers.emplace("Content-Type", content_type);
  }
  auto result = client->send(req);
  if (!result) throw unreachable(config_.server, method, path, result.error());
  return Response{result->status, parse_body(result->body)};
}

Response ApiClient::get(const std::string& path) { return send("GET", path, nullptr, ""); }

Response ApiClient::create(const std::string& path, const json& object) {
  return send("POST", path, &object, "application/json");
}

Response ApiClient::update(const std::string& path, const json& object) {
  return send("PUT", path, &object, "application/json");
}

Response ApiClient::merge_patch(const std::string& path, const json& patch) {
  return send("PATCH", path, &patch, "application/merge-patch+json");
}

Response ApiClient::remove(const std::string& path) { return send("DELETE", path, nullptr, ""); }

Response ApiClient::watch(const std::string& path, const std::function<bool(const json&)>& on_event,
                          std::chrono::seconds read_timeout) {
  auto client = connect(read_timeout);
  {
    std::lock_guard lock(watch_mu_);
    watches_.push_back(client.get());
  }
  struct Unregister {
    Unregister(ApiClient& s, httplib::Client* cl) : self(s), c(cl) {}
    Unregister(const Unregister&) = delete;
    Unregister& operator=(const Unregister&) = delete;
    ApiClient& self;
    httplib::Client* c;
    ~Unregister() {
      std::lock_guard lock(self.watch_mu_);
      std::erase(self.watches_, c);
    }
  } unregister{*this, client.get()};

  int status = 0;
  std::string buffer;  // an event line split across chunks waits here for its newline
  std::string error_body;
  bool stopped_by_caller = false;
  bool bad_line = false;  // not thrown from inside httplib's callback: it is not exception-safe
  httplib::Headers headers{{"Accept", "application/json"}};
  auto result = client->Get(
      path, headers,
      [&](const httplib::Response& r) {
        status = r.status;
        return true;
      },
      [&](const char* data, size_t len) {
        if (status != 200) {
          error_body.append(data, len);
          return true;
        }
        buffer.append(data, len);
        size_t start = 0;
        for (size_t nl; (nl = buffer.find('\n', start)) != std::string::npos; start = nl + 1) {
          std::string_view line(buffer.data() + start, nl - start);
          if (line.find_first_not_of(" \r\t") == std::string_view::npos) continue;
          std::optional<json> parsed = json_text::parse(line);
          if (!parsed) {
            bad_line = true;
            return false;
          }
          if (!on_event(*parsed)) {
            stopped_by_caller = true;
            return false;
          }
        }
        buffer.erase(0, start);
        return true;
      });
  if (bad_line) {
    throw Error(ErrorKind::kEnvironment,
                "the API server sent a watch event that is not JSON on " + path,
                "check that --api-server points at a Kubernetes API server");
  }
  if (stopped_by_caller) return Response{200, json::object()};
  if (!result) {
    // A cancel, or a stream the server or the network cut: the caller watches again from its
    // last resourceVersion. Only a connection that never got a status is an error.
    if (status != 0 || result.error() == httplib::Error::Canceled) return Response{200, {}};
    throw unreachable(config_.server, "GET", path, result.error());
  }
  if (status == 0) status = result->status;
  if (status != 200) return Response{status, parse_body(error_body)};
  return Response{200, json::object()};
}

void ApiClient::cancel_watches() noexcept {
  std::lock_guard lock(watch_mu_);
  for (auto* c : watches_) c->stop();
}

std::string transport_error_text(httplib::Error error) {
  switch (error) {
    case httplib::Error::Connection: return "could not connect";
    case httplib::Error::ConnectionTimeout: return "timed out connecting";
    case httplib::Error::Read: return "the connection broke while reading the answer";
    case httplib::Error::Write: return "the connection broke while sending the request";
    case httplib::Error::SSLConnection: return "the TLS handshake failed";
    case httplib::Error::SSLLoadingCerts: return "cannot load the CA certificate file";
    case httplib::Error::SSLServerVerification:
      return "the server's certificate does not verify against the CA";
    case httplib::Error::Canceled: return "canceled";
    default: return httplib::to_string(error);
  }
}

}  // namespace gpusnap::kube
