#include "kube/controller.h"

#include <time.h>

#include <cstdio>
#include <set>

#include "common/json.h"
#include "common/utc.h"
#include "kube/objects.h"

namespace gpusnap::kube {

using nlohmann::json;
using std::chrono::milliseconds;
using std::chrono::steady_clock;

namespace {

constexpr int kStatusAttempts = 8;  // writes racing other writers, then give up and requeue

// The node's agent did not answer: a wait on a snapshot and on a restore pod alike, but one an
// operator must hear of (a Warning).
constexpr const char* kAgentUnavailable = "AgentUnavailable";

// Condition reasons of the pod's gpusnap.io/restored condition that are waits, not verdicts:
// the controller looks again when something changes.
const std::set<std::string> kRestoreWaits = {"SnapshotNotFound", "SnapshotNotReady",
                                             "WaitingForContainer", "Restoring", kAgentUnavailable};

bool terminal(const std::string& phase) {
  return phase == kPhaseSucceeded || phase == kPhaseFailed;
}

std::string ns_of(const json& o) { return str_at(o, "/metadata/namespace"); }
std::string name_of(const json& o) { return str_at(o, "/metadata/name"); }
long generation_of(const json& o) {
  return o.value("/metadata/generation"_json_pointer, json(0)).get<long>();
}

// Seconds since an RFC 3339 time the API wrote; 0 when it does not parse.
double seconds_since(const std::string& rfc3339) {
  std::tm tm{};
  if (rfc3339.empty() || ::strptime(rfc3339.c_str(), "%Y-%m-%dT%H:%M:%S", &tm) == nullptr) return 0;
  std::time_t then = ::timegm(&tm);
  return std::difftime(std::time(nullptr), then);
}

// Whether a restore pod's gpusnap.io/restored condition is a verdict: restored, or failed for
// good (a reason that is not a wait).
bool restore_decided(const json& pod) {
  auto c = find_condition(pod.value("/status/conditions"_json_pointer, json()), kRestoredCondition);
  return c && (c->value("status", "") == "True" || !kRestoreWaits.contains(c->value("reason", "")));
}

// How long an agent operation's phases took, as its messages say it: "12.3".
std::string seconds_text(const Operation& op) {
  double seconds = 0;
  for (const auto& p : op.phases) seconds += p.seconds;
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", seconds);
  return text;
}

json phases_json(const Operation& op) {
  json out = json::array();
  for (const auto& p : op.phases) out.push_back({{"name", p.name}, {"seconds", p.seconds}});
  return out;
}

// The source pod of a snapshot launched from a template: fixed, so that every node's
// controller creating it creates the same one.
std::string source_pod_name(const std::string& snapshot) { return snapshot + "-source"; }

// An API call the controller cannot do without answered with an error: the step is tried
// again later (the worker's backoff), nothing is decided about the object.
Error api_failure(const std::string& what, const Response& r, const std::string& hint) {
  std::string message = what;
  message += " answered ";
  message += std::to_string(r.status);
  message += ": ";
  message += r.message();
  return Error(ErrorKind::kEnvironment, message, hint);
}

}  // namespace

Controller::Controller(const ApiConfig& api, AgentClient& agent, ControllerOptions options)
    : api_(api), agent_(agent), options_(std::move(options)), heartbeat_(options_.alive_file) {
  InformerOptions s;
  s.path = snapshots_path(options_.namespace_);
  s.watch_timeout = options_.watch_timeout;
  s.log = [this](const std::string& l) { say(l); };
  snapshots_ = std::make_unique<Informer>(
      api, s, [this](const std::string& key) { on_snapshot_changed(key); });
  InformerOptions p = s;
  p.path = pods_path(options_.namespace_);
  p.selector = "fieldSelector=" + common::url_encode("spec.nodeName=" + options_.node);
  pods_ =
      std::make_unique<Informer>(api, p, [this](const std::string& key) { on_pod_changed(key); });
}

Controller::~Controller() { stop(); }

void Controller::say(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
    return;
  }
  std::fprintf(stderr, "%s gpusnap-controller[%s]: %s\n", utc::now().c_str(), options_.node.c_str(),
               line.c_str());
}

void Controller::start() {
  snapshots_->start();
  pods_->start();
  worker_ = std::jthread([this] { work(); });
}

void Controller::stop() noexcept {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  snapshots_->stop();
  pods_->stop();
}

void Controller::enqueue(const std::string& key, milliseconds delay) {
  auto due = steady_clock::now() + delay;
  {
    std::lock_guard lock(mu_);
    auto [it, inserted] = queue_.emplace(key, due);
    if (!inserted && due < it->second) it->second = due;
  }
  cv_.notify_all();
}

