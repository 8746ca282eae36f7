// The controller against the local fake API server and a fake agent on a Unix socket. The test
// plays the other parts of a cluster: a user creating objects, the scheduler binding pods, the
// kubelet reporting containers as running and ready.
#include "kube/controller.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "common/subprocess.h"
#include "kube/fake_agent.h"
#include "kube/fake_apiserver.h"
#include "kube/objects.h"
#include "testing/unit.h"

namespace gpusnap::kube {
namespace {

using namespace std::chrono_literals;
using testing::FakeAgent;
using testing::FakeApiServer;
using testing::TempDir;

constexpr const char* kNode = "node-a";
constexpr const char* kRuntimeRoot = "/run/containerd/runc/k8s.io";

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = 15s) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

class ControllerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_ / "token") << server_.token() << "\n";
    std::filesystem::create_directories(dir_ / "control");
  }
  void TearDown() override { stop(); }

  ApiConfig api() {
    ApiConfig c;
    c.server = server_.url();
    c.token_file = dir_ / "token";
    return c;
  }

  Controller& start(const std::string& node = kNode) {
    ControllerOptions o;
    o.node = node;
    o.runtime_root = kRuntimeRoot;
    o.control_root = dir_ / "control";
    o.poll = 30ms;
    o.watch_timeout = 30s;
    o.alive_file = alive_file_;
    o.log = [](const std::string& line) {
      std::fprintf(stderr, "  controller: %s\n", line.c_str());
    };
    controller_ = std::make_unique<Controller>(api(), client_, o);
    controller_->start();
    EXPECT_TRUE(controller_->snapshots().wait_synced(5s));
    EXPECT_TRUE(controller_->pods().wait_synced(5s));
    return *controller_;
  }
  void stop() {
    if (controller_) controller_->stop();
    controller_.reset();
  }

  // A pod as the scheduler and kubelet leave it: bound, its container running, Ready.
  // A pod as the scheduler and kubelet leave it: bound, its container running, Ready.
  json running_pod(const std::string& name, const std::string& node, const std::string& id,
                   json annotations = json::object()) {
    return server_.create(
        "pods", "default",
        {{"metadata", {{"name", name}, {"annotations", annotations}}},
         {"spec", {{"nodeName", node}, {"containers", {{{"name", "main"}, {"image", "img"}}}}}},
         {"status", kubelet_status(id, true)}});
  }
  static json kubelet_status(const std::string& id, bool ready) {
    return {{"phase", "Running"},
            {"conditions", {{{"type", "Ready"}, {"status", ready ? "True" : "False"}}}},
            {"containerStatuses",
             {{{"name", "main"},
               {"containerID", "containerd://" + id},
               {"state", {{"running", {{"startedAt", "2026-01-01T00:00:00Z"}}}}}}}}};
  }
  json kubelet_runs(const std::string& name, const std::string& id, bool ready) {
    return server_.update("pods", "default", name,
                          [&](json& p) { p["status"] = kubelet_status(id, ready); });
  }
  json snapshot(const std::string& name, json spec) {
    return server_.create("gpusnapshots", "default",
                          {{"metadata", {{"name", name}}}, {"spec", std::move(spec)}});
  }
  // A snapshot as a finished capture on `node` left it.
  void captured_snapshot(const std::string& name, const std::string& node) {
    snapshot(name, {{"source", {{"podName", "gone"}}}});
    server_.update("gpusnapshots", "default", name, [&](json& s) {
      s["status"] = {{"phase", "Succeeded"},
                     {"nodeName", node},
                     {"artifact", "default." + name},
                     {"conditions", {{{"type", "Ready"}, {"status", "True"}}}}};
    });
  }
  json snap_status(const std::string& name) {
    auto s = server_.get("gpusnapshots", "default", name);
    return s ? s->value("status", json::object()) : json::object();
  }
  std::string phase(const std::string& name) { return snap_status(name).value("phase", ""); }
  json condition(const json& conditions, const std::string& type) {
    return find_condition(conditions, type).value_or(json::object());
  }
  json restored(const std::string& pod) {
    auto p = server_.get("pods", "default", pod);
    if (!p) return json::object();
    return condition(p->value("/status/conditions"_json_pointer, json::array()),
                     kRestoredCondition);
  }
  // The Events about one object: "Type Reason: message", in order.
  std::vector<std::string> events(const std::string& kind, const std::string& name) {
    return server_.events_about(kind, name);
  }

  // The Events about one object once there are at least n (an Event follows the status write
  // it announces).
  std::vector<std::string> events(const std::string& kind, const std::string& name, size_t n) {
    eventually([&] { return events(kind, name).size() >= n; });
    return events(kind, name);
  }

  TempDir dir_;
  FakeApiServer server_;
  std::filesystem::path alive_file_;  // ControllerOptions::alive_file
  FakeAgent agent_{dir_ / "agent.sock"};
  HttpAgentClient client_{AgentEndpoint{dir_ / "agent.sock", "", "", 10s}};
  std::unique_ptr<Controller> controller_;
};

