#include "agent/request.h"

#include <set>

#include "common/json.h"
#include "gpusnap/error.h"

namespace gpusnap::agent {

namespace {

using nlohmann::json;

Error bad(const std::string& what,
          const std::string& hint = "see the agent API in docs/design.md") {
  return Error(ErrorKind::kUsage, what, hint);
}

void refuse_unknown(const json& body, const std::set<std::string>& known, const std::string& of) {
  for (const auto& [key, value] : body.items()) {
    if (known.count(key) == 0) {
      std::string list;
      for (const auto& k : known) list.append(list.empty() ? "" : ", ").append(k);
      throw bad("unknown field " + json_text::brief(key) + " in " + of, "the fields are: " + list);
    }
  }
}

std::string string_field(const json& body, const std::string& key, const std::string& of) {
  const auto& v = body.at(key);
  if (!v.is_string()) throw bad("\"" + key + "\" in " + of + " must be a string");
  return v.get<std::string>();
}

long int_field(const json& body, const std::string& key, long min, long max) {
  const auto& v = body.at(key);
  if (!v.is_number_integer() || v.get<long>() < min || v.get<long>() > max) {
    throw bad("\"" + key + "\" must be a whole number from " + std::to_string(min) + " to " +
              std::to_string(max) + ", not " + json_text::brief(v));
  }
  return v.get<long>();
}

// handshake_timeout_s of a checkpoint or restore request: 1 s to a day, when given.
std::optional<long> handshake_timeout(const json& body) {
  if (!body.contains("handshake_timeout_s")) return std::nullopt;
  return int_field(body, "handshake_timeout_s", 1, 86400);
}

bool bool_field(const json& body, const std::string& key) {
  const auto& v = body.at(key);
  if (!v.is_boolean())
    throw bad("\"" + key + "\" must be true or false, not " + json_text::brief(v));
  return v.get<bool>();
}

std::vector<std::string> string_list(const json& body, const std::string& key) {
  const auto& v = body.at(key);
  if (!v.is_array()) throw bad("\"" + key + "\" must be a list of strings");
  std::vector<std::string> out;
  for (const auto& item : v) {
    if (!item.is_string())
      throw bad("\"" + key + "\" must be a list of strings, not " + json_text::brief(v));
    out.push_back(item.get<std::string>());
  }
  return out;
}

ContainerName container_field(const json& body, const std::string& key) {
  const auto& v = body.at(key);
  const std::string of = "\"" + key + "\"";
  if (!v.is_object()) throw bad(of + " must be an object {\"id\":…, \"runtime_root\":…}");
  refuse_unknown(v, {"id", "runtime_root"}, of);
  if (!v.contains("id")) throw bad(of + " needs \"id\", the container's id");
  ContainerName c;
  c.id = string_field(v, "id", of);
  if (c.id.empty() || c.id.find('/') != std::string::npos) {
    throw bad("bad container id '" + c.id + "' in " + of, "name the container by its runtime id");
  }
  // Absent or empty: found among the runtimes' roots (container::find_runtime_root()).
  if (v.contains("runtime_root") && !string_field(v, "runtime_root", of).empty()) {
    c.runtime_root = string_field(v, "runtime_root", of);
    if (!c.runtime_root.is_absolute()) {
      throw bad("\"runtime_root\" in " + of + " must be an absolute path, not '" +
                c.runtime_root.string() + "'");
    }
  }
  return c;
}

json container_json(const ContainerName& c) {
  return {{"id", c.id}, {"runtime_root", c.runtime_root.string()}};
}

std::string artifact_field(const json& body, const std::string& of) {
  if (!body.contains("artifact")) throw bad(of + " needs \"artifact\", the snapshot's name");
  auto name = string_field(body, "artifact", of);
  check_artifact_name(name);
  return name;
}

std::string reference_field(const json& body, const std::string& of) {
  auto text = string_field(body, "reference", of);
  if (text.size() > kMaxReferenceBytes) {
    throw bad("\"reference\" in " + of + " is longer than " + std::to_string(kMaxReferenceBytes) +
              " bytes");
  }
  if (!text.starts_with("oci://")) {
    throw bad("\"reference\" in " + of + " must be oci://HOST[:PORT]/REPO[:TAG|@sha256:HEX], not " +
              json_text::brief(body.at("reference")));
  }
  return text;
}

ContainerRef container_ref(const ContainerName& c) { return {c.id, c.runtime_root}; }

}  // namespace

void check_artifact_name(const std::string& name) {
  const std::string hint = "name the snapshot with letters, digits, '.', '-' or '_', no slash";
  if (name.empty()) throw bad("the artifact name is empty", hint);
  if (name.size() > 255) throw bad("the artifact name is longer than 255 bytes", hint);
  for (char c : name) {
    // Not printable in a message or a log line, and a NUL would cut the path short.
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      throw bad("the artifact name contains a control character", hint);
    }
  }
  if (name.find('/') != std::string::npos) {
    throw bad("artifact name '" + name + "' is a path, not a name", hint);
  }
  if (name == "." || name == "..") throw bad("artifact name '" + name + "' is not a name", hint);
  if (name[0] == '.') {
    throw bad("artifact name '" + name + "' is hidden: hidden names are for staging", hint);
  }
}

json parse_body(const std::string& text) {
  std::string why;
  auto body = json_text::parse(text, &why);
  if (!body) {
    throw bad("the request body is not JSON: " + why,
              "send a JSON object with Content-Type: application/json");
  }
  if (!body->is_object()) {
    throw bad("the request body must be a JSON object, not " + json_text::brief(*body));
  }
  return std::move(*body);
}

