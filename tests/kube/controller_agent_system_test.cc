// The real gpusnap-controller program driving the real gpusnap-agent program (real CRIU, real
// runc containers), with the tests' fake API server (fake_apiserver.h) in place of
// kube-apiserver. The test plays the rest of a cluster: a user creating a GpuSnapshot and pods,
// the scheduler binding the pods to the controller's node, and the kubelet, which starts each
// pod's container with runc and reports its id in the pod's status. Root, runc and CRIU. One
// test has containerd (started by the test) run the pods' containers, as a node's kubelet would.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "kube/fake_apiserver.h"
#include "store/registry_fixture.h"
#include "testing/containerd.h"
#include "testing/containers.h"
#include "testing/harness.h"
#include "testing/node_network.h"

namespace gpusnap::testing {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;
namespace stdfs = std::filesystem;

constexpr const char* kNode = "node-a";
constexpr auto kOperationLimit = std::chrono::seconds(120);  // a capture or restore, end to end

// Whether something accepts connections on the Unix socket at `path`.
bool answers(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), std::min(path.size() + 1, sizeof addr.sun_path));
  common::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  return fd && ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
}

// A program of the build, its output appended to a log file; killed at the end of the test
// (its destructor) unless stopped before.
class Program {
 public:
  Program(std::vector<std::string> argv, const stdfs::path& log) : log_(log) {
    common::UniqueFd out(::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    common::SpawnOptions o;
    o.argv = std::move(argv);
    o.stdout_fd = out.get();
    o.stderr_fd = out.get();
    process_.emplace(o);
  }
  bool running() { return !process_->poll().has_value(); }
  pid_t pid() const { return process_->pid(); }
  // SIGTERM, as the kubelet stops a container; the exit status.
  std::optional<common::ExitStatus> stop() {
    process_->kill(SIGTERM);
    return process_->wait(30s);
  }
  std::string log() const { return fs::read_file(log_); }

 private:
  stdfs::path log_;
  std::optional<common::Subprocess> process_;
};

class ControllerAndRealAgent : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_ / "token") << server_.token() << "\n";
    stdfs::create_directories(dir_ / "control");
  }
  void TearDown() override {
    if (HasFailure()) {
      if (controller_) std::fprintf(stderr, "controller log:\n%s\n", controller_->log().c_str());
      if (stdfs::exists(dir_ / "agent.log")) {
        std::fprintf(stderr, "agent log:\n%s\n", fs::read_file(dir_ / "agent.log").c_str());
      }
    }
  }

  std::string socket() const { return (dir_ / "agent.sock").string(); }
  std::string runtime_root() const { return (dir_ / "runc").string(); }
  stdfs::path storage() const { return dir_ / "snapshots"; }

  // gpusnap-agent as the DaemonSet runs it, on the test's socket, storage and state.
  void start_agent() {
    std::vector<std::string> argv{build_path("gpusnap-agent"),
                                  "--socket",
                                  socket(),
                                  "--storage",
                                  storage().string(),
                                  "--state-dir",
                                  (dir_ / "state").string(),
                                  "--run-dir",
                                  (dir_ / "run").string()};
    argv.insert(argv.end(), agent_args_.begin(), agent_args_.end());
    if (agent_node_ != nullptr) argv = agent_node_->enter(argv);
    agent_ = std::make_unique<Program>(argv, dir_ / "agent.log");
    ASSERT_TRUE(eventually([&] { return !agent_->running() || answers(socket()); }, 30s));
    ASSERT_TRUE(agent_->running()) << agent_->log();
  }
  void stop_agent() {
    auto status = agent_->stop();
    ASSERT_TRUE(status.has_value() && status->ok()) << agent_->log();
    agent_.reset();
  }

  // gpusnap-controller as the DaemonSet runs it, with the API server given by URL and token;
  // with the runtime root of the test's runc containers, or with an empty one (the chart's
  // default: the agent finds the root from the container's ID).
  void start_controller(bool found_runtime_root = false) {
    controller_ = std::make_unique<Program>(
        std::vector<std::string>{build_path("src/kube/gpusnap-controller"), "--node", kNode,
                                 "--api-server", server_.url(), "--token-file",
                                 (dir_ / "token").string(), "--agent-socket", socket(),
                                 "--runtime-root", found_runtime_root ? "" : runtime_root(),
                                 "--control-root", (dir_ / "control").string(), "--poll-ms", "100"},
        dir_ / "controller.log");
  }

  // The kubelet's part: the pod's container, run by runc.
  std::unique_ptr<Container> run_container(const std::string& name,
                                           const std::vector<std::string>& args) {
    auto c =
        std::make_unique<Container>(runtime_root(), prefix_ + name, make_bundle(dir_ / name, args));
    EXPECT_TRUE(c->started()) << "runc run " << name;
    return c;
  }
  // A pod bound to this node whose container `main` runs as `c` (run by runc or by containerd);
  // Ready as the kubelet says.
  template <class C>
  void bound_pod(const std::string& name, const C& c, bool ready, json annotations = json::object(),
                 const std::string& node = kNode) {
    json conditions = {{{"type", "Ready"},
                        {"status", ready ? "True" : "False"},
                        {"reason", ready ? "" : "ReadinessGatesNotReady"}}};
    json spec = {{"nodeName", node}, {"containers", {{{"name", "main"}, {"image", "busybox"}}}}};
    if (annotations.contains("gpusnap.io/snapshot")) {
      spec["readinessGates"] = {{{"conditionType", "gpusnap.io/restored"}}};
    }
    server_.create("pods", "default",
                   {{"metadata", {{"name", name}, {"annotations", std::move(annotations)}}},
                    {"spec", spec},
                    {"status",
                     {{"phase", "Running"},
                      {"conditions", conditions},
                      {"containerStatuses",
                       {{{"name", "main"},
                         {"containerID", "containerd://" + c.id()},
                         {"state", {{"running", {{"startedAt", "2026-01-01T00:00:00Z"}}}}}}}}}}});
  }
  void snapshot_of(const std::string& name, const std::string& pod) {
    server_.create("gpusnapshots", "default",
                   {{"metadata", {{"name", name}}},
                    {"spec",
                     {{"source", {{"podName", pod}, {"container", "main"}}},
                      {"readiness", "PodReady"},
                      {"leaveRunning", true}}}});
  }

  json snap_status(const std::string& name) {
    auto s = server_.get("gpusnapshots", "default", name);
    return s ? s->value("status", json::object()) : json::object();
  }
  // Whether the snapshot reaches phase Succeeded within an operation's time.
  bool succeeds(const std::string& name) {
    return eventually([&] { return snap_status(name).value("phase", "") == "Succeeded"; },
                      kOperationLimit);
  }
  json snap_condition(const std::string& name, const std::string& type) {
    auto c = kube_condition(snap_status(name).value("conditions", json::array()), type);
    return c.value_or(json::object());
  }
  json pod(const std::string& name) {
    return server_.get("pods", "default", name).value_or(json::object());
  }
  json restored(const std::string& name) {
    auto c = kube_condition(pod(name).value("/status/conditions"_json_pointer, json::array()),
                            "gpusnap.io/restored");
    return c.value_or(json::object());
  }
  static std::optional<json> kube_condition(const json& conditions, const std::string& type) {
    for (const auto& c : conditions) {
      if (c.value("type", "") == type) return c;
    }
    return std::nullopt;
  }
  // The Events about one object, "Type Reason: message", in the order they were written.
  std::vector<std::string> events(const std::string& kind, const std::string& name) {
    return server_.events_about(kind, name);
  }

  // The Events about one object once there are at least n: an Event follows the status write
  // it announces, so a test that saw the status may look before the Event is there.
  std::vector<std::string> events(const std::string& kind, const std::string& name, size_t n) {
    eventually([&] { return events(kind, name).size() >= n; });
    return events(kind, name);
  }

  // The agent's own account of an operation (GET /v1/operations/ID on its socket; by default
  // the node's agent, started by start_agent()).
  json agent_operation(const std::string& id, std::string agent_socket = {}) const {
    httplib::Client client(agent_socket.empty() ? socket() : agent_socket, 80);
    client.set_address_family(AF_UNIX);
    auto r = client.Get("/v1/operations/" + id);
    return r && r->status == 200 ? json::parse(r->body) : json();
  }
  json agent_operations(std::string agent_socket = {}) const {
    httplib::Client client(agent_socket.empty() ? socket() : agent_socket, 80);
    client.set_address_family(AF_UNIX);
    auto r = client.Get("/v1/operations");
    return r && r->status == 200 ? json::parse(r->body).at("operations") : json::array();
  }

  // The agent's error when its socket does not answer, as the controller reports it.
  std::string unavailable(const std::string& request) const {
    return "the gpusnap agent at " + socket() + " did not answer " + request +
           ": could not connect (fix: check that the gpusnap agent runs on this node and that "
           "its socket is mounted)";
  }

  TempDir dir_;
  FakeApiServer server_;
  // Container ids are global to the runtime root; a prefix keeps a rerun clear of leftovers.
  std::string prefix_ = "gpusnap-kube-" + fs::random_id().substr(0, 6) + "-";
  std::vector<std::string> agent_args_;  // more flags for start_agent()
  const Node* agent_node_ = nullptr;     // start_agent() runs it on that node
  std::unique_ptr<Program> agent_;
  std::unique_ptr<Program> controller_;
};