TEST_F(ControllerTest, CapturesARunningPod) {
  running_pod("web", kNode, "c0ffee");
  start();
  snapshot("web-snap", {{"source", {{"podName", "web"}}}});
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Succeeded"; }))
      << snap_status("web-snap");

  auto posts = agent_.posts("/v1/checkpoints");
  ASSERT_EQ(posts.size(), 1U);
  EXPECT_EQ(posts[0], (json{{"artifact", "default.web-snap"},
                            {"container", {{"id", "c0ffee"}, {"runtime_root", kRuntimeRoot}}},
                            {"leave_running", true}}));
  json st = snap_status("web-snap");
  EXPECT_EQ(st["nodeName"], kNode);
  EXPECT_EQ(st["podName"], "web");
  EXPECT_EQ(st["containerID"], "c0ffee");
  EXPECT_EQ(st["artifact"], "default.web-snap");
  EXPECT_EQ(st["sizeBytes"], 123456789);
  EXPECT_EQ(st["observedGeneration"], 1);
  EXPECT_EQ(st["phases"], (json::array({{{"name", "resolve"}, {"seconds", 0.25}},
                                        {{"name", "dump"}, {"seconds", 1.5}}})));
  EXPECT_TRUE(st.contains("startTime"));
  EXPECT_TRUE(st.contains("completionTime"));
  std::string message = "artifact default.web-snap on node node-a (123456789 bytes, 1.8 s)";
  json ready = condition(st["conditions"], "Ready");
  EXPECT_EQ(ready["status"], "True");
  EXPECT_EQ(ready["reason"], "ArtifactReady");
  EXPECT_EQ(ready["message"], message);
  EXPECT_EQ(ready["observedGeneration"], 1);
  EXPECT_TRUE(ready.contains("lastTransitionTime"));
  json capturing = condition(st["conditions"], "Capturing");
  EXPECT_EQ(capturing["status"], "False");
  EXPECT_EQ(capturing["reason"], "Captured");
  EXPECT_FALSE(find_condition(st["conditions"], "Failed").has_value());
  EXPECT_EQ(events("GpuSnapshot", "web-snap", 2),
            (std::vector<std::string>{
                "Normal CaptureStarted: capturing container main of pod web into artifact "
                "default.web-snap (agent operation op-1)",
                "Normal Captured: " + message}));
  EXPECT_TRUE(server_.get("pods", "default", "web").has_value());  // not launched: kept
}

// The liveness probe's evidence (kube/heartbeat.h): with nothing to do, the worker loop still
// turns once per poll and stamps its alive file; a stopped controller's file goes stale.
TEST_F(ControllerTest, IdleWorkerLoopStampsItsAliveFileEachPoll) {
  alive_file_ = dir_ / "alive";
  start();
  ASSERT_TRUE(eventually([&] { return std::filesystem::exists(alive_file_); }));
  const auto first = std::filesystem::last_write_time(alive_file_);
  EXPECT_TRUE(
      eventually([&] { return std::filesystem::last_write_time(alive_file_) > first; }, 2s));
  stop();
  const auto stopped = std::filesystem::last_write_time(alive_file_);
  std::this_thread::sleep_for(200ms);  // several polls of 30 ms
  EXPECT_EQ(std::filesystem::last_write_time(alive_file_), stopped);
}