CheckpointRequest parse_checkpoint_request(const json& body) {
  const std::string of = "a checkpoint request";
  refuse_unknown(body, {"artifact", "pid", "container", "leave_running", "handshake_timeout_s"},
                 of);
  CheckpointRequest r;
  r.artifact = artifact_field(body, of);
  const bool pid = body.contains("pid"), container = body.contains("container");
  if (pid == container) {
    throw bad(pid ? "a checkpoint request names either \"pid\" or \"container\", not both"
                  : "a checkpoint request needs \"pid\" or \"container\"",
              "give the workload's host pid, or its container");
  }
  if (pid) r.pid = static_cast<pid_t>(int_field(body, "pid", 1, 1L << 22));
  if (container) r.container = container_field(body, "container");
  if (body.contains("leave_running")) r.leave_running = bool_field(body, "leave_running");
  r.handshake_timeout_s = handshake_timeout(body);
  return r;
}

RestoreRequest parse_restore_request(const json& body) {
  const std::string of = "a restore request";
  refuse_unknown(body,
                 {"artifact", "reference", "replicas", "into_container", "settings", "gpu_map",
                  "publish", "handshake_timeout_s"},
                 of);
  RestoreRequest r;
  r.artifact = artifact_field(body, of);
  if (body.contains("reference")) r.reference = reference_field(body, of);
  if (body.contains("replicas"))
    r.replicas = static_cast<int>(int_field(body, "replicas", 1, 1024));
  if (body.contains("into_container")) {
    if (body.contains("replicas") && r.replicas != 1) {
      throw bad("a restore into a container starts one copy, not " + std::to_string(r.replicas),
                "drop \"replicas\", or restore into one container per copy");
    }
    r.into_container = container_field(body, "into_container");
  }
  if (body.contains("settings")) {
    const auto& s = body.at("settings");
    if (!s.is_object()) throw bad("\"settings\" must be an object of strings");
    for (const auto& [key, value] : s.items()) {
      if (!value.is_string() || key.empty()) {
        throw bad("\"settings\" must map names to strings; " + json_text::brief(key) + " is " +
                  json_text::brief(value));
      }
      r.settings[key] = value.get<std::string>();
    }
  }
  if (body.contains("gpu_map")) {
    r.gpu_map = string_list(body, "gpu_map");
    for (const auto& m : r.gpu_map) {
      auto eq = m.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == m.size()) {
        throw bad("bad gpu_map entry '" + m + "'",
                  "write each entry as OLD=NEW (UUIDs or indexes)");
      }
    }
  }
  if (body.contains("publish")) r.publish = string_list(body, "publish");
  r.handshake_timeout_s = handshake_timeout(body);
  return r;
}

PrefetchRequest parse_prefetch_request(const json& body) {
  const std::string of = "a prefetch request";
  refuse_unknown(body, {"artifact", "reference"}, of);
  const bool artifact = body.contains("artifact"), reference = body.contains("reference");
  if (artifact == reference) {
    throw bad(artifact ? "a prefetch request names either \"artifact\" or \"reference\", not both"
                       : "a prefetch request needs \"reference\" or \"artifact\"",
              "give the snapshot's oci:// reference, or its name in the agent's repository");
  }
  PrefetchRequest r;
  if (artifact) r.artifact = artifact_field(body, of);
  if (reference) r.reference = reference_field(body, of);
  return r;
}

json to_json(const CheckpointRequest& r) {
  json doc{{"artifact", r.artifact}, {"leave_running", r.leave_running}};
  if (r.pid != 0) doc["pid"] = r.pid;
  if (r.container) doc["container"] = container_json(*r.container);
  if (r.handshake_timeout_s) doc["handshake_timeout_s"] = *r.handshake_timeout_s;
  return doc;
}

json to_json(const RestoreRequest& r) {
  json doc{{"artifact", r.artifact},
           {"replicas", r.replicas},
           {"settings", r.settings},
           {"gpu_map", r.gpu_map},
           {"publish", r.publish}};
  if (r.reference) doc["reference"] = *r.reference;
  if (r.into_container) doc["into_container"] = container_json(*r.into_container);
  if (r.handshake_timeout_s) doc["handshake_timeout_s"] = *r.handshake_timeout_s;
  return doc;
}

json to_json(const PrefetchRequest& r) {
  return r.reference.empty() ? json{{"artifact", r.artifact}} : json{{"reference", r.reference}};
}

CheckpointOptions checkpoint_options(const CheckpointRequest& r, const EngineSettings& s) {
  CheckpointOptions o;
  o.pid = r.pid;
  if (r.container) o.container = container_ref(*r.container);
  o.output = s.storage / r.artifact;
  o.leave_running = r.leave_running;
  o.criu_path = s.criu_path;
  o.helper_binary = s.helper_binary;
  o.run_dir = s.run_dir;
  o.artifact_group = s.artifact_group;
  if (r.handshake_timeout_s) o.handshake_timeout = std::chrono::seconds(*r.handshake_timeout_s);
  return o;
}

RestoreOptions restore_options(const RestoreRequest& r, const EngineSettings& s) {
  RestoreOptions o;
  o.artifact = s.storage / r.artifact;
  o.replicas = r.replicas;
  if (r.into_container) o.into_container = container_ref(*r.into_container);
  o.criu_path = s.criu_path;
  o.helper_binary = s.helper_binary;
  o.run_dir = s.run_dir;
  for (const auto& p : r.publish) o.publish.push_back(PortPublish::parse(p));
  o.gpu_map = r.gpu_map;
  o.settings = r.settings;
  if (r.handshake_timeout_s) o.handshake_timeout = std::chrono::seconds(*r.handshake_timeout_s);
  return o;
}

}  // namespace gpusnap::agent
