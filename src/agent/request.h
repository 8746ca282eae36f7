// The agent's requests: strict parsing of the JSON bodies of POST /v1/checkpoints,
// POST /v1/restores and POST /v1/prefetch, and the one place where a request becomes the
// engine's options.
//
// Parsing is strict because a field the agent ignores is a field the caller believes was
// applied: an unknown field, a value of the wrong type or range, an artifact name that is a
// path, each is refused with Error(kUsage) naming the field.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpusnap/checkpoint.h"
#include "gpusnap/restore.h"

namespace gpusnap::agent {

// A container, named as its runtime knows it.
struct ContainerName {
  std::string id;
  // The runtime's state directory; empty: found (container::find_runtime_root()).
  std::filesystem::path runtime_root;
};

struct CheckpointRequest {
  std::string artifact;  // a name in the agent's storage
  pid_t pid = 0;         // 0: `container` names the workload
  std::optional<ContainerName> container;
  bool leave_running = true;
  std::optional<long> handshake_timeout_s;
};

// An oci:// reference is bounded and checked for its scheme here; its full syntax, and that
// it is in the agent's own repository, by the agent's registry storage (agent/registry_storage.h).
inline constexpr size_t kMaxReferenceBytes = 1024;

struct RestoreRequest {
  std::string artifact;
  // Where the snapshot is when this node does not hold `artifact` (registry storage only).
  std::optional<std::string> reference;
  int replicas = 1;
  std::optional<ContainerName> into_container;
  std::map<std::string, std::string> settings;
  std::vector<std::string> gpu_map;  // "OLD=NEW"
  std::vector<std::string> publish;  // "[ADDR:][HOSTPORT:]PORT"
  std::optional<long> handshake_timeout_s;
};

// A snapshot to pull into the node cache ahead of a restore: by its name in the agent's
// repository, or by reference (oci://HOST/REPO[:TAG|@sha256:HEX]); exactly one of the two.
struct PrefetchRequest {
  std::string artifact;
  std::string reference;
};

// Parse a body; throw Error(kUsage) naming what is wrong.
CheckpointRequest parse_checkpoint_request(const nlohmann::json& body);
RestoreRequest parse_restore_request(const nlohmann::json& body);
PrefetchRequest parse_prefetch_request(const nlohmann::json& body);
// The body text as JSON; Error(kUsage) when it is not a JSON object.
nlohmann::json parse_body(const std::string& text);
// The request as the operation shows it, defaults filled in.
nlohmann::json to_json(const CheckpointRequest& request);
nlohmann::json to_json(const RestoreRequest& request);
nlohmann::json to_json(const PrefetchRequest& request);

// Refuses (Error kUsage) a name that is not a plain directory name in the storage: empty, a
// path (a slash), ".", "..", a hidden name (staging directories are hidden), a control
// character, or longer than 255 bytes.
void check_artifact_name(const std::string& name);

// What the agent decides for every operation, whatever the request.
struct EngineSettings {
  std::filesystem::path storage;  // artifacts live at storage/NAME
  std::filesystem::path run_dir = "/run/gpusnap";
  std::string helper_binary;  // the gpusnap binary, which runs the engine's helper processes
  std::string criu_path;      // empty: locate CRIU
  std::optional<gid_t> artifact_group;  // may read the artifacts (default: root only)
};

// The request as the engine's options. Throws Error(kUsage) for a value only the engine's own
// parser knows to refuse (a --publish form).
CheckpointOptions checkpoint_options(const CheckpointRequest& request,
                                     const EngineSettings& settings);
RestoreOptions restore_options(const RestoreRequest& request, const EngineSettings& settings);

}  // namespace gpusnap::agent