TEST_F(ControllerTest, PodOfAnotherNodeIsLeftToThatNode) {
  running_pod("web", "node-b", "c0ffee");
  start();
  snapshot("web-snap", {{"source", {{"podName", "web"}}}});
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(phase("web-snap"), "");
  EXPECT_TRUE(agent_.posts("/v1/checkpoints").empty());
  EXPECT_TRUE(events("GpuSnapshot", "web-snap").empty());
}

TEST_F(ControllerTest, LaunchesATemplateWaitsForReadyThenCapturesAndDeletesIt) {
  start();
  snapshot("llm", {{"source",
                    {{"template",
                      {{"metadata", {{"labels", {{"app", "llm"}}}}},
                       {"spec", {{"containers", {{{"name", "main"}, {"image", "server"}}}}}}}}}}});
  ASSERT_TRUE(eventually([&] { return server_.get("pods", "default", "llm-source").has_value(); }));
  json pod = *server_.get("pods", "default", "llm-source");
  EXPECT_EQ(pod["metadata"]["labels"],
            (json{{"app", "llm"}, {"gpusnap.io/snapshot-source", "llm"}}));
  json owner = pod["metadata"]["ownerReferences"][0];
  EXPECT_EQ(owner["kind"], "GpuSnapshot");
  EXPECT_EQ(owner["name"], "llm");
  EXPECT_EQ(owner["uid"], server_.get("gpusnapshots", "default", "llm")->at("metadata").at("uid"));
  EXPECT_EQ(owner["controller"], true);
  ASSERT_TRUE(eventually([&] { return phase("llm") == "Launching"; }));

  // The scheduler binds it here; the kubelet starts it, not ready yet.
  server_.update("pods", "default", "llm-source", [](json& p) { p["spec"]["nodeName"] = kNode; });
  kubelet_runs("llm-source", "beef", false);
  ASSERT_TRUE(eventually([&] { return phase("llm") == "WaitingForReady"; }));
  std::this_thread::sleep_for(200ms);
  EXPECT_TRUE(agent_.posts("/v1/checkpoints").empty());

  kubelet_runs("llm-source", "beef", true);
  ASSERT_TRUE(eventually([&] { return phase("llm") == "Succeeded"; })) << snap_status("llm");
  ASSERT_EQ(agent_.posts("/v1/checkpoints").size(), 1U);
  EXPECT_EQ(agent_.posts("/v1/checkpoints")[0]["container"]["id"], "beef");
  ASSERT_TRUE(eventually([&] { return !server_.get("pods", "default", "llm-source"); }));
  auto ev = events("GpuSnapshot", "llm", 5);
  ASSERT_EQ(ev.size(), 5U) << ::testing::PrintToString(ev);
  EXPECT_EQ(ev[0], "Normal Launched: created pod default/llm-source");
  EXPECT_EQ(ev[1], "Normal WaitingForReady: waiting for pod llm-source to be Ready");
  EXPECT_EQ(ev[4], "Normal SourceDeleted: deleted source pod default/llm-source");
}

