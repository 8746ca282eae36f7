#include "agent/server.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <system_error>

#include <httplib.h>

#include "agent/access.h"
#include "agent/metrics_listener.h"
#include "common/fd.h"
#include "gpusnap/error.h"

namespace gpusnap::agent {

namespace {

using nlohmann::json;

constexpr size_t kMaxBody = 1 << 20;

void reply(httplib::Response& res, int status, const json& doc) {
  res.status = status;
  // A message may quote the caller's bytes: invalid UTF-8 in them is replaced, not thrown on.
  res.set_content(doc.dump(2, ' ', false, json::error_handler_t::replace) + "\n",
                  "application/json");
}

void reply_error(httplib::Response& res, const Error& e) {
  reply(res, http_status(e), {{"error", error_json(e)}});
}

// The methods a path answers to; empty when the path is not part of the API.
std::vector<std::string> methods_of(const std::string& path) {
  auto under = [&](const std::string& prefix) {
    return path.size() > prefix.size() && path.rfind(prefix, 0) == 0 &&
           path.find('/', prefix.size()) == std::string::npos;
  };
  if (path == "/v1/checkpoints" || path == "/v1/restores" || path == "/v1/prefetch") {
    return {"POST"};
  }
  if (path == "/v1/healthz" || path == "/v1/operations" || path == "/v1/snapshots" ||
      path == "/metrics" || under("/v1/operations/") || under("/v1/snapshots/") ||
      under("/v1/chunks/")) {
    return {"GET", "HEAD"};
  }
  return {};
}

// The body, up to kMaxBody, whatever its framing. A handler that reads its own body gets no
// 413 from httplib: a chunked body is read to its end whatever its size (a 300 MB one took the
// agent to 1.2 GB), and a Content-Length over the bound ends the read early, which left a cut
// body that was answered 400 "not JSON". So the declared length is checked before reading, and
// a read that stops early counts as too large. False when the body is larger than kMaxBody.
bool read_body(const httplib::Request& req, const httplib::ContentReader& read, std::string* text) {
  if (req.has_header("Content-Length")) {
    const auto declared = req.get_header_value("Content-Length");
    if (declared.size() > 9 || std::stoull("0" + declared) > kMaxBody) return false;
  }
  bool fits = true;
  const bool whole = read([&](const char* data, size_t size) {
    if (text->size() + size > kMaxBody) return fits = false;
    text->append(data, size);
    return true;
  });
  return fits && whole;
}

void answer_errors(httplib::Response& res, const std::function<void()>& handle) {
  try {
    handle();
  } catch (const LaneFull& e) {
    // Too many requests, not a fault of this one: the caller may send it again, and says when.
    reply_error(res, e);
    res.status = 429;
    res.set_header("Retry-After", std::to_string(e.retry_after_s()));
  } catch (const Error& e) {
    reply_error(res, e);
  } catch (const std::exception& e) {
    reply_error(res, Error(ErrorKind::kInternal, std::string("internal error: ") + e.what()));
  }
}

// TCP callers come through the TcpFront, which checked their token: every request here is
// authorised.
void install(httplib::Server& server, Agent& agent) {
  server.set_payload_max_length(kMaxBody);
  server.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    const auto methods = methods_of(req.path);
    if (methods.empty()) {
      reply_error(res, Error(ErrorKind::kNotFound, "no such endpoint " + req.path,
                             "see the agent API in docs/design.md"));
      return httplib::Server::HandlerResponse::Handled;
    }
    if (std::find(methods.begin(), methods.end(), req.method) == methods.end()) {
      std::string allow;
      for (const auto& m : methods) allow += (allow.empty() ? "" : ", ") + m;
      res.set_header("Allow", allow);
      reply_error(res, Error(ErrorKind::kUsage, req.method + " is not allowed on " + req.path,
                             "use " + allow));
      res.status = 405;
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Every handler answers errors as the API's error object, whatever threw.
  auto guarded = [](auto handler) {
    return [handler](const httplib::Request& req, httplib::Response& res) {
      answer_errors(res, [&] { handler(req, res); });
    };
  };
  // The same for a handler that reads its body itself (ContentReader).
  auto guarded_reader = [](auto handler) {
    return [handler](const httplib::Request& req, httplib::Response& res,
                     const httplib::ContentReader& read) {
      answer_errors(res, [&] { handler(req, res, read); });
    };
  };
  server.Get("/v1/healthz", guarded([&agent](const httplib::Request&, httplib::Response& res) {
               reply(res, 200,
                     {{"ok", true}, {"version", GPUSNAP_VERSION}, {"node", agent.config().node}});
             }));
  // Each POST submits an operation: the same body bounds, the same 202 and Location.
  using Submit = json (Agent::*)(const json&);
  auto post = [&agent](Submit submit) {
    return [&agent, submit](const httplib::Request& req, httplib::Response& res,
                            const httplib::ContentReader& read) {
      std::string text;
      if (!read_body(req, read, &text)) {
        reply_error(res, Error(ErrorKind::kUsage, "the request body is larger than 1 MiB",
                               "send a request of the agent's API, not a file"));
        res.status = 413;
        // The rest of the body was not read: it must not be taken for the next request.
        res.set_header("Connection", "close");
        return;
      }
      const json body = parse_body(text);
      json op = (agent.*submit)(body);
      res.set_header("Location", "/v1/operations/" + op.at("id").get<std::string>());
      reply(res, 202, {{"operation", op}});
    };
  };
  server.Post("/v1/checkpoints", guarded_reader(post(&Agent::submit_checkpoint)));
  server.Post("/v1/restores", guarded_reader(post(&Agent::submit_restore)));
  server.Post("/v1/prefetch", guarded_reader(post(&Agent::submit_prefetch)));
  server.Get("/v1/operations", guarded([&agent](const httplib::Request&, httplib::Response& res) {
               reply(res, 200, agent.operations());
             }));
  server.Get(R"(/v1/operations/([^/]+))",
             guarded([&agent](const httplib::Request& req, httplib::Response& res) {
               const std::string id = req.matches[1];
               auto op = agent.operation(id);
               if (!op) {
                 throw Error(ErrorKind::kNotFound, "no operation " + id,
                             "list the operations with GET /v1/operations");
               }
               reply(res, 200, *op);
             }));
  server.Get("/v1/snapshots", guarded([&agent](const httplib::Request&, httplib::Response& res) {
               reply(res, 200, agent.snapshots());
             }));
  server.Get(R"(/v1/snapshots/([^/]+))",
             guarded([&agent](const httplib::Request& req, httplib::Response& res) {
               reply(res, 200, agent.snapshot(req.matches[1]));
             }));
  // A chunk for a peer (store/peers.h): the caller checks it against its digest.
  server.Get(R"(/v1/chunks/([^/]+))",
             guarded([&agent](const httplib::Request& req, httplib::Response& res) {
               const auto& chunks = agent.config().peer_chunks;
               if (!chunks) {
                 throw Error(ErrorKind::kNotFound, "this agent serves no chunks to peers",
                             "start it with --serve-peers");
               }
               const store::PeerRequest r = store::PeerRequest::parse(req.target);
               res.status = 200;
               res.set_content(chunks->get(r), "application/octet-stream");
             }));
  server.Get("/metrics", guarded([&agent](const httplib::Request&, httplib::Response& res) {
               res.status = 200;
               res.set_content(exposition(agent), "text/plain; version=0.0.4; charset=utf-8");
             }));
  server.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, const std::exception_ptr&) {
        reply_error(res, Error(ErrorKind::kInternal, "internal error in the agent"));
      });
  // One line per request that changes something or fails: an operator's trail, without the
  // polling. A refusal carries its error, which the caller alone would otherwise have seen.
  server.set_logger([&agent](const httplib::Request& req, const httplib::Response& res) {
    if (req.method == "GET" && res.status < 400) return;
    json error;
    if (res.status >= 400) {
      const json doc = json::parse(res.body, nullptr, false);
      if (doc.is_object() && doc.contains("error")) error = doc["error"];
    }
    agent.log().request(req.method, req.path, res.status, error);
  });
}

// Whether someone accepts connections on the Unix socket at `path`.
bool socket_in_use(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), std::min(path.size() + 1, sizeof addr.sun_path));
  common::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  return fd && ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
}

}  // namespace