void Controller::on_snapshot_changed(const std::string& key) {
  enqueue("s:" + key);
  // Restore pods waiting for this snapshot look again.
  auto slash = key.find('/');
  std::string ns = key.substr(0, slash), name = key.substr(slash + 1);
  for (const auto& pod : pods_->items()) {
    if (ns_of(pod) == ns && annotation(pod, kSnapshotAnnotation) == name) {
      enqueue("p:" + Informer::key_of(pod));
    }
  }
}

void Controller::on_pod_changed(const std::string& key) {
  enqueue("p:" + key);
  // A snapshot whose source is this pod looks again (it may have become ready, or gone).
  auto slash = key.find('/');
  std::string ns = key.substr(0, slash), name = key.substr(slash + 1);
  for (const auto& snap : snapshots_->items()) {
    if (ns_of(snap) != ns) continue;
    const json& source = snap.value("/spec/source"_json_pointer, json::object());
    if (source.value("podName", "") == name ||
        (source.contains("template") && source_pod_name(name_of(snap)) == name)) {
      enqueue("s:" + Informer::key_of(snap));
    }
  }
}

void Controller::work() {
  // Nothing is decided before both copies are loaded: a restore pod seen before the snapshots
  // would be told its snapshot does not exist.
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
    }
    heartbeat_.beat();
    if (snapshots_->wait_synced(milliseconds(100)) && pods_->wait_synced(milliseconds(100))) break;
  }
  // Each wait is at most one poll long, so that the heartbeat says the loop turns even when
  // there is nothing to do.
  std::unique_lock lock(mu_);
  while (!stopping_) {
    heartbeat_.beat();
    if (queue_.empty()) {
      cv_.wait_for(lock, options_.poll);
      continue;
    }
    auto next = queue_.begin();
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
      if (it->second < next->second) next = it;
    }
    if (next->second > steady_clock::now()) {
      cv_.wait_until(lock, std::min(next->second, steady_clock::now() + options_.poll));
      continue;
    }
    std::string key = next->first;
    queue_.erase(next);
    lock.unlock();
    bool failed = false;
    try {
      reconcile(key);
    } catch (const std::exception& e) {
      // An API server or agent that did not answer, or a write that lost every race: look
      // again later, backing off, without deciding anything about the object.
      say("reconcile " + key + ": " + e.what() + "; trying again");
      failed = true;
    }
    lock.lock();
    if (failed) {
      int n = ++failures_[key];
      auto delay = std::min(options_.poll * (1 << std::min(n, 5)), milliseconds(30000));
      auto due = steady_clock::now() + delay;
      auto [it, inserted] = queue_.emplace(key, due);
      if (!inserted && due < it->second) it->second = due;
    } else {
      failures_.erase(key);
    }
  }
}

void Controller::reconcile(const std::string& key) {
  if (key.starts_with("s:")) reconcile_snapshot(key.substr(2));
  if (key.starts_with("p:")) reconcile_pod(key.substr(2));
}

// ---- API helpers --------------------------------------------------------------------------

std::optional<json> Controller::find_pod(const std::string& ns, const std::string& name) {
  if (auto pod = pods_->get(ns + "/" + name)) return pod;
  Response r = api_.get(pod_path(ns, name));
  if (r.status == 404) return std::nullopt;
  if (!r.ok()) {
    throw api_failure("get pod " + ns + "/" + name, r, "check the controller's RBAC rules");
  }
  return r.body;
}

void Controller::emit(const json& object, const std::string& type, const std::string& reason,
                      const std::string& message) {
  std::string now = utc::now();
  std::string ns = ns_of(object);
  json event{{"apiVersion", "v1"},
             {"kind", "Event"},
             {"metadata", {{"generateName", name_of(object) + "."}, {"namespace", ns}}},
             {"involvedObject",
              {{"apiVersion", object.value("apiVersion", "v1")},
               {"kind", object.value("kind", "Pod")},
               {"namespace", ns},
               {"name", name_of(object)},
               {"uid", str_at(object, "/metadata/uid")},
               {"resourceVersion", str_at(object, "/metadata/resourceVersion")}}},
             {"type", type},
             {"reason", reason},
             {"message", message},
             {"source", {{"component", "gpusnap-controller"}, {"host", options_.node}}},
             {"reportingComponent", "gpusnap.io/controller"},
             {"reportingInstance", options_.node},
             {"firstTimestamp", now},
             {"lastTimestamp", now},
             {"count", 1}};
  // An Event is a report, not state: one that cannot be written is logged, not retried.
  try {
    Response r = api_.create(events_path(ns), event);
    if (!r.ok()) say("event " + reason + " not recorded: " + r.message());
  } catch (const Error& e) {
    say(std::string("event ") + reason + " not recorded: " + e.what());
  }
  say(ns + "/" + name_of(object) + ": " + reason + ": " + message);
}

