// The Kubernetes side of gpusnap, as data: the API group and its paths, the annotations and
// conditions the controller reads and writes, and small helpers over pod and condition JSON.
// deploy/crds/ holds the matching CustomResourceDefinition; docs/kubernetes.md explains each
// name for users.
#pragma once

#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace gpusnap::kube {

using nlohmann::json;

inline constexpr const char* kGroup = "gpusnap.io";
inline constexpr const char* kVersion = "v1alpha1";
inline constexpr const char* kApiVersion = "gpusnap.io/v1alpha1";
inline constexpr const char* kSnapshotKind = "GpuSnapshot";

// On a pod: restore it from the GpuSnapshot of this name (same namespace).
inline constexpr const char* kSnapshotAnnotation = "gpusnap.io/snapshot";
// On a pod: which container receives the restore (default: the first one).
inline constexpr const char* kContainerAnnotation = "gpusnap.io/container";
// On a pod: a JSON object of string settings handed to the restored workload (handshake).
inline constexpr const char* kSettingsAnnotation = "gpusnap.io/settings";
// Written by the controller on a pod: the agent operation restoring it, so that a restarted
// controller follows it instead of starting a second restore into the same container.
inline constexpr const char* kRestoreOperationAnnotation = "gpusnap.io/restore-operation";
// The pod condition (a readiness gate) the controller sets once the restore is done.
inline constexpr const char* kRestoredCondition = "gpusnap.io/restored";
// On a pod the controller launched from a GpuSnapshot's template: that snapshot's name.
inline constexpr const char* kSourceLabel = "gpusnap.io/snapshot-source";

// Snapshot phases (status.phase).
inline constexpr const char* kPhasePending = "Pending";
inline constexpr const char* kPhaseLaunching = "Launching";
inline constexpr const char* kPhaseWaitingReady = "WaitingForReady";
inline constexpr const char* kPhaseCapturing = "Capturing";
inline constexpr const char* kPhaseSucceeded = "Succeeded";
inline constexpr const char* kPhaseFailed = "Failed";

std::string snapshots_path(const std::string& ns = "");
std::string snapshot_path(const std::string& ns, const std::string& name);
std::string pods_path(const std::string& ns = "");
std::string pod_path(const std::string& ns, const std::string& name);
std::string events_path(const std::string& ns);

// The artifact name of a snapshot on the agent's storage: "NAMESPACE.NAME". Namespaces hold
// no dots (DNS labels), so two snapshots never share a name.
std::string artifact_name(const std::string& ns, const std::string& name);

// A condition as Kubernetes conventions write it.
struct Condition {
  std::string type;
  std::string status;  // "True", "False", "Unknown"
  std::string reason;  // CamelCase, machine-readable
  std::string message;
};

// Sets `c` in a conditions array (creating it if null). lastTransitionTime changes only when
// the status does; observedGeneration (if >= 0) is written too. Returns whether anything
// changed.
bool set_condition(json& conditions, const Condition& c, long observed_generation = -1);
// The condition of this type, or nullopt.
std::optional<json> find_condition(const json& conditions, const std::string& type);

// A container of a pod as its status reports it.
struct ContainerState {
  std::string name;
  std::string id;  // the runtime's id, without the "containerd://" scheme
  bool running = false;
  bool terminated = false;
};
// The named container (or the first one when `name` is empty) of a pod's status; nullopt when
// the status does not list it yet.
std::optional<ContainerState> container_state(const json& pod, const std::string& name);
// The name of the pod's first container.
std::string first_container(const json& pod);
// Whether the pod's Ready condition is True.
bool pod_ready(const json& pod);

// "not-found" → "NotFound": an agent error kind as a condition reason.
std::string reason_of_kind(const std::string& kind);

// Reads a string member at a JSON pointer, "" when absent or not a string.
std::string str_at(const json& j, const std::string& pointer);

// An annotation of an object (kSnapshotAnnotation, ...), "" when absent or not a string.
std::string annotation(const json& object, const std::string& name);

}  // namespace gpusnap::kube