// (a) A GpuSnapshot of a running pod ends Ready with the artifact in the agent's storage while
// the source serves on; (b) a pod annotated with that snapshot, whose container is a
// placeholder, is restored by the agent, its readiness condition says so, and the workload in
// it serves the captured state.
TEST_F(ControllerAndRealAgent, CapturesAPodsContainerAndRestoresItIntoAPlaceholderPod) {
  SKIP_WITHOUT_RUNC();
  auto source = run_container("source", shimmed_workload());
  ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }));
  ASSERT_EQ(ask_in(source->pid(), "INCR"), "1");
  const std::string info = ask_in(source->pid(), "INFO");
  const std::string seed = field(info, "seed");
  ASSERT_FALSE(seed.empty()) << info;
  bound_pod("llm-0", *source, /*ready=*/true);
  start_agent();
  start_controller();

  // (a) The capture.
  snapshot_of("llm-warm", "llm-0");
  ASSERT_TRUE(succeeds("llm-warm")) << snap_status("llm-warm").dump(2);
  json st = snap_status("llm-warm");
  EXPECT_EQ(st["nodeName"], kNode);
  EXPECT_EQ(st["podName"], "llm-0");
  EXPECT_EQ(st["containerID"], source->id());
  EXPECT_EQ(st["artifact"], "default.llm-warm");
  EXPECT_FALSE(kube_condition(st["conditions"], "Failed").has_value()) << st.dump(2);

  // The artifact is in the agent's storage, complete, and is the source container's.
  const stdfs::path artifact = storage() / "default.llm-warm";
  auto verify = gpusnap({"verify", artifact.string()});
  EXPECT_EQ(verify.exit_code, 0) << verify.out << verify.err;
  auto inspect = gpusnap({"inspect", artifact.string(), "--json"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  json manifest = json::parse(inspect.out);
  EXPECT_EQ(manifest["container"]["id"], source->id());
  EXPECT_EQ(std::to_string(manifest["processes"][0]["pid"].get<int>()), field(info, "pid"));
  // Status carries the agent's own figures: the artifact's size and the operation's phases.
  EXPECT_EQ(st["sizeBytes"], manifest["total_bytes"]);
  const std::string op_id = st["operation"]["id"];
  json op = agent_operation(op_id);
  ASSERT_EQ(op.value("state", ""), "succeeded") << op.dump(2);
  EXPECT_EQ(op["request"]["container"],
            (json{{"id", source->id()}, {"runtime_root", runtime_root()}}));
  EXPECT_TRUE(op["request"]["leave_running"].get<bool>());
  json phases = json::array();
  for (const auto& p : op["phases"])
    phases.push_back({{"name", p["name"]}, {"seconds", p["seconds"]}});
  EXPECT_EQ(st["phases"], phases);
  json ready = snap_condition("llm-warm", "Ready");
  EXPECT_EQ(ready["status"], "True");
  EXPECT_EQ(ready["reason"], "ArtifactReady");
  const std::string size = std::to_string(manifest["total_bytes"].get<uint64_t>());
  EXPECT_TRUE(ready["message"].get<std::string>().starts_with(
      "artifact default.llm-warm on node node-a (" + size + " bytes, "))
      << ready;
  EXPECT_EQ(snap_condition("llm-warm", "Capturing")["reason"], "Captured");
  EXPECT_EQ(events("GpuSnapshot", "llm-warm", 2),
            (std::vector<std::string>{"Normal CaptureStarted: capturing container main of pod "
                                      "llm-0 into artifact default.llm-warm (agent operation " +
                                          op_id + ")",
                                      "Normal Captured: " + ready["message"].get<std::string>()}));
  // The source was left running, its state its own.
  EXPECT_EQ(source->state().value("status", ""), "running");
  EXPECT_EQ(ask_in(source->pid(), "INCR"), "2");

  // (b) The restore into a placeholder pod.
  auto placeholder = run_container("replica", placeholder_args());
  bound_pod("llm-replica", *placeholder, /*ready=*/false, {{"gpusnap.io/snapshot", "llm-warm"}});
  ASSERT_TRUE(eventually([&] { return restored("llm-replica").value("status", "") == "True"; },
                         kOperationLimit))
      << pod("llm-replica").dump(2);
  json cond = restored("llm-replica");
  EXPECT_EQ(cond["reason"], "Restored");
  EXPECT_TRUE(
      cond["message"].get<std::string>().starts_with("restored from GpuSnapshot llm-warm in "))
      << cond;
  const std::string restore_id =
      pod("llm-replica")
          .value("/metadata/annotations/gpusnap.io~1restore-operation"_json_pointer, json(""));
  json restore_op = agent_operation(restore_id);
  ASSERT_EQ(restore_op.value("state", ""), "succeeded") << restore_op.dump(2);
  EXPECT_EQ(restore_op["request"]["artifact"], "default.llm-warm");
  EXPECT_EQ(restore_op["request"]["into_container"],
            (json{{"id", placeholder->id()}, {"runtime_root", runtime_root()}}));
  // The kubelet's own condition is kept beside the controller's.
  auto kubelet_ready = kube_condition(pod("llm-replica")["status"]["conditions"], "Ready");
  ASSERT_TRUE(kubelet_ready.has_value());
  EXPECT_EQ((*kubelet_ready)["reason"], "ReadinessGatesNotReady");
  auto pod_events = events("Pod", "llm-replica", 2);
  ASSERT_EQ(pod_events.size(), 2U) << json(pod_events).dump(2);
  EXPECT_EQ(pod_events[0], "Normal Restoring: restoring GpuSnapshot default/llm-warm (artifact "
                           "default.llm-warm) into container main (agent operation " +
                               restore_id + ")");
  EXPECT_EQ(pod_events[1], "Normal Restored: " + cond["message"].get<std::string>());

  // The workload runs in the placeholder's namespaces with the captured memory: the snapshot's
  // counter (1), not the source's (2), and the source's seed and pid.
  const pid_t restored_pid = proc::children(placeholder->pid()).at(0);
  for (const char* ns : {"pid", "mnt", "net"}) {
    EXPECT_EQ(namespace_of(restored_pid, ns), namespace_of(placeholder->pid(), ns)) << ns;
  }
  auto copy_info = ask_in(placeholder->pid(), "INFO");
  EXPECT_EQ(field(copy_info, "seed"), seed) << copy_info;
  EXPECT_EQ(field(copy_info, "pid"), field(info, "pid"));
  EXPECT_EQ(ask_in(placeholder->pid(), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask_in(placeholder->pid(), "INCR"), "2");
  EXPECT_EQ(ask_in(source->pid(), "INCR"), "3");

  // Once restored, the pod is never restored again.
  std::this_thread::sleep_for(1s);
  int restores = 0;
  for (const auto& o : agent_operations()) restores += o["kind"] == "restore" ? 1 : 0;
  EXPECT_EQ(restores, 1);
  auto status = controller_->stop();
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(status->ok()) << status->describe();
}

// (c) The node's agent is not running: the snapshot and the restore pod say so (a condition
// and one Warning Event each), nothing fails for good, and once the agent is back both go
// through, with nothing lost.
TEST_F(ControllerAndRealAgent, AnAgentThatDoesNotAnswerIsReportedAndWaitedFor) {
  SKIP_WITHOUT_RUNC();
  auto source = run_container("source", shimmed_workload());
  ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }));
  ASSERT_EQ(ask_in(source->pid(), "INCR"), "1");
  const std::string seed = field(ask_in(source->pid(), "INFO"), "seed");
  bound_pod("llm-0", *source, /*ready=*/true);
  start_controller();  // no agent yet: its socket does not exist

  snapshot_of("llm-warm", "llm-0");
  ASSERT_TRUE(eventually([&] {
    return snap_condition("llm-warm", "Ready").value("reason", "") == "AgentUnavailable";
  })) << snap_status("llm-warm").dump(2);
  const std::string down = unavailable("POST /v1/checkpoints");
  EXPECT_EQ(snap_condition("llm-warm", "Ready")["message"], down);
  EXPECT_EQ(snap_status("llm-warm")["phase"], "Pending");
  std::this_thread::sleep_for(2s);  // several retries: still one Event, still a wait
  EXPECT_EQ(events("GpuSnapshot", "llm-warm", 1),
            std::vector<std::string>{"Warning AgentUnavailable: " + down});
  EXPECT_EQ(snap_status("llm-warm")["phase"], "Pending");
  EXPECT_FALSE(stdfs::exists(storage() / "default.llm-warm"));
  EXPECT_EQ(ask_in(source->pid(), "INCR"), "2");

  start_agent();
  ASSERT_TRUE(succeeds("llm-warm")) << snap_status("llm-warm").dump(2);
  EXPECT_EQ(snap_condition("llm-warm", "Ready")["reason"], "ArtifactReady");
  auto snap_events = events("GpuSnapshot", "llm-warm", 3);
  ASSERT_EQ(snap_events.size(), 3U) << json(snap_events).dump(2);
  EXPECT_TRUE(snap_events[1].starts_with("Normal CaptureStarted: ")) << snap_events[1];
  EXPECT_TRUE(snap_events[2].starts_with("Normal Captured: ")) << snap_events[2];
  EXPECT_EQ(gpusnap({"verify", (storage() / "default.llm-warm").string()}).exit_code, 0);
  EXPECT_EQ(ask_in(source->pid(), "INCR"), "3");  // captured at 2, the source goes on

  // The agent goes away again before a restore pod comes.
  stop_agent();
  auto placeholder = run_container("replica", placeholder_args());
  bound_pod("llm-replica", *placeholder, /*ready=*/false, {{"gpusnap.io/snapshot", "llm-warm"}});
  ASSERT_TRUE(eventually([&] {
    return restored("llm-replica").value("reason", "") == "AgentUnavailable";
  })) << pod("llm-replica").dump(2);
  const std::string pod_down = unavailable("GET /v1/snapshots/default.llm-warm");
  EXPECT_EQ(restored("llm-replica")["status"], "False");
  EXPECT_EQ(restored("llm-replica")["message"], pod_down);
  std::this_thread::sleep_for(2s);
  EXPECT_EQ(events("Pod", "llm-replica", 1),
            std::vector<std::string>{"Warning AgentUnavailable: " + pod_down});
  EXPECT_TRUE(proc::children(placeholder->pid()).empty());  // the placeholder still waits

  start_agent();
  ASSERT_TRUE(eventually([&] { return restored("llm-replica").value("status", "") == "True"; },
                         kOperationLimit))
      << pod("llm-replica").dump(2);
  EXPECT_EQ(field(ask_in(placeholder->pid(), "INFO"), "seed"), seed);
  EXPECT_EQ(ask_in(placeholder->pid(), "INCR"), "3");  // the snapshot's 2, then its own
  EXPECT_EQ(ask_in(source->pid(), "INCR"), "4");
}