std::optional<json> Controller::write_status(const StatusTarget& target, json current,
                                             const std::function<bool(json&)>& mutate) {
  for (int attempt = 0; attempt < kStatusAttempts; ++attempt) {
    json next = current;
    if (!next.contains("status") || !next["status"].is_object()) next["status"] = json::object();
    if (!mutate(next)) return std::nullopt;
    Response r = api_.update(target.path + "/status", next);
    if (r.ok()) return r.body;
    if (r.status == 404) return std::nullopt;
    if (r.status != 409) throw api_failure("status update of " + target.what, r, target.rbac_hint);
    // Someone wrote first: apply the step again to what they wrote.
    Response fresh = api_.get(target.path);
    if (fresh.status == 404) return std::nullopt;
    if (fresh.ok()) current = fresh.body;
  }
  throw Error(ErrorKind::kEnvironment,
              "status update of " + target.what + " lost " + std::to_string(kStatusAttempts) +
                  " races in a row",
              "something else writes this " + target.noun + "'s status continuously");
}

std::optional<json> Controller::read_fresh(const std::string& path, const std::string& what) {
  Response fresh = api_.get(path);
  if (fresh.status == 404) return std::nullopt;
  if (!fresh.ok()) throw api_failure("get " + what, fresh, "check the controller's RBAC rules");
  return fresh.body;
}

std::optional<json> Controller::update_snapshot_status(const json& snap,
                                                       const std::function<bool(json&)>& mutate) {
  const std::string ns = ns_of(snap), name = name_of(snap);
  return write_status({snapshot_path(ns, name), "GpuSnapshot " + ns + "/" + name, "object",
                       "check the controller's RBAC rules (gpusnapshots/status: update)"},
                      snap, [&](json& o) {
                        if (!mutate(o)) return false;
                        o["status"]["observedGeneration"] = generation_of(o);
                        return true;
                      });
}

// ---- GpuSnapshot --------------------------------------------------------------------------

void Controller::fail_snapshot(const json& snap, const std::string& reason,
                               const std::string& message) {
  auto written = update_snapshot_status(snap, [&](json& o) {
    json& st = o["status"];
    if (terminal(st.value("phase", ""))) return false;  // another step already decided
    long gen = generation_of(o);
    st["phase"] = kPhaseFailed;
    st["completionTime"] = utc::now();
    json& conds = st["conditions"];
    set_condition(conds, {"Capturing", "False", reason, message}, gen);
    set_condition(conds, {"Ready", "False", reason, message}, gen);
    set_condition(conds, {"Failed", "True", reason, message}, gen);
    return true;
  });
  if (written) emit(*written, "Warning", reason, message);
}

void Controller::reconcile_snapshot(const std::string& key) {
  auto found = snapshots_->get(key);
  if (!found) return;
  json snap = *found;
  snap["apiVersion"] = kApiVersion;  // list items lack them; Events name them
  snap["kind"] = kSnapshotKind;
  const json& st = snap.value("status", json::object());
  if (terminal(st.value("phase", ""))) return;
  std::string owner = st.value("nodeName", "");
  if (!owner.empty() && owner != options_.node) return;  // that node's controller has it
  if (!str_at(st, "/operation/id").empty()) {
    follow_capture(snap);
    return;
  }

  std::string ns = ns_of(snap), name = name_of(snap);
  const json& source = snap.value("/spec/source"_json_pointer, json::object());
  bool from_template = source.contains("template");
  std::string pod_name = from_template ? source_pod_name(name) : source.value("podName", "");
  if (pod_name.empty()) {
    fail_snapshot(snap, "InvalidSpec", "spec.source names neither podName nor template");
    return;
  }
  auto pod = find_pod(ns, pod_name);
  if (!pod) {
    if (from_template) {
      create_source_pod(snap, pod_name);
    } else {
      fail_snapshot(snap, "PodNotFound",
                    "pod " + ns + "/" + pod_name +
                        " does not exist: create the pod first, or give spec.source.template");
    }
    return;
  }
  std::string pod_node = str_at(*pod, "/spec/nodeName");
  if (pod_node.empty()) {
    enqueue("s:" + key, options_.poll);  // not scheduled yet; it may land on this node
    return;
  }
  if (pod_node != options_.node) return;  // the controller of its node captures it
  capture(snap, *pod);
}