// Readiness by the handshake: the launched pod gets the handshake directory (a host directory
// this node's agent reads) and the capture waits for the workload's `ready` in it.
TEST_F(ControllerTest, HandshakeReadinessWaitsForTheWorkloadsReadyFile) {
  start();
  snapshot("hs",
           {{"readiness", "Handshake"},
            {"source",
             {{"keepPod", true},
              {"template", {{"spec", {{"containers", {{{"name", "main"}, {"image", "s"}}}}}}}}}}});
  ASSERT_TRUE(eventually([&] { return server_.get("pods", "default", "hs-source").has_value(); }));
  json spec = server_.get("pods", "default", "hs-source")->at("spec");
  std::string host_dir = (dir_ / "control" / "default.hs-source").string();
  EXPECT_EQ(spec["containers"][0]["env"],
            (json::array({{{"name", "GPUSNAP_CONTROL_DIR"}, {"value", host_dir}}})));
  EXPECT_EQ(spec["containers"][0]["volumeMounts"],
            (json::array({{{"name", "gpusnap-control"}, {"mountPath", host_dir}}})));
  EXPECT_EQ(spec["volumes"],
            (json::array({{{"name", "gpusnap-control"},
                           {"hostPath", {{"path", host_dir}, {"type", "DirectoryOrCreate"}}}}})));
  server_.update("pods", "default", "hs-source", [](json& p) { p["spec"]["nodeName"] = kNode; });
  kubelet_runs("hs-source", "f00d", true);  // Ready, but the workload has not said READY
  ASSERT_TRUE(eventually([&] { return phase("hs") == "WaitingForReady"; }));
  std::this_thread::sleep_for(200ms);
  EXPECT_TRUE(agent_.posts("/v1/checkpoints").empty());

  std::filesystem::create_directories(host_dir);
  std::ofstream(host_dir + "/ready") << R"({"protocol":1,"pid":7})"
                                     << "\n";
  ASSERT_TRUE(eventually([&] { return phase("hs") == "Succeeded"; })) << snap_status("hs");
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(server_.get("pods", "default", "hs-source").has_value());  // keepPod
}

TEST_F(ControllerTest, RestorePodGetsItsConditionOnce) {
  captured_snapshot("llm", kNode);
  agent_.add_artifact("default.llm");
  start();
  running_pod("replica-1", kNode, "ph1",
              {{"gpusnap.io/snapshot", "llm"}, {"gpusnap.io/settings", R"({"role":"replica"})"}});
  running_pod("elsewhere", "node-b", "ph2", {{"gpusnap.io/snapshot", "llm"}});
  ASSERT_TRUE(eventually([&] { return restored("replica-1").value("status", "") == "True"; }))
      << restored("replica-1");
  json c = restored("replica-1");
  EXPECT_EQ(c["reason"], "Restored");
  EXPECT_EQ(c["message"], "restored from GpuSnapshot llm in 1.8 s");
  auto posts = agent_.posts("/v1/restores");
  ASSERT_EQ(posts.size(), 1U);  // the pod of node-b is node-b's business
  EXPECT_EQ(posts[0], (json{{"artifact", "default.llm"},
                            {"into_container", {{"id", "ph1"}, {"runtime_root", kRuntimeRoot}}},
                            {"settings", {{"role", "replica"}}}}));
  json pod = *server_.get("pods", "default", "replica-1");
  EXPECT_EQ(pod["metadata"]["annotations"]["gpusnap.io/restore-operation"], "op-1");
  EXPECT_EQ(pod["status"]["conditions"].size(), 2U);  // the kubelet's Ready is kept
  EXPECT_EQ(events("Pod", "replica-1", 2),
            (std::vector<std::string>{
                "Normal Restoring: restoring GpuSnapshot default/llm (artifact default.llm) into "
                "container main (agent operation op-1)",
                "Normal Restored: restored from GpuSnapshot llm in 1.8 s"}));
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(agent_.posts("/v1/restores").size(), 1U);
  EXPECT_TRUE(restored("elsewhere").empty());
}

// A pod's settings annotation is anyone's text: one nested deeper than gpusnap reads is refused
// on that pod, and the controller goes on with the next.
TEST_F(ControllerTest, SettingsNestedTooDeepAreRefusedOnThatPodAlone) {
  captured_snapshot("llm", kNode);
  agent_.add_artifact("default.llm");
  start();
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  running_pod(
      "deep", kNode, "ph1",
      {{"gpusnap.io/snapshot", "llm"}, {"gpusnap.io/settings", R"({"role":)" + deep + "}"}});
  ASSERT_TRUE(eventually([&] { return restored("deep").value("status", "") == "False"; }))
      << restored("deep");
  EXPECT_EQ(restored("deep")["reason"], "InvalidSettings");
  EXPECT_EQ(restored("deep")["message"],
            "annotation gpusnap.io/settings must be a JSON object of strings");
  running_pod("next", kNode, "ph2", {{"gpusnap.io/snapshot", "llm"}});
  ASSERT_TRUE(eventually([&] { return restored("next").value("status", "") == "True"; }))
      << restored("next");
  EXPECT_EQ(agent_.posts("/v1/restores").size(), 1U) << "only the second pod was restored";
}

