// What the controller asks of the node's gpusnap agent, over the agent's HTTP API
// (docs/design.md, "The agent"): start a checkpoint or a restore, follow the operation,
// look an artifact up. The controller depends on this interface only, so that it can be wired
// into the agent process later with a direct implementation, and talks HTTP today.
#pragma once

#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpusnap/error.h"

namespace gpusnap::kube {

// A container as the node's OCI runtime (runc) knows it.
struct ContainerTarget {
  std::string id;
  std::string runtime_root;  // runc's state directory, e.g. /run/containerd/runc/k8s.io
};

struct CheckpointCall {
  std::string artifact;  // a name under the agent's storage, no slashes
  ContainerTarget container;
  bool leave_running = true;
  int handshake_timeout_s = 0;  // 0: the agent's default
};

struct RestoreCall {
  std::string artifact;
  // The snapshot's oci:// reference by digest (GpuSnapshot status.reference): an agent with
  // registry storage that does not hold `artifact` pulls it from there. Empty: none.
  std::string reference;
  ContainerTarget into_container;
  std::map<std::string, std::string> settings;
};

struct OperationError {
  std::string kind;  // ErrorKind's name: "incompatible", "criu", ...
  int exit_code = 0;
  std::string message;
};

struct OperationPhase {
  std::string name;
  double seconds = 0;
  bool done = false;
};

// An agent operation, as GET /v1/operations/ID returns it.
// NOLINTNEXTLINE(bugprone-exception-escape): json's default constructor allocates nothing
struct Operation {
  std::string id;
  std::string kind;   // "checkpoint" or "restore"
  std::string state;  // "pending", "running", "succeeded", "failed"
  std::vector<OperationPhase> phases;
  std::optional<OperationError> error;
  nlohmann::json result;  // null until it succeeded

  bool finished() const { return state == "succeeded" || state == "failed"; }
  static Operation from_json(const nlohmann::json& j);
};

class AgentClient {
 public:
  virtual ~AgentClient() = default;
  // Each throws Error: the agent's own error (its kind, exit code and message) for a refused
  // request, kEnvironment when the agent cannot be reached.
  virtual Operation start_checkpoint(const CheckpointCall& call) = 0;
  virtual Operation start_restore(const RestoreCall& call) = 0;
  // nullopt when the agent does not know the operation (404): it restarted since.
  virtual std::optional<Operation> operation(const std::string& id) = 0;
  // The artifact's inspect document, nullopt when the agent has no artifact of that name.
  virtual std::optional<nlohmann::json> snapshot(const std::string& name) = 0;
};

// The agent's HTTP API on its Unix socket, or on TCP with a bearer token.
struct AgentEndpoint {
  std::filesystem::path socket = "/run/gpusnap/agent.sock";
  std::string url;                   // "http://host:port": TCP instead of the socket
  std::filesystem::path token_file;  // TCP only
  std::chrono::seconds timeout{30};
};

class HttpAgentClient : public AgentClient {
 public:
  explicit HttpAgentClient(AgentEndpoint endpoint) : endpoint_(std::move(endpoint)) {}
  Operation start_checkpoint(const CheckpointCall& call) override;
  Operation start_restore(const RestoreCall& call) override;
  std::optional<Operation> operation(const std::string& id) override;
  std::optional<nlohmann::json> snapshot(const std::string& name) override;

 private:
  struct Reply {
    int status = 0;
    nlohmann::json body;
  };
  Reply call(const char* method, const std::string& path, const nlohmann::json* body);
  Error error_of(const Reply& reply, const std::string& what) const;
  std::string where() const;

  AgentEndpoint endpoint_;
};

// The ErrorKind whose name is `name` ("incompatible" → kIncompatible); kInternal if unknown.
ErrorKind kind_from_name(const std::string& name);

}  // namespace gpusnap::kube