// The real agent's refusal, with its own error kind and message, is the snapshot's verdict: a
// container whose PID 1 is not the gpusnap shim cannot be captured.
TEST_F(ControllerAndRealAgent, TheAgentsRefusalIsTheSnapshotsVerdict) {
  SKIP_WITHOUT_RUNC();
  auto not_shim = run_container("not-shim", placeholder_args());
  bound_pod("plain", *not_shim, /*ready=*/true);
  start_agent();
  start_controller();
  snapshot_of("plain-snap", "plain");
  ASSERT_TRUE(eventually([&] { return snap_status("plain-snap").value("phase", "") == "Failed"; },
                         kOperationLimit))
      << snap_status("plain-snap").dump(2);
  const std::string message = "container " + not_shim->id() + " (runc root " + runtime_root() +
                              "): its PID 1 (pid " + std::to_string(not_shim->pid()) +
                              ") is not the gpusnap shim";
  json failed = snap_condition("plain-snap", "Failed");
  EXPECT_EQ(failed["status"], "True");
  EXPECT_EQ(failed["reason"], "NotCapturable");
  EXPECT_EQ(failed["message"], message);
  EXPECT_EQ(snap_condition("plain-snap", "Ready")["reason"], "NotCapturable");
  auto snap_events = events("GpuSnapshot", "plain-snap", 2);
  ASSERT_EQ(snap_events.size(), 2U) << json(snap_events).dump(2);
  EXPECT_EQ(snap_events[1], "Warning NotCapturable: " + message);
  EXPECT_FALSE(stdfs::exists(storage() / "default.plain-snap"));
  EXPECT_EQ(not_shim->state().value("status", ""), "running");
}