// A restore pod that comes before its snapshot waits, and is restored once the snapshot is.
TEST_F(ControllerTest, RestorePodWaitsForItsSnapshot) {
  start();
  running_pod("early", kNode, "ph1", {{"gpusnap.io/snapshot", "later"}});
  ASSERT_TRUE(
      eventually([&] { return restored("early").value("reason", "") == "SnapshotNotFound"; }));
  EXPECT_EQ(restored("early")["message"], "GpuSnapshot default/later does not exist (yet)");
  running_pod("src", kNode, "c1");
  snapshot("later", {{"source", {{"podName", "src"}}}});
  ASSERT_TRUE(eventually([&] { return restored("early").value("status", "") == "True"; }))
      << restored("early");
  EXPECT_EQ(agent_.posts("/v1/restores").size(), 1U);
}

TEST_F(ControllerTest, WatchExpiryRelistsAndLosesNothing) {
  for (bool http : {false, true}) {
    SCOPED_TRACE(http ? "HTTP 410" : "ERROR event 410");
    server_.http_410 = http;
    std::string suffix = http ? "-http" : "-event";
    running_pod("old" + suffix, kNode, "o1");
    start();
    ASSERT_TRUE(
        eventually([&] { return controller_->pods().get("default/old" + suffix).has_value(); }));
    int lists = controller_->pods().stats().lists;

    // A partition: the watches end and cannot reconnect; meanwhile a pod goes, a pod and a
    // snapshot come, and the server compacts its history past the controller's version.
    server_.end_watches(/*hold=*/true);
    std::this_thread::sleep_for(100ms);
    server_.remove("pods", "default", "old" + suffix);
    running_pod("new" + suffix, kNode, "n1");
    snapshot("snap" + suffix, {{"source", {{"podName", "new" + suffix}}}});
    server_.compact();
    server_.release_watches();

    ASSERT_TRUE(eventually([&] { return phase("snap" + suffix) == "Succeeded"; }))
        << snap_status("snap" + suffix);
    EXPECT_FALSE(controller_->pods().get("default/old" + suffix).has_value());
    EXPECT_TRUE(controller_->pods().get("default/new" + suffix).has_value());
    EXPECT_GE(controller_->pods().stats().expired, 1);
    EXPECT_GE(controller_->snapshots().stats().expired, 1);
    EXPECT_GT(controller_->pods().stats().lists, lists);
    stop();
  }
}

TEST_F(ControllerTest, ConflictingStatusWritesAreRetriedOnTheNewestObject) {
  running_pod("web", kNode, "c0ffee");
  snapshot("web-snap", {{"source", {{"podName", "web"}}}});
  server_.interfere_with_status_writes("gpusnapshots", "default", "web-snap", 3);
  captured_snapshot("llm", kNode);
  agent_.add_artifact("default.llm");
  running_pod("replica", kNode, "ph", {{"gpusnap.io/snapshot", "llm"}});
  server_.interfere_with_status_writes("pods", "default", "replica", 2);
  start();
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Succeeded"; }))
      << snap_status("web-snap");
  ASSERT_TRUE(eventually([&] { return restored("replica").value("status", "") == "True"; }));
  EXPECT_EQ(server_.count("PUT", "/gpusnapshots/web-snap/status", 409), 3);
  EXPECT_EQ(server_.count("PUT", "/pods/replica/status", 409), 2);
  // The other writer's change survived: the controller re-applied its step to it.
  auto snap = server_.get("gpusnapshots", "default", "web-snap");
  EXPECT_TRUE(snap->contains("/metadata/annotations/test~1interference"_json_pointer));
  EXPECT_EQ(agent_.posts("/v1/checkpoints").size(), 1U);
  EXPECT_EQ(agent_.posts("/v1/restores").size(), 1U);
  EXPECT_EQ(events("GpuSnapshot", "web-snap", 2).size(), 2U);  // each transition announced once
  EXPECT_EQ(events("Pod", "replica", 2).size(), 2U)
      << ::testing::PrintToString(events("Pod", "replica"));
}