void Controller::create_source_pod(const json& snap, const std::string& pod_name) {
  std::string ns = ns_of(snap), name = name_of(snap);
  const json& tmpl = snap.at("/spec/source/template"_json_pointer);
  json pod{{"apiVersion", "v1"},
           {"kind", "Pod"},
           {"metadata", tmpl.value("metadata", json::object())},
           {"spec", tmpl.value("spec", json::object())}};
  json& md = pod["metadata"];
  md["name"] = pod_name;
  md["namespace"] = ns;
  md.erase("generateName");
  md["labels"][kSourceLabel] = name;
  md["ownerReferences"] = json::array({{{"apiVersion", kApiVersion},
                                        {"kind", kSnapshotKind},
                                        {"name", name},
                                        {"uid", str_at(snap, "/metadata/uid")},
                                        {"controller", true},
                                        {"blockOwnerDeletion", true}}});
  std::string readiness = snap.value("/spec/readiness"_json_pointer, json("PodReady"));
  if (readiness == "Handshake") {
    // The workload's handshake directory is a host directory the agent (and this controller)
    // can read: the pod writes `ready` there, the agent pauses and resumes it there.
    std::string container = snap.value("/spec/source/container"_json_pointer, json(""));
    json& containers = pod["spec"]["containers"];
    json* target = nullptr;
    for (auto& c : containers) {
      if (container.empty() || c.value("name", "") == container) {
        target = &c;
        break;
      }
    }
    if (target == nullptr) {
      fail_snapshot(snap, "InvalidSpec",
                    "spec.source.template has no container named " + container);
      return;
    }
    std::string dir = (options_.control_root / (ns + "." + pod_name)).string();
    (*target)["env"].push_back({{"name", "GPUSNAP_CONTROL_DIR"}, {"value", dir}});
    (*target)["volumeMounts"].push_back({{"name", "gpusnap-control"}, {"mountPath", dir}});
    pod["spec"]["volumes"].push_back(
        {{"name", "gpusnap-control"},
         {"hostPath", {{"path", dir}, {"type", "DirectoryOrCreate"}}}});
  }
  Response r = api_.create(pods_path(ns), pod);
  if (r.status == 409) return;  // another node's controller created it first
  if (!r.ok()) {
    fail_snapshot(
        snap, "PodCreateFailed",
        "creating pod " + ns + "/" + pod_name + " from spec.source.template: " + r.message());
    return;
  }
  auto written = update_snapshot_status(snap, [&](json& o) {
    json& st = o["status"];
    if (terminal(st.value("phase", "")) || st.contains("podName")) return false;
    st["phase"] = kPhaseLaunching;
    st["podName"] = pod_name;
    st["startTime"] = utc::now();
    set_condition(st["conditions"],
                  {"Ready", "False", "Launching", "created pod " + pod_name + "; waiting for it"},
                  generation_of(o));
    return true;
  });
  if (written) emit(*written, "Normal", "Launched", "created pod " + ns + "/" + pod_name);
  enqueue("s:" + ns + "/" + name, options_.poll);
}

void Controller::capture(const json& snap, const json& pod) {
  const std::string ns = ns_of(snap), name = name_of(snap), pod_name = name_of(pod);
  const std::string container = snap.value("/spec/source/container"_json_pointer, json(""));
  const std::string pod_phase = str_at(pod, "/status/phase");
  auto c = container_state(pod, container);
  if ((c && c->terminated) || pod_phase == "Succeeded" || pod_phase == "Failed") {
    fail_snapshot(snap, "PodNotRunning",
                  "container " + (c ? c->name : container) + " of pod " + ns + "/" + pod_name +
                      " is not running (pod phase " + pod_phase + ")");
    return;
  }
  if (first_container(pod).empty()) {
    fail_snapshot(snap, "InvalidSpec", "pod " + ns + "/" + pod_name + " has no containers");
    return;
  }
  if (!source_ready(snap, pod, c)) {
    wait_for_ready(snap, pod_name);
    return;
  }
  // Only this node's single worker starts captures of pods of this node, so nothing can come
  // between this read and the status write of start_capture but other writers' edits, which
  // the write's retry absorbs.
  auto now = read_fresh(snapshot_path(ns, name), "GpuSnapshot " + ns + "/" + name);
  if (!now || terminal(str_at(*now, "/status/phase")) ||
      !str_at(*now, "/status/operation/id").empty()) {
    return;  // gone, or already started or decided; the informer brings the news
  }
  start_capture(*now, pod_name, *c);
}