// The same capture and restore on the path a containerd node takes: containerd runs the pods'
// containers (runc v2 shim, namespace k8s.io), the controller runs with an empty runtime root,
// and the agent finds each container in the shim's by its ID. containerd
// reports both containers running afterwards, and stopping the restored pod's container
// through containerd ends the restored workload.
TEST_F(ControllerAndRealAgent, CapturesAndRestoresPodsThatContainerdRuns) {
  if (auto why = containerd_blocker()) GTEST_SKIP() << "skipped: " << *why;
  Containerd containerd(dir_ / "containerd");
  if (auto why = containerd.failure()) GTEST_SKIP() << "skipped: " << *why;
  ManagedContainer source(containerd, prefix_ + "source", shimmed_workload());
  ASSERT_TRUE(source.started()) << source.start_output();
  ASSERT_TRUE(eventually([&] { return ask_in(source.pid(), "PING") == "PONG"; }));
  ASSERT_EQ(ask_in(source.pid(), "INCR"), "1");
  const std::string seed = field(ask_in(source.pid(), "INFO"), "seed");
  bound_pod("llm-0", source, /*ready=*/true);
  start_agent();
  start_controller(/*found_runtime_root=*/true);

  snapshot_of("llm-warm", "llm-0");
  ASSERT_TRUE(succeeds("llm-warm")) << snap_status("llm-warm").dump(2);
  auto inspect = gpusnap({"inspect", (storage() / "default.llm-warm").string(), "--json"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  json manifest = json::parse(inspect.out);
  EXPECT_EQ(manifest["container"]["id"], source.id());
  EXPECT_EQ(manifest["container"]["runtime_root"], "/run/containerd/runc/k8s.io");
  // The controller named the container by its ID alone; the agent found the shim's root.
  json op = agent_operation(snap_status("llm-warm")["operation"]["id"].get<std::string>());
  EXPECT_EQ(op["request"]["container"], (json{{"id", source.id()}, {"runtime_root", ""}}));
  EXPECT_EQ(ask_in(source.pid(), "INCR"), "2");

  ManagedContainer placeholder(containerd, prefix_ + "replica", placeholder_args());
  ASSERT_TRUE(placeholder.started()) << placeholder.start_output();
  bound_pod("llm-replica", placeholder, /*ready=*/false, {{"gpusnap.io/snapshot", "llm-warm"}});
  ASSERT_TRUE(eventually([&] { return restored("llm-replica").value("status", "") == "True"; },
                         kOperationLimit))
      << pod("llm-replica").dump(2);
  const pid_t restored_pid = proc::children(placeholder.pid()).at(0);
  for (const char* ns : {"pid", "mnt", "net"}) {
    EXPECT_EQ(namespace_of(restored_pid, ns), namespace_of(placeholder.pid(), ns)) << ns;
  }
  EXPECT_EQ(field(ask_in(placeholder.pid(), "INFO"), "seed"), seed);
  EXPECT_EQ(ask_in(placeholder.pid(), "INCR"), "2");

  // containerd's account: both tasks running, each with its own PID 1.
  EXPECT_EQ(source.status(), "RUNNING");
  EXPECT_EQ(source.listed_pid(), source.pid());
  EXPECT_EQ(placeholder.status(), "RUNNING");
  EXPECT_EQ(placeholder.listed_pid(), placeholder.pid());
  // The kubelet stops the restored pod's container: the restored workload ends with it.
  ASSERT_TRUE(containerd.ctr({"task", "kill", placeholder.id()}).status.ok());
  EXPECT_TRUE(eventually([&] { return placeholder.status() == "STOPPED"; }));
  EXPECT_FALSE(running(restored_pid));
  EXPECT_EQ(ask_in(source.pid(), "INCR"), "3");
}

// Two nodes whose agents keep snapshots in a real registry (docker-registry on loopback), each
// node its own agent (socket, storage, state, run directory, node cache) and controller. The
// capture on node-a is pushed and the GpuSnapshot records its reference by digest; a restore
// pod on node-b, whose agent never saw the artifact, is restored from the registry, and a second
// one on node-b fetches nothing.
TEST_F(ControllerAndRealAgent, ARestorePodOnANodeWithoutTheSnapshotPullsItFromTheRegistry) {
  SKIP_WITHOUT_RUNC();
  if (auto why = LocalRegistry::blocker()) GTEST_SKIP() << "skipped: " << *why;
  if (auto why = NodeNetwork::blocker()) GTEST_SKIP() << "skipped: " << *why;
  // Two nodes, each agent in its node's network namespace, the registry at the host's address
  // on their links (testing/node_network.h); the controllers reach their agents by socket.
  NodeNetwork nodes(2);
  LocalRegistry::Options at_host;
  at_host.address = nodes.host_address();
  LocalRegistry registry(dir_, at_host);
  const std::string repository = registry.ref("snapshots");
  agent_node_ = &nodes.node(0);
  agent_args_ = {"--registry", repository, "--registry-plain-http", "--cache",
                 (dir_ / "cache").string()};
  auto source = run_container("source", shimmed_workload());
  ASSERT_TRUE(eventually([&] { return ask_in(source->pid(), "PING") == "PONG"; }));
  ASSERT_EQ(ask_in(source->pid(), "INCR"), "1");
  const std::string seed = field(ask_in(source->pid(), "INFO"), "seed");
  bound_pod("llm-0", *source, /*ready=*/true);
  start_agent();
  start_controller();

  // Node b: its own agent and controller.
  const stdfs::path b = dir_ / "node-b";
  stdfs::create_directories(b / "control");
  const std::string b_socket = (b / "agent.sock").string();
  Program b_agent(
      nodes.node(1).enter({build_path("gpusnap-agent"), "--socket", b_socket, "--storage",
                           (b / "snapshots").string(), "--state-dir", (b / "state").string(),
                           "--run-dir", (b / "run").string(), "--registry", repository,
                           "--registry-plain-http", "--cache", (b / "cache").string()}),
      b / "agent.log");
  ASSERT_TRUE(eventually([&] { return !b_agent.running() || answers(b_socket); }, 30s));
  ASSERT_TRUE(b_agent.running()) << b_agent.log();
  // Each agent on its own node: neither in the host's network namespace nor in the other's.
  EXPECT_EQ(net_namespace_of(agent_->pid()), nodes.node(0).inode());
  EXPECT_EQ(net_namespace_of(b_agent.pid()), nodes.node(1).inode());
  EXPECT_NE(nodes.node(0).inode(), net_namespace_of(::getpid()));
  EXPECT_NE(nodes.node(1).inode(), net_namespace_of(::getpid()));
  Program b_controller(
      {build_path("src/kube/gpusnap-controller"), "--node", "node-b", "--api-server", server_.url(),
       "--token-file", (dir_ / "token").string(), "--agent-socket", b_socket, "--runtime-root",
       runtime_root(), "--control-root", (b / "control").string(), "--poll-ms", "100"},
      b / "controller.log");

  snapshot_of("llm-warm", "llm-0");
  ASSERT_TRUE(succeeds("llm-warm")) << snap_status("llm-warm").dump(2);
  json st = snap_status("llm-warm");
  EXPECT_EQ(st["nodeName"], kNode);
  const std::string reference = st.value("reference", "");
  ASSERT_TRUE(reference.starts_with(repository + "@sha256:")) << st.dump(2);
  json capture = agent_operation(st["operation"]["id"].get<std::string>());
  EXPECT_EQ(capture["result"]["reference"], reference);
  EXPECT_TRUE(snap_condition("llm-warm", "Ready")["message"].get<std::string>().ends_with(
      ", pushed as " + reference));

  // A restore pod on node-b: node-b's agent pulls the snapshot and restores it.
  auto placeholder = run_container("replica", placeholder_args());
  bound_pod("llm-replica", *placeholder, /*ready=*/false, {{"gpusnap.io/snapshot", "llm-warm"}},
            "node-b");
  ASSERT_TRUE(eventually([&] { return restored("llm-replica").value("status", "") == "True"; },
                         kOperationLimit))
      << pod("llm-replica").dump(2) << "\nnode-b controller:\n"
      << b_controller.log() << "\nnode-b agent:\n"
      << b_agent.log();
  const std::string restore_id =
      pod("llm-replica")
          .value("/metadata/annotations/gpusnap.io~1restore-operation"_json_pointer, json(""));
  json restore_op = agent_operation(restore_id, b_socket);
  ASSERT_EQ(restore_op.value("state", ""), "succeeded") << restore_op.dump(2);
  EXPECT_EQ(restore_op["request"]["reference"], reference);
  const json& pulled = restore_op["result"]["pulled"];
  EXPECT_TRUE(pulled["pulled"].get<bool>()) << restore_op.dump(2);
  EXPECT_GT(pulled["chunks_fetched"].get<uint64_t>(), 0U);
  const std::string message = restored("llm-replica")["message"];
  EXPECT_TRUE(message.starts_with("restored from GpuSnapshot llm-warm in ")) << message;
  EXPECT_TRUE(message.ends_with(" s (pulled from " + reference + ")")) << message;
  EXPECT_FALSE(stdfs::exists(b / "snapshots" / "default.llm-warm"));  // node-b never captured it
  EXPECT_EQ(field(ask_in(placeholder->pid(), "INFO"), "seed"), seed);
  EXPECT_EQ(ask_in(placeholder->pid(), "INCR"), "2");  // the snapshot's 1, then its own
  // Node-a's agent restored nothing: the pod was node-b's.
  for (const auto& o : agent_operations()) EXPECT_EQ(o["kind"], "checkpoint") << o.dump(2);

  // A second restore pod on node-b: the snapshot is there now, nothing is fetched.
  auto second = run_container("replica-2", placeholder_args());
  bound_pod("llm-replica-2", *second, /*ready=*/false, {{"gpusnap.io/snapshot", "llm-warm"}},
            "node-b");
  ASSERT_TRUE(eventually([&] { return restored("llm-replica-2").value("status", "") == "True"; },
                         kOperationLimit))
      << pod("llm-replica-2").dump(2);
  json again = agent_operation(
      pod("llm-replica-2")
          .value("/metadata/annotations/gpusnap.io~1restore-operation"_json_pointer, json("")),
      b_socket);
  EXPECT_FALSE(again["result"]["pulled"]["pulled"].get<bool>()) << again.dump(2);
  EXPECT_EQ(again["result"]["pulled"]["chunks_fetched"], 0);
  EXPECT_EQ(ask_in(second->pid(), "INCR"), "2");
  EXPECT_EQ(ask_in(source->pid(), "INCR"), "2");
}

}  // namespace
}  // namespace gpusnap::testing