TEST_F(ControllerTest, SnapshotOfAMissingPodFails) {
  start();
  snapshot("ghost", {{"source", {{"podName", "nope"}}}});
  ASSERT_TRUE(eventually([&] { return phase("ghost") == "Failed"; }));
  std::string message = "pod default/nope does not exist: create the pod first, or give "
                        "spec.source.template";
  json failed = condition(snap_status("ghost")["conditions"], "Failed");
  EXPECT_EQ(failed["status"], "True");
  EXPECT_EQ(failed["reason"], "PodNotFound");
  EXPECT_EQ(failed["message"], message);
  EXPECT_EQ(condition(snap_status("ghost")["conditions"], "Ready")["status"], "False");
  EXPECT_EQ(events("GpuSnapshot", "ghost", 1),
            (std::vector<std::string>{"Warning PodNotFound: " + message}));
  EXPECT_TRUE(agent_.posts("/v1/checkpoints").empty());
}

TEST_F(ControllerTest, SnapshotOnAnotherNodesLocalStorageIsRefused) {
  captured_snapshot("llm", "node-b");  // the artifact is on node-b's disk, not here
  start();
  running_pod("replica", kNode, "ph", {{"gpusnap.io/snapshot", "llm"}});
  ASSERT_TRUE(eventually([&] {
    return restored("replica").value("reason", "") == "SnapshotOnAnotherNode";
  })) << restored("replica");
  std::string message =
      "GpuSnapshot default/llm is stored on node node-b's local storage, which node node-a "
      "cannot read: schedule the pod on node-b (nodeSelector kubernetes.io/hostname) or keep "
      "artifacts on shared storage (chart value storage.type=pvc)";
  EXPECT_EQ(restored("replica")["status"], "False");
  EXPECT_EQ(restored("replica")["message"], message);
  EXPECT_EQ(events("Pod", "replica", 1),
            (std::vector<std::string>{"Warning SnapshotOnAnotherNode: " + message}));
  EXPECT_TRUE(agent_.posts("/v1/restores").empty());
}

// With registry storage the snapshot's status holds its reference by digest: a node whose agent
// does not hold the artifact asks it to restore from there, and the pod is restored.
TEST_F(ControllerTest, SnapshotInTheRegistryIsRestoredOnANodeThatDoesNotHoldIt) {
  const std::string reference = "oci://registry:5000/snapshots@sha256:" + std::string(64, 'c');
  captured_snapshot("llm", "node-b");
  server_.update("gpusnapshots", "default", "llm",
                 [&](json& s) { s["status"]["reference"] = reference; });
  start();
  running_pod("replica", kNode, "ph", {{"gpusnap.io/snapshot", "llm"}});
  ASSERT_TRUE(eventually([&] { return restored("replica").value("status", "") == "True"; }))
      << restored("replica");
  auto posts = agent_.posts("/v1/restores");
  ASSERT_EQ(posts.size(), 1U);
  EXPECT_EQ(posts[0], (json{{"artifact", "default.llm"},
                            {"reference", reference},
                            {"into_container", {{"id", "ph"}, {"runtime_root", kRuntimeRoot}}}}));
  EXPECT_EQ(events("Pod", "replica", 2),
            (std::vector<std::string>{
                "Normal Restoring: restoring GpuSnapshot default/llm (artifact default.llm, " +
                    reference + ") into container main (agent operation op-1)",
                "Normal Restored: restored from GpuSnapshot llm in 1.8 s (pulled from " +
                    reference + ")"}));
}