bool Controller::source_ready(const json& snap, const json& pod,
                              const std::optional<ContainerState>& c) const {
  if (!c || !c->running || c->id.empty()) return false;
  const std::string readiness = snap.value("/spec/readiness"_json_pointer, json("PodReady"));
  if (readiness == "Handshake") {
    return std::filesystem::exists(options_.control_root / (ns_of(snap) + "." + name_of(pod)) /
                                   "ready");
  }
  return readiness == "Running" || pod_ready(pod);
}

void Controller::wait_for_ready(const json& snap, const std::string& pod_name) {
  const std::string ns = ns_of(snap), name = name_of(snap);
  const std::string readiness = snap.value("/spec/readiness"_json_pointer, json("PodReady"));
  long timeout = snap.value("/spec/readyTimeoutSeconds"_json_pointer, json(600)).get<long>();
  std::string since = str_at(snap, "/status/startTime");
  if (!since.empty() && seconds_since(since) > static_cast<double>(timeout)) {
    fail_snapshot(snap, "ReadyTimeout",
                  "pod " + ns + "/" + pod_name + " was not ready (" + readiness + ") within " +
                      std::to_string(timeout) + " s (spec.readyTimeoutSeconds)");
    return;
  }
  std::string why = readiness == "Handshake"
                        ? "waiting for the workload to write `ready` in its handshake directory"
                        : "waiting for pod " + pod_name + " to be " +
                              (readiness == "Running" ? "running" : "Ready");
  auto written = update_snapshot_status(snap, [&](json& o) {
    json& st = o["status"];
    if (terminal(st.value("phase", "")) || st.value("phase", "") == kPhaseWaitingReady) {
      return false;
    }
    st["phase"] = kPhaseWaitingReady;
    st["nodeName"] = options_.node;
    st["podName"] = pod_name;
    if (!st.contains("startTime")) st["startTime"] = utc::now();
    set_condition(st["conditions"], {"Ready", "False", "WaitingForReady", why}, generation_of(o));
    return true;
  });
  if (written) emit(*written, "Normal", "WaitingForReady", why);
  enqueue("s:" + ns + "/" + name, options_.poll);
}

void Controller::start_capture(const json& snap, const std::string& pod_name,
                               const ContainerState& c) {
  const std::string ns = ns_of(snap), name = name_of(snap);
  const std::string artifact = artifact_name(ns, name);
  CheckpointCall call;
  call.artifact = artifact;
  call.container = {c.id, options_.runtime_root};
  call.leave_running = snap.value("/spec/leaveRunning"_json_pointer, json(true)).get<bool>();
  call.handshake_timeout_s =
      snap.value("/spec/handshakeTimeoutSeconds"_json_pointer, json(0)).get<int>();
  Operation op;
  try {
    op = agent_.start_checkpoint(call);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kEnvironment) {
      // The agent is away (not running, its socket not mounted): a wait, not a verdict. The
      // snapshot says so, and the worker's backoff tries again until the agent answers.
      wait_for_agent(snap, pod_name, e);
      throw;
    }
    fail_snapshot(snap, reason_of_kind(Error::kind_name(e.kind())), e.what());
    return;
  }
  std::string message = "capturing container " + c.name + " of pod " + pod_name +
                        " into artifact " + artifact + " (agent operation " + op.id + ")";
  auto written = update_snapshot_status(snap, [&](json& o) {
    json& st = o["status"];
    if (terminal(st.value("phase", ""))) return false;
    long gen = generation_of(o);
    st["phase"] = kPhaseCapturing;
    st["nodeName"] = options_.node;
    st["podName"] = pod_name;
    st["containerID"] = c.id;
    st["artifact"] = artifact;
    st["operation"] = {{"id", op.id}};
    if (!st.contains("startTime")) st["startTime"] = utc::now();
    set_condition(st["conditions"], {"Capturing", "True", "CheckpointStarted", message}, gen);
    set_condition(st["conditions"], {"Ready", "False", "Capturing", message}, gen);
    return true;
  });
  if (written) emit(*written, "Normal", "CaptureStarted", message);
  enqueue("s:" + ns + "/" + name, options_.poll);
}

