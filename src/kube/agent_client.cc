#include "kube/agent_client.h"

#include <sys/socket.h>

#include <httplib.h>

#include "common/fs.h"
#include "kube/api_client.h"

namespace gpusnap::kube {

using nlohmann::json;

ErrorKind kind_from_name(const std::string& name) {
  for (int k = static_cast<int>(ErrorKind::kInternal); k <= static_cast<int>(ErrorKind::kKey);
       ++k) {
    if (name == Error::kind_name(static_cast<ErrorKind>(k))) return static_cast<ErrorKind>(k);
  }
  return ErrorKind::kInternal;
}

Operation Operation::from_json(const json& j) {
  Operation op;
  op.id = j.value("id", "");
  op.kind = j.value("kind", "");
  op.state = j.value("state", "");
  for (const auto& p : j.value("phases", json::array())) {
    op.phases.push_back({p.value("name", ""), p.value("seconds", 0.0), p.value("done", false)});
  }
  if (j.contains("error") && j["error"].is_object()) {
    const auto& e = j["error"];
    op.error = OperationError{e.value("kind", ""), e.value("exit_code", 0), e.value("message", "")};
  }
  op.result = j.value("result", json());
  return op;
}

std::string HttpAgentClient::where() const {
  return endpoint_.url.empty() ? endpoint_.socket.string() : endpoint_.url;
}

HttpAgentClient::Reply HttpAgentClient::call(const char* method, const std::string& path,
                                             const json* body) {
  std::unique_ptr<httplib::Client> client;
  if (endpoint_.url.empty()) {
    // httplib takes the socket path as the host; the port is ignored for AF_UNIX.
    client = std::make_unique<httplib::Client>(endpoint_.socket.string(), 80);
    client->set_address_family(AF_UNIX);
  } else {
    client = std::make_unique<httplib::Client>(endpoint_.url);
    std::string token;
    if (!endpoint_.token_file.empty() && fs::try_read_file(endpoint_.token_file, &token)) {
      while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
      client->set_bearer_token_auth(token);
    }
  }
  client->set_connection_timeout(endpoint_.timeout);
  client->set_read_timeout(endpoint_.timeout);
  client->set_keep_alive(false);
  httplib::Request req;
  req.method = method;
  req.path = path;
  if (body != nullptr) {
    req.body = body->dump();
    req.headers.emplace("Content-Type", "application/json");
  }
  auto result = client->send(req);
  if (!result) {
    throw Error(ErrorKind::kEnvironment,
                std::string("the gpusnap agent at ") + where() + " did not answer " + method + " " +
                    path + ": " + transport_error_text(result.error()),
                "check that the gpusnap agent runs on this node and that its socket is mounted");
  }
  Reply reply{result->status, json::parse(result->body, nullptr, false)};
  if (reply.body.is_discarded()) reply.body = json{{"text", result->body.substr(0, 200)}};
  return reply;
}

Error HttpAgentClient::error_of(const Reply& reply, const std::string& what) const {
  if (reply.body.is_object() && reply.body.contains("error") && reply.body["error"].is_object()) {
    const auto& e = reply.body["error"];
    return Error(kind_from_name(e.value("kind", "")), e.value("message", what),
                 e.value("hint", ""));
  }
  return Error(ErrorKind::kInternal,
               "the gpusnap agent at " + where() + " answered " + std::to_string(reply.status) +
                   " to " + what,
               "read the agent's log on this node");
}

Operation HttpAgentClient::start_checkpoint(const CheckpointCall& c) {
  json body{{"artifact", c.artifact},
            {"container", {{"id", c.container.id}, {"runtime_root", c.container.runtime_root}}},
            {"leave_running", c.leave_running}};
  if (c.handshake_timeout_s > 0) body["handshake_timeout_s"] = c.handshake_timeout_s;
  auto reply = call("POST", "/v1/checkpoints", &body);
  if (reply.status != 202 && reply.status != 200) throw error_of(reply, "a checkpoint");
  return Operation::from_json(reply.body.value("operation", json::object()));
}

Operation HttpAgentClient::start_restore(const RestoreCall& c) {
  json body{{"artifact", c.artifact},
            {"into_container",
             {{"id", c.into_container.id}, {"runtime_root", c.into_container.runtime_root}}}};
  if (!c.reference.empty()) body["reference"] = c.reference;
  if (!c.settings.empty()) body["settings"] = c.settings;
  auto reply = call("POST", "/v1/restores", &body);
  if (reply.status != 202 && reply.status != 200) throw error_of(reply, "a restore");
  return Operation::from_json(reply.body.value("operation", json::object()));
}

std::optional<Operation> HttpAgentClient::operation(const std::string& id) {
  auto reply = call("GET", "/v1/operations/" + id, nullptr);
  if (reply.status == 404) return std::nullopt;
  if (reply.status != 200) throw error_of(reply, "operation " + id);
  // Either the operation object itself or {"operation":{...}}: accept both shapes.
  const json& j = reply.body.contains("operation") ? reply.body["operation"] : reply.body;
  return Operation::from_json(j);
}

std::optional<json> HttpAgentClient::snapshot(const std::string& name) {
  auto reply = call("GET", "/v1/snapshots/" + name, nullptr);
  if (reply.status == 404) return std::nullopt;
  if (reply.status != 200) throw error_of(reply, "snapshot " + name);
  return reply.body;
}

}  // namespace gpusnap::kube
