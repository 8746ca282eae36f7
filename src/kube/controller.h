// The gpusnap controller: turns GpuSnapshot objects and annotated pods into agent operations
// on one node, and reports back through status, conditions and Events.
//
// It is node-local (docs/kubernetes.md): one runs beside each node's agent and acts
// only on what runs on its node. It watches
//   - every GpuSnapshot (of one namespace, or all), and
//   - the pods bound to its node (fieldSelector spec.nodeName=NODE),
// and reconciles, one key at a time on one worker thread:
//   - a GpuSnapshot whose source pod runs here: wait for the pod to be ready, ask the agent to
//     checkpoint its container, follow the operation, write the result into status;
//   - a GpuSnapshot with a pod template: create the source pod (any node's controller may;
//     the fixed pod name makes the create idempotent), then capture it like the above where
//     the scheduler put it, and delete it after a successful capture unless told to keep it;
//   - a pod of this node annotated gpusnap.io/snapshot: once its placeholder container runs
//     and the snapshot is ready, ask the agent to restore into that container, then set the
//     pod's gpusnap.io/restored condition (its readiness gate).
// Reconciling is level-based: every step reads the current objects, writes what it decided
// into the API (the agent operation's id included) and is requeued to look again, so a
// restarted controller picks up where the last one stopped and never starts an operation
// twice. Status writes carry the object's resourceVersion; a 409 Conflict means someone wrote
// first, and the step is re-applied to the newest object (or dropped if that one already says
// what the step wanted to say), so each transition is written and announced once.
#pragma once

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "kube/agent_client.h"
#include "kube/api_client.h"
#include "kube/heartbeat.h"
#include "kube/informer.h"
#include "kube/objects.h"

namespace gpusnap::kube {

struct ControllerOptions {
  std::string node;  // this node's name, as in the pods' spec.nodeName
  // runc's state directory of the node's container runtime (containerd's
  // /run/containerd/runc/k8s.io, CRI-O's /run/runc); empty: the agent finds it by the ID.
  std::string runtime_root;
  // The host directory under which each launched pod's handshake directory lives
  // (CONTROL_ROOT/NAMESPACE.POD), shared by hostPath with the pod and the agent. The pod sees
  // it at the same path, so that the GPUSNAP_CONTROL_DIR the agent reads in the workload's
  // environment names the same directory in the agent's own mount namespace.
  std::filesystem::path control_root = "/run/gpusnap/control";
  std::string namespace_;                // watch one namespace; empty: all
  std::chrono::milliseconds poll{2000};  // how often a running operation is looked at
  std::chrono::seconds watch_timeout{300};
  // Touched on every turn of the worker loop, which turns at least once per `poll` (a liveness
  // probe reads its age: kube/heartbeat.h); empty: none.
  std::filesystem::path alive_file;
  std::function<void(const std::string&)> log;  // one-line diagnostics; default: stderr
};

// Thread-safe start/stop. The agent client must outlive the controller.
class Controller {
 public:
  Controller(const ApiConfig& api, AgentClient& agent, ControllerOptions options);
  ~Controller();
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  // Starts the watches and the worker. Returns at once.
  void start();
  // Stops the watches and the worker and joins them; an agent operation in flight is left to
  // the agent (the next controller follows it through the id written in the API). Never throws.
  void stop() noexcept;

  const Informer& snapshots() const { return *snapshots_; }
  const Informer& pods() const { return *pods_; }

 private:
  void enqueue(const std::string& key, std::chrono::milliseconds delay = {});
  void on_snapshot_changed(const std::string& key);
  void on_pod_changed(const std::string& key);
  void work();
  void reconcile(const std::string& key);