void Controller::wait_for_agent(const json& snap, const std::string& pod_name, const Error& e) {
  const std::string message = e.one_line();
  bool announce = false;
  auto written = update_snapshot_status(snap, [&](json& o) {
    json& st = o["status"];
    if (terminal(st.value("phase", "")) || !str_at(st, "/operation/id").empty()) return false;
    auto ready = find_condition(st.value("conditions", json()), "Ready");
    announce = !ready || ready->value("reason", "") != kAgentUnavailable;
    bool changed = st.value("phase", "") != kPhasePending;
    st["phase"] = kPhasePending;
    st["nodeName"] = options_.node;
    st["podName"] = pod_name;
    changed |= set_condition(st["conditions"], {"Ready", "False", kAgentUnavailable, message},
                             generation_of(o));
    return changed;
  });
  // One Event when the agent goes missing, not one per retry.
  if (written && announce) emit(*written, "Warning", kAgentUnavailable, message);
}

void Controller::follow_capture(const json& snap) {
  std::string ns = ns_of(snap), name = name_of(snap);
  const json& st = snap.at("status");
  std::string id = str_at(st, "/operation/id");
  std::string artifact = st.value("artifact", "");
  auto op = agent_.operation(id);
  if (!op) {
    // The agent forgot the operation: it restarted. The engine makes an artifact appear only
    // complete, so the artifact's presence alone says whether the capture finished.
    if (auto inspect = agent_.snapshot(artifact)) {
      Operation done;
      done.id = id;
      done.state = "succeeded";
      // The agent's inspect document is the manifest with its size as total_bytes.
      done.result = {{"bytes", inspect->value("total_bytes", json(nullptr))}};
      op = done;
    } else {
      fail_snapshot(snap, "OperationLost",
                    "the gpusnap agent on node " + options_.node + " no longer knows operation " +
                        id + " (it restarted during the capture) and artifact " + artifact +
                        " was not written; the source pod was left running; delete and "
                        "re-create the GpuSnapshot to capture again");
      return;
    }
  }
  std::string key = ns + "/" + name;
  if (!op->finished()) {
    json phases = phases_json(*op);
    update_snapshot_status(snap, [&](json& o) {
      json& s = o["status"];
      if (terminal(s.value("phase", "")) || s.value("phases", json()) == phases) return false;
      s["phases"] = phases;
      return true;
    });
    enqueue("s:" + key, options_.poll);
    return;
  }
  if (op->state == "failed") {
    OperationError e = op->error.value_or(OperationError{"internal", 1, "no error reported"});
    update_snapshot_status(snap, [&](json& o) {
      o["status"]["phases"] = phases_json(*op);
      return true;
    });
    fail_snapshot(snap, reason_of_kind(e.kind), e.message);
    return;
  }
  json bytes = op->result.is_object() ? op->result.value("bytes", json(nullptr)) : json(nullptr);
  // An agent with registry storage pushed the artifact: where any node's agent pulls it from.
  const std::string reference = str_at(op->result, "/reference");
  std::string message = "artifact " + artifact + " on node " + options_.node +
                        (bytes.is_number() ? " (" + std::to_string(bytes.get<uint64_t>()) +
                                                 " bytes, " + seconds_text(*op) + " s)"
                                           : "") +
                        (reference.empty() ? "" : ", pushed as " + reference);
  auto written = update_snapshot_status(snap, [&](json& o) {
    json& s = o["status"];
    if (terminal(s.value("phase", ""))) return false;
    long gen = generation_of(o);
    s["phase"] = kPhaseSucceeded;
    s["completionTime"] = utc::now();
    if (bytes.is_number()) s["sizeBytes"] = bytes;
    if (!reference.empty()) s["reference"] = reference;
    if (!op->phases.empty()) s["phases"] = phases_json(*op);
    set_condition(s["conditions"], {"Capturing", "False", "Captured", message}, gen);
    set_condition(s["conditions"], {"Ready", "True", "ArtifactReady", message}, gen);
    return true;
  });
  if (!written) return;
  emit(*written, "Normal", "Captured", message);
  bool from_template = snap.contains("/spec/source/template"_json_pointer);
  bool keep = snap.value("/spec/source/keepPod"_json_pointer, json(false)).get<bool>();
  if (from_template && !keep) {
    std::string pod_name = st.value("podName", source_pod_name(name));
    Response r = api_.remove(pod_path(ns, pod_name));
    if (r.ok() || r.status == 404) {
      emit(*written, "Normal", "SourceDeleted", "deleted source pod " + ns + "/" + pod_name);
    } else {
      emit(*written, "Warning", "SourceDeleteFailed",
           "could not delete source pod " + ns + "/" + pod_name + ": " + r.message());
    }
  }
}

// ---- restore pods -------------------------------------------------------------------------

// The agent answered a restore pod's request with an error: the pod's condition says why. An
// agent that cannot be reached is a reason to try again later: rethrown for the retry.
void Controller::restore_refused(const json& pod, const Error& e) {
  if (e.kind() == ErrorKind::kEnvironment) {
    set_restored(pod, "False", kAgentUnavailable, e.one_line());
    throw e;
  }
  set_restored(pod, "False", reason_of_kind(Error::kind_name(e.kind())), e.what());
}