TEST_F(ControllerTest, IncompatibleNodeEndsTheRestore) {
  captured_snapshot("llm", kNode);
  agent_.add_artifact("default.llm");
  std::string message = "the artifact needs GPU model NVIDIA H200; this host has NVIDIA A100";
  agent_.fail_next_restore({{"kind", "incompatible"}, {"exit_code", 5}, {"message", message}});
  start();
  running_pod("replica", kNode, "ph", {{"gpusnap.io/snapshot", "llm"}});
  ASSERT_TRUE(eventually([&] { return restored("replica").value("reason", "") == "Incompatible"; }))
      << restored("replica");
  EXPECT_EQ(restored("replica")["status"], "False");
  EXPECT_EQ(restored("replica")["message"], message);
  auto ev = events("Pod", "replica", 2);
  ASSERT_EQ(ev.size(), 2U);
  EXPECT_EQ(ev[1], "Warning Incompatible: " + message);
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(agent_.posts("/v1/restores").size(), 1U);  // a verdict: not tried again
}

TEST_F(ControllerTest, CaptureFailureOfTheAgentIsReported) {
  running_pod("web", kNode, "c0ffee");
  agent_.fail_next_checkpoint({{"kind", "not-capturable"},
                               {"exit_code", 6},
                               {"message", "pid 41 holds an io_uring instance"}});
  start();
  snapshot("web-snap", {{"source", {{"podName", "web"}}}});
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Failed"; }));
  json failed = condition(snap_status("web-snap")["conditions"], "Failed");
  EXPECT_EQ(failed["reason"], "NotCapturable");
  EXPECT_EQ(failed["message"], "pid 41 holds an io_uring instance");
  EXPECT_EQ(events("GpuSnapshot", "web-snap", 2).back(),
            "Warning NotCapturable: pid 41 holds an io_uring instance");
}

TEST_F(ControllerTest, AgentRestartMidCaptureEndsInOperationLost) {
  running_pod("web", kNode, "c0ffee");
  agent_.set_polls_until_done(1000000);
  start();
  snapshot("web-snap", {{"source", {{"podName", "web"}}}});
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Capturing"; }));
  agent_.restart();
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Failed"; })) << snap_status("web-snap");
  std::string message =
      "the gpusnap agent on node node-a no longer knows operation op-1 (it restarted during the "
      "capture) and artifact default.web-snap was not written; the source pod was left running; "
      "delete and re-create the GpuSnapshot to capture again";
  json failed = condition(snap_status("web-snap")["conditions"], "Failed");
  EXPECT_EQ(failed["reason"], "OperationLost");
  EXPECT_EQ(failed["message"], message);
  EXPECT_EQ(events("GpuSnapshot", "web-snap", 2).back(), "Warning OperationLost: " + message);
  EXPECT_TRUE(server_.get("pods", "default", "web").has_value());
}

// The agent restarted after the artifact was committed: the artifact is what counts.
TEST_F(ControllerTest, AgentRestartAfterTheCommitKeepsTheArtifact) {
  running_pod("web", kNode, "c0ffee");
  agent_.set_polls_until_done(1000000);
  start();
  snapshot("web-snap", {{"source", {{"podName", "web"}}}});
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Capturing"; }));
  agent_.restart(/*finish_running=*/true);
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Succeeded"; }))
      << snap_status("web-snap");
  EXPECT_EQ(snap_status("web-snap")["sizeBytes"], 123456789);
}

TEST_F(ControllerTest, AgentRestartMidRestoreEndsInOperationLost) {
  captured_snapshot("llm", kNode);
  agent_.add_artifact("default.llm");
  agent_.set_polls_until_done(1000000);
  start();
  running_pod("replica", kNode, "ph", {{"gpusnap.io/snapshot", "llm"}});
  ASSERT_TRUE(eventually([&] { return restored("replica").value("reason", "") == "Restoring"; }));
  agent_.restart();
  ASSERT_TRUE(
      eventually([&] { return restored("replica").value("reason", "") == "OperationLost"; }));
  EXPECT_EQ(restored("replica")["message"],
            "the gpusnap agent on node node-a no longer knows restore operation op-1 (it "
            "restarted during the restore); delete the pod to start a new one");
  EXPECT_EQ(events("Pod", "replica", 2).back(),
            "Warning OperationLost: " + restored("replica")["message"].get<std::string>());
}

