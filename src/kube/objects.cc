#include "kube/objects.h"

#include "common/utc.h"

namespace gpusnap::kube {

std::string snapshots_path(const std::string& ns) {
  std::string base = std::string("/apis/") + kGroup + "/" + kVersion;
  return ns.empty() ? base + "/gpusnapshots" : base + "/namespaces/" + ns + "/gpusnapshots";
}

std::string snapshot_path(const std::string& ns, const std::string& name) {
  return snapshots_path(ns) + "/" + name;
}

std::string pods_path(const std::string& ns) {
  return ns.empty() ? "/api/v1/pods" : "/api/v1/namespaces/" + ns + "/pods";
}

std::string pod_path(const std::string& ns, const std::string& name) {
  return pods_path(ns) + "/" + name;
}

std::string events_path(const std::string& ns) { return "/api/v1/namespaces/" + ns + "/events"; }

std::string artifact_name(const std::string& ns, const std::string& name) {
  return ns + "." + name;
}

bool set_condition(json& conditions, const Condition& c, long observed_generation) {
  if (!conditions.is_array()) conditions = json::array();
  json* existing = nullptr;
  for (auto& item : conditions) {
    if (item.value("type", "") == c.type) existing = &item;
  }
  if (existing == nullptr) {
    conditions.push_back({{"type", c.type}});
    existing = &conditions.back();
  }
  json& e = *existing;
  bool changed = e.value("status", "") != c.status || e.value("reason", "") != c.reason ||
                 e.value("message", "") != c.message;
  if (e.value("status", "") != c.status || !e.contains("lastTransitionTime")) {
    e["lastTransitionTime"] = utc::now();
    changed = true;
  }
  e["status"] = c.status;
  e["reason"] = c.reason;
  e["message"] = c.message;
  if (observed_generation >= 0 && e.value("observedGeneration", -1L) != observed_generation) {
    e["observedGeneration"] = observed_generation;
    changed = true;
  }
  return changed;
}

std::optional<json> find_condition(const json& conditions, const std::string& type) {
  if (!conditions.is_array()) return std::nullopt;
  for (const auto& item : conditions) {
    if (item.value("type", "") == type) return item;
  }
  return std::nullopt;
}

std::string first_container(const json& pod) {
  const json& containers = pod.value("/spec/containers"_json_pointer, json::array());
  if (containers.empty()) return "";
  return containers.front().value("name", "");
}

std::optional<ContainerState> container_state(const json& pod, const std::string& name) {
  std::string want = name.empty() ? first_container(pod) : name;
  const json& statuses = pod.value("/status/containerStatuses"_json_pointer, json::array());
  for (const auto& s : statuses) {
    if (s.value("name", "") != want) continue;
    ContainerState out;
    out.name = want;
    std::string id = s.value("containerID", "");
    // "containerd://ID", "cri-o://ID", "docker://ID": runc knows the bare ID.
    if (auto at = id.find("://"); at != std::string::npos) id = id.substr(at + 3);
    out.id = id;
    const json& state = s.value("state", json::object());
    out.running = state.contains("running");
    out.terminated = state.contains("terminated");
    return out;
  }
  return std::nullopt;
}

bool pod_ready(const json& pod) {
  auto c = find_condition(pod.value("/status/conditions"_json_pointer, json::array()), "Ready");
  return c && c->value("status", "") == "True";
}

std::string reason_of_kind(const std::string& kind) {
  std::string out;
  bool upper = true;
  for (char ch : kind) {
    if (ch == '-' || ch == '_') {
      upper = true;
      continue;
    }
    out += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(ch))) : ch;
    upper = false;
  }
  return out.empty() ? "AgentError" : out;
}

std::string str_at(const json& j, const std::string& pointer) {
  json::json_pointer p(pointer);
  if (!j.contains(p)) return "";
  const json& v = j.at(p);
  return v.is_string() ? v.get<std::string>() : "";
}

std::string annotation(const json& object, const std::string& name) {
  // The pointer escapes the name's "/" ("gpusnap.io~1snapshot").
  return str_at(object, ("/metadata/annotations"_json_pointer / name).to_string());
}

}  // namespace gpusnap::kube