void Controller::set_restored(const json& pod, const std::string& status, const std::string& reason,
                              const std::string& message) {
  const std::string ns = ns_of(pod), name = name_of(pod);
  std::string previous_reason;
  auto written =
      write_status({pod_path(ns, name), "pod " + ns + "/" + name, "pod",
                    "check the controller's RBAC rules (pods/status: update)"},
                   pod, [&](json& next) {
                     json& conds = next["status"]["conditions"];
                     auto before = find_condition(conds, kRestoredCondition);
                     if (before && before->value("status", "") == "True")
                       return false;  // never undone
                     if (before && !kRestoreWaits.contains(before->value("reason", ""))) {
                       return false;  // verdict given
                     }
                     previous_reason = before ? before->value("reason", "") : "";
                     return set_condition(conds, {kRestoredCondition, status, reason, message});
                   });
  if (!written || reason == previous_reason) return;
  json o = *written;
  o["apiVersion"] = "v1";
  o["kind"] = "Pod";
  bool normal = status == "True" || (kRestoreWaits.contains(reason) && reason != kAgentUnavailable);
  emit(o, normal ? "Normal" : "Warning", reason, message);
}

void Controller::reconcile_pod(const std::string& key) {
  auto found = pods_->get(key);
  if (!found) return;
  const json& pod = *found;
  const std::string snap_name = annotation(pod, kSnapshotAnnotation);
  if (snap_name.empty()) return;
  if (str_at(pod, "/spec/nodeName") != options_.node) return;
  if (restore_decided(pod)) return;  // restored, or failed for good: a new pod must try again
  if (auto op_id = annotation(pod, kRestoreOperationAnnotation); !op_id.empty()) {
    follow_restore(pod, op_id);
    return;
  }
  auto st = ready_snapshot_status(pod, snap_name);
  if (!st) return;
  auto c = running_placeholder(pod);
  if (!c) return;
  auto artifact = stored_artifact(pod, snap_name, *st);
  if (!artifact) return;
  // As for captures: the object itself, not the informer's copy, says whether a restore was
  // already started into this container.
  auto fresh = read_fresh(pod_path(ns_of(pod), name_of(pod)), "pod " + key);
  if (!fresh || !annotation(*fresh, kRestoreOperationAnnotation).empty() ||
      restore_decided(*fresh)) {
    return;
  }
  start_restore(pod, snap_name, *artifact, str_at(*st, "/reference"), *c);
}

std::optional<json> Controller::ready_snapshot_status(const json& pod,
                                                      const std::string& snap_name) {
  const std::string ns = ns_of(pod);
  const std::string snap_ref = "GpuSnapshot " + ns + "/" + snap_name;
  auto snap = snapshots_->get(ns + "/" + snap_name);
  if (!snap) {
    set_restored(pod, "False", "SnapshotNotFound", snap_ref + " does not exist (yet)");
    return std::nullopt;  // the snapshot's appearance brings this pod back
  }
  json st = snap->value("status", json::object());
  std::string phase = st.value("phase", "");
  if (phase == kPhaseFailed) {
    auto ready = find_condition(st.value("conditions", json()), "Ready");
    set_restored(pod, "False", "SnapshotFailed",
                 snap_ref + " failed: " + (ready ? ready->value("message", "") : ""));
    return std::nullopt;
  }
  if (phase != kPhaseSucceeded) {
    set_restored(pod, "False", "SnapshotNotReady",
                 snap_ref + " is not ready yet (phase " + (phase.empty() ? "none" : phase) + ")");
    return std::nullopt;
  }
  return st;
}

std::optional<ContainerState> Controller::running_placeholder(const json& pod) {
  const std::string container = annotation(pod, kContainerAnnotation);
  auto c = container_state(pod, container);
  if (c && c->terminated) {
    set_restored(pod, "False", "ContainerNotRunning",
                 "container " + c->name +
                     " ended before the restore; it must run `gpusnap init "
                     "--placeholder`");
    return std::nullopt;
  }
  if (!c || !c->running || c->id.empty()) {
    set_restored(pod, "False", "WaitingForContainer",
                 "waiting for the placeholder container " +
                     (container.empty() ? first_container(pod) : container) + " to run");
    return std::nullopt;
  }
  return c;
}