Server::Server(const ListenOptions& options) : options_(options) {
  const auto& path = options_.socket_path;
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    throw Error(ErrorKind::kUsage, "socket path " + path + " is too long",
                "use a path shorter than 108 bytes");
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (std::filesystem::exists(std::filesystem::symlink_status(path, ec))) {
    if (socket_in_use(path)) {
      throw Error(ErrorKind::kEnvironment, "another agent is serving " + path,
                  "stop it first, or give this one another --socket");
    }
    if (!std::filesystem::is_socket(std::filesystem::symlink_status(path, ec))) {
      throw Error(ErrorKind::kUsage, path + " exists and is not a socket",
                  "remove it, or give the agent another --socket");
    }
    std::filesystem::remove(path, ec);  // left by an agent that died
  }
  unix_ = std::make_unique<httplib::Server>();
  unix_->set_address_family(AF_UNIX);
  // The socket is created by bind() with the umask's mode: 0660 from its first instant, never
  // reachable by others for a moment before a chmod.
  const mode_t old_umask = ::umask(0117);
  const bool bound = unix_->bind_to_port(path, 80);
  ::umask(old_umask);
  if (!bound) {
    throw sys_error("listen on " + path, errno);
  }
  if (options_.socket_group && ::chown(path.c_str(), 0, *options_.socket_group) != 0) {
    throw sys_error("give " + path + " to group " + std::to_string(*options_.socket_group), errno);
  }
  if (::chmod(path.c_str(), 0660) != 0) throw sys_error("chmod " + path, errno);

  if (!options_.tcp_address.empty()) {
    tcp_ = std::make_unique<TcpFront>(options_.tcp_address, options_.tcp_port, options_.token,
                                      options_.socket_path);
    tcp_port_ = tcp_->port();
  }
}

Server::~Server() {
  stop();
  std::error_code ec;
  std::filesystem::remove(options_.socket_path, ec);
}

void Server::start(Agent& agent) {
  install(*unix_, agent);
  // A peer's ask may wait on the owner's fetch from the origin: more threads than the fetches
  // PeerChunks runs at once, so that the API's other calls still find one.
  if (agent.config().peer_chunks) {
    unix_->new_task_queue = [] { return new httplib::ThreadPool(64); };
  }
  unix_thread_ = std::jthread([this] {
    unix_->listen_after_bind();
    unix_done_ = true;
  });
  if (tcp_) tcp_->start();
}

void Server::stop() noexcept {
  auto end = [](httplib::Server* server, std::jthread& thread, const std::atomic<bool>& done) {
    if (server == nullptr || !thread.joinable()) return;
    while (!done) {
      server->stop();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    thread.join();
  };
  if (tcp_) tcp_->stop();  // first: it relays to unix_
  end(unix_.get(), unix_thread_, unix_done_);
}

}  // namespace gpusnap::agent