  // GpuSnapshot steps.
  void reconcile_snapshot(const std::string& key);
  // The capture of a snapshot's source pod, in steps: refused when the pod cannot be
  // captured, waited for until it is ready, started once (read fresh) through the agent.
  void capture(const nlohmann::json& snap, const nlohmann::json& pod);
  bool source_ready(const nlohmann::json& snap, const nlohmann::json& pod,
                    const std::optional<ContainerState>& c) const;
  void wait_for_ready(const nlohmann::json& snap, const std::string& pod_name);
  void start_capture(const nlohmann::json& snap, const std::string& pod_name,
                     const ContainerState& c);
  void follow_capture(const nlohmann::json& snap);
  void create_source_pod(const nlohmann::json& snap, const std::string& pod_name);
  void fail_snapshot(const nlohmann::json& snap, const std::string& reason,
                     const std::string& message);
  // The agent did not answer a capture's start: status says so (phase Pending, Ready False
  // with reason AgentUnavailable) and one Warning Event announces it.
  void wait_for_agent(const nlohmann::json& snap, const std::string& pod_name, const Error& e);
  // A GpuSnapshot's status write (write_status), with its observedGeneration.
  std::optional<nlohmann::json> update_snapshot_status(
      const nlohmann::json& snap, const std::function<bool(nlohmann::json&)>& mutate);

  // An object whose status the controller writes, as its errors name it.
  struct StatusTarget {
    std::string path;       // the object's API path
    std::string what;       // "GpuSnapshot NS/NAME", "pod NS/NAME"
    std::string noun;       // "object", "pod"
    std::string rbac_hint;  // the rule a 403 points at
  };
  // Writes status through the status subresource: mutate(object) edits the newest object and
  // returns false when there is nothing to write. Retries on 409 Conflict with a fresh read of
  // the object. Returns the written object, or nullopt when mutate declined or the object is
  // gone. Throws Error(kEnvironment) on another API failure or after kStatusAttempts races.
  std::optional<nlohmann::json> write_status(const StatusTarget& target, nlohmann::json current,
                                             const std::function<bool(nlohmann::json&)>& mutate);
  // The object itself, read from the API rather than the informer's copy, which may lag
  // behind this controller's own last write: for a check before an action that must not
  // happen twice. nullopt when it is gone; throws Error(kEnvironment) on another failure.
  std::optional<nlohmann::json> read_fresh(const std::string& path, const std::string& what);

  // Restore steps, for pods of this node.
  // A restore pod, in steps: its snapshot must have succeeded, its placeholder run and the
  // agent hold the artifact (or the snapshot have a registry reference); each step that says no
  // sets the pod's condition (nullopt). The restore starts once (read fresh) through the agent.
  void reconcile_pod(const std::string& key);
  std::optional<nlohmann::json> ready_snapshot_status(const nlohmann::json& pod,
                                                      const std::string& snap_name);
  std::optional<ContainerState> running_placeholder(const nlohmann::json& pod);
  std::optional<std::string> stored_artifact(const nlohmann::json& pod,
                                             const std::string& snap_name,
                                             const nlohmann::json& snap_status);
  // `reference`: the snapshot's status.reference, where the agent pulls it from when it does
  // not hold the artifact (empty: it must).
  void start_restore(const nlohmann::json& pod, const std::string& snap_name,
                     const std::string& artifact, const std::string& reference,
                     const ContainerState& c);
  void follow_restore(const nlohmann::json& pod, const std::string& id);
  // Sets the pod's gpusnap.io/restored condition; emits an Event when its reason changes.
  void restore_refused(const nlohmann::json& pod, const Error& e);
  void set_restored(const nlohmann::json& pod, const std::string& status, const std::string& reason,
                    const std::string& message);

  std::optional<nlohmann::json> find_pod(const std::string& ns, const std::string& name);
  void emit(const nlohmann::json& object, const std::string& type, const std::string& reason,
            const std::string& message);
  void say(const std::string& line) const;

  ApiClient api_;
  AgentClient& agent_;
  ControllerOptions options_;
  std::unique_ptr<Informer> snapshots_;
  std::unique_ptr<Informer> pods_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::chrono::steady_clock::time_point> queue_;  // key → when due
  std::map<std::string, int> failures_;  // consecutive errors per key, for the backoff
  bool stopping_ = false;
  Heartbeat heartbeat_;
  std::jthread worker_;
};

}  // namespace gpusnap::kube