// A controller that stops mid-capture leaves the operation's id in status; the next one
// follows it and never starts a second capture.
TEST_F(ControllerTest, RestartedControllerFollowsTheOperationInFlight) {
  running_pod("web", kNode, "c0ffee");
  agent_.set_polls_until_done(1000000);
  start();
  snapshot("web-snap", {{"source", {{"podName", "web"}}}});
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Capturing"; }));
  stop();
  agent_.set_polls_until_done(1);
  start();
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Succeeded"; }))
      << snap_status("web-snap");
  EXPECT_EQ(agent_.posts("/v1/checkpoints").size(), 1U);
}

// Two nodes' controllers race on a snapshot whose pod is missing: one verdict, one Event.
TEST_F(ControllerTest, TwoControllersWriteOneVerdict) {
  ControllerOptions o;
  o.node = "node-b";
  o.poll = 30ms;
  o.log = [](const std::string&) {};
  FakeAgent agent_b(dir_ / "agent-b.sock");
  HttpAgentClient client_b(AgentEndpoint{dir_ / "agent-b.sock", "", "", 10s});
  Controller b(api(), client_b, o);
  b.start();
  start();
  snapshot("ghost", {{"source", {{"podName", "nope"}}}});
  ASSERT_TRUE(eventually([&] { return phase("ghost") == "Failed"; }));
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(events("GpuSnapshot", "ghost", 1).size(), 1U);
  b.stop();
}

}  // namespace
}  // namespace gpusnap::kube

namespace gpusnap::kube {
namespace {

// gpusnap-controller as a user starts it: flags, the API server by URL and token file, the
// agent by socket; SIGTERM stops it cleanly.
TEST_F(ControllerTest, TheProgramCapturesAndStopsOnSigterm) {
  running_pod("web", kNode, "c0ffee");
  common::SpawnOptions o;
  o.argv = {GPUSNAP_CONTROLLER_BIN,
            "--node",
            kNode,
            "--api-server",
            server_.url(),
            "--token-file",
            (dir_ / "token").string(),
            "--agent-socket",
            agent_.socket().string(),
            "--runtime-root",
            kRuntimeRoot,
            "--poll-ms",
            "30"};
  common::Subprocess program(o);
  snapshot("web-snap", {{"source", {{"podName", "web"}}}});
  ASSERT_TRUE(eventually([&] { return phase("web-snap") == "Succeeded"; }))
      << snap_status("web-snap");
  EXPECT_EQ(agent_.posts("/v1/checkpoints").size(), 1U);
  program.kill(SIGTERM);
  auto status = program.wait(10s);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->ok()) << status->describe();
}

TEST_F(ControllerTest, TheProgramRefusesToRunWithoutANode) {
  auto r = common::run_capture(
      {"/usr/bin/env", "-u", "NODE_NAME", GPUSNAP_CONTROLLER_BIN, "--api-server", server_.url()});
  EXPECT_EQ(r.status.code, 2);
  EXPECT_EQ(r.output,
            "gpusnap-controller: error: no node name (fix: give --node NAME, or NODE_NAME from "
            "the downward API (spec.nodeName))\n");
  auto j = common::run_capture({GPUSNAP_CONTROLLER_BIN, "--json", "--node", kNode, "--bogus"});
  EXPECT_EQ(j.status.code, 2);
  EXPECT_EQ(json::parse(j.output)["error"]["message"], "unknown option --bogus");
  for (const std::string bad : {"abc", "-5", "5", "99999999999999999999", "2000ms"}) {
    auto p = common::run_capture({GPUSNAP_CONTROLLER_BIN, "--node", kNode, "--poll-ms", bad});
    EXPECT_EQ(p.status.code, 2) << bad;
    EXPECT_EQ(p.output, "gpusnap-controller: error: --poll-ms must be a whole number from 10 to "
                        "600000, not '" +
                            bad + "' (fix: see gpusnap-controller --help)\n");
  }
}

}  // namespace
}  // namespace gpusnap::kube