std::optional<std::string> Controller::stored_artifact(const json& pod,
                                                       const std::string& snap_name,
                                                       const json& snap_status) {
  const std::string ns = ns_of(pod);
  const std::string snap_ref = "GpuSnapshot " + ns + "/" + snap_name;
  std::string artifact = snap_status.value("artifact", artifact_name(ns, snap_name));
  std::string owner = snap_status.value("nodeName", "");
  std::optional<json> inspect;
  try {
    inspect = agent_.snapshot(artifact);
  } catch (const Error& e) {
    restore_refused(pod, e);
    return std::nullopt;
  }
  // Held here, or in the registry the capturing agent pushed it to: this node's agent pulls it.
  if (inspect || !str_at(snap_status, "/reference").empty()) return artifact;
  if (!owner.empty() && owner != options_.node) {
    set_restored(pod, "False", "SnapshotOnAnotherNode",
                 snap_ref + " is stored on node " + owner + "'s local storage, which node " +
                     options_.node + " cannot read: schedule the pod on " + owner +
                     " (nodeSelector kubernetes.io/hostname) or keep artifacts on shared "
                     "storage (chart value storage.type=pvc)");
  } else {
    set_restored(pod, "False", "ArtifactMissing",
                 "artifact " + artifact + " of " + snap_ref +
                     " is not in the gpusnap agent's storage on node " + options_.node);
  }
  return std::nullopt;
}

void Controller::start_restore(const json& pod, const std::string& snap_name,
                               const std::string& artifact, const std::string& reference,
                               const ContainerState& c) {
  const std::string ns = ns_of(pod), pod_name = name_of(pod);
  RestoreCall call;
  call.artifact = artifact;
  call.reference = reference;
  call.into_container = {c.id, options_.runtime_root};
  std::string settings = annotation(pod, kSettingsAnnotation);
  if (!settings.empty()) {
    // A pod's annotation is anyone's text: parsed bounded in depth (common/json.h), since a
    // value that is not a string is written out again below.
    const json s = json_text::parse(settings).value_or(json());
    if (!s.is_object()) {
      set_restored(
          pod, "False", "InvalidSettings",
          std::string("annotation ") + kSettingsAnnotation + " must be a JSON object of strings");
      return;
    }
    for (const auto& [k, v] : s.items())
      call.settings[k] = v.is_string() ? v.get<std::string>() : v.dump();
  }
  Operation op;
  try {
    op = agent_.start_restore(call);
  } catch (const Error& e) {
    restore_refused(pod, e);
    return;
  }
  // The operation's id goes on the pod before anything else, so that no later pass (of this
  // controller or a restarted one) starts a second restore into the same container.
  json patch{{"metadata", {{"annotations", {{kRestoreOperationAnnotation, op.id}}}}}};
  Response r = api_.merge_patch(pod_path(ns, pod_name), patch);
  if (!r.ok()) {
    throw api_failure("annotating pod " + ns + "/" + pod_name, r,
                      "check the controller's RBAC rules (pods: patch)");
  }
  json annotated = r.body;
  set_restored(annotated, "False", "Restoring",
               "restoring GpuSnapshot " + ns + "/" + snap_name + " (artifact " + artifact +
                   (reference.empty() ? "" : ", " + reference) + ") into container " + c.name +
                   " (agent operation " + op.id + ")");
  enqueue("p:" + ns + "/" + pod_name, options_.poll);
}

void Controller::follow_restore(const json& pod, const std::string& id) {
  std::string key = ns_of(pod) + "/" + name_of(pod);
  std::string snap_name = annotation(pod, kSnapshotAnnotation);
  auto op = agent_.operation(id);
  if (!op) {
    set_restored(pod, "False", "OperationLost",
                 "the gpusnap agent on node " + options_.node + " no longer knows restore " +
                     "operation " + id +
                     " (it restarted during the restore); delete the pod to start a new one");
    return;
  }
  if (!op->finished()) {
    enqueue("p:" + key, options_.poll);
    return;
  }
  if (op->state == "failed") {
    OperationError e = op->error.value_or(OperationError{"internal", 1, "no error reported"});
    set_restored(pod, "False", reason_of_kind(e.kind), e.message);
    return;
  }
  // The agent pulled the snapshot from the registry first (its phases are in the time).
  const json::json_pointer was_pulled("/pulled/pulled");
  const bool pulled = op->result.contains(was_pulled) && op->result.at(was_pulled) == json(true);
  set_restored(
      pod, "True", "Restored",
      "restored from GpuSnapshot " + snap_name + " in " + seconds_text(*op) + " s" +
          (pulled ? " (pulled from " + str_at(op->result, "/pulled/reference") + ")" : ""));
}

}  // namespace gpusnap::kube
