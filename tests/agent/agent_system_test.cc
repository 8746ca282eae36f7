// Black-box tests of the built gpusnap-agent: the real daemon on a temporary socket, storage
// and state directory, driven over HTTP with cpp-httplib's client (and with the gpusnap CLI's
// --agent), capturing and restoring the real test workload with real CRIU. Root.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <list>
#include <memory>
#include <optional>
#include <regex>
#include <sstream>
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
#include "criu/criu.h"
#include "store/recording_server.h"
#include "store/registry_fixture.h"
#include "testing/harness.h"
#include "testing/node_network.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;

constexpr gid_t kNobody = 65534;

// One HTTP answer, its body parsed when it is JSON.
struct Answer {
  int status = 0;
  json doc;
  std::string body;
  std::string allow;
  std::string retry_after;
};

constexpr const char* kTcpToken = "s3cret-token-0123456789abcdef";
// Where an agent on a node of its own serves TCP: the namespace is its alone, the port is free.
constexpr int kNodePort = 7070;

// Writes kTcpToken to DIR/token, readable by root alone as the agent demands; its path.
std::string token_file(const TempDir& dir) {
  write(dir / "token", std::string(kTcpToken) + "\n");
  if (::chmod((dir / "token").c_str(), 0600) != 0) ADD_FAILURE() << "chmod of the token file";
  return (dir / "token").string();
}

// A gpusnap-agent process on its own socket, storage, state and run directories (under `dir`),
// killed at the end of the test whatever happens. On a node (`node`): started inside the node's
// network namespace, and asked over TCP at the node's address with kTcpToken, as from another
// host; else asked on its socket.
class Agent {
 public:
  explicit Agent(const TempDir& dir, std::vector<std::string> extra = {},
                 const Node* node = nullptr)
      : socket_((dir / "agent.sock").string()),
        storage_(dir / "snapshots"),
        state_(dir / "state"),
        run_(dir / "run"),
        log_(dir / "agent.log"),
        extra_(std::move(extra)),
        node_(node) {
    if (node_ != nullptr) {
      extra_.insert(extra_.end(), {"--listen", node_->address() + ":" + std::to_string(kNodePort),
                                   "--token-file", token_file(dir)});
    }
    start();
  }
  ~Agent() { kill(); }

  void start() {
    common::UniqueFd out(::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    common::SpawnOptions o;
    o.argv = {build_path("gpusnap-agent"),
              "--socket",
              socket_,
              "--storage",
              storage_.string(),
              "--state-dir",
              state_.string(),
              "--run-dir",
              run_.string()};
    o.argv.insert(o.argv.end(), extra_.begin(), extra_.end());
    if (node_ != nullptr) o.argv = node_->enter(o.argv);
    o.stdout_fd = out.get();
    o.stderr_fd = out.get();
    process_.emplace(o);
    const bool up =
        eventually([&] { return !process_->running() || get("/v1/healthz").status == 200; },
                   std::chrono::seconds(30));
    if (!up || !process_->running()) {
      throw std::runtime_error("gpusnap-agent did not start: " + log());
    }
  }

  // SIGKILL, as a crash or an OOM kill would: no cleanup of its own runs.
  void kill() {
    if (!process_) return;
    process_->kill(SIGKILL);
    process_->wait();
    process_.reset();
  }

  // Another signal, as an operator or the kubelet sends one.
  void signal(int number) { process_->kill(number); }

  std::optional<common::ExitStatus> wait_exit(std::chrono::seconds limit) {
    return process_->wait(limit);
  }

  Answer request(const std::string& method, const std::string& path, const json& body = nullptr,
                 const std::string& raw = {}) const {
    std::optional<httplib::Client> client;
    httplib::Headers headers;
    if (node_ != nullptr) {
      client.emplace(node_->address(), kNodePort);
      headers.emplace("Authorization", std::string("Bearer ") + kTcpToken);
    } else {
      client.emplace(socket_, 80);
      client->set_address_family(AF_UNIX);
    }
    client->set_read_timeout(std::chrono::seconds(30));
    const std::string text = raw.empty() && !body.is_null() ? body.dump() : raw;
    httplib::Result r = method == "GET"    ? client->Get(path, headers)
                        : method == "POST" ? client->Post(path, headers, text, "application/json")
                                           : client->Delete(path, headers);
    Answer a;
    if (!r) return a;
    a.status = r->status;
    a.body = r->body;
    a.allow = r->get_header_value("Allow");
    a.retry_after = r->get_header_value("Retry-After");
    a.doc = json::parse(r->body, nullptr, false);
    return a;
  }
  Answer get(const std::string& path) const { return request("GET", path); }
  Answer post(const std::string& path, const json& body) const {
    return request("POST", path, body);
  }

  // Polls the operation until it has ended; its last state.
  json wait_operation(const std::string& id,
                      std::chrono::seconds limit = std::chrono::seconds(120)) const {
    json op;
    eventually(
        [&] {
          op = get("/v1/operations/" + id).doc;
          return op.is_object() &&
                 (op.value("state", "") == "succeeded" || op.value("state", "") == "failed");
        },
        limit);
    return op;
  }

  // Posts a request that must be accepted; the operation's final state.
  json run(const std::string& path, const json& body) const {
    auto a = post(path, body);
    EXPECT_EQ(a.status, 202) << a.body;
    if (a.status != 202) return json::object();
    EXPECT_EQ(a.doc["operation"]["state"], "pending") << a.body;
    return wait_operation(a.doc["operation"]["id"].get<std::string>());
  }

  std::string log() const { return fs::read_file(log_); }
  pid_t pid() const { return process_ ? process_->pid() : 0; }
  const std::string& socket() const { return socket_; }
  const std::filesystem::path& storage() const { return storage_; }
  const std::filesystem::path& state() const { return state_; }

 private:
  std::string socket_;
  std::filesystem::path storage_, state_, run_, log_;
  std::vector<std::string> extra_;
  const Node* node_;
  std::optional<common::Subprocess> process_;
};

// The value of one sample line of /metrics; -1 when the line is missing.
double sample(const std::string& metrics, const std::string& series) {
  const auto at = metrics.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(metrics.substr(at + series.size() + 2));
}

std::vector<std::string> phase_names(const json& op) {
  std::vector<std::string> names;
  for (const auto& p : op["phases"]) {
    EXPECT_TRUE(p["done"].get<bool>()) << p;
    names.push_back(p["name"].get<std::string>());
  }
  return names;
}

// Entries of the storage directory, hidden ones (staging) included.
std::vector<std::string> entries(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  return out;
}

TEST(Agent, CheckpointsListsInspectsAndRestoresTheWorkload) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  Workload source(dir, {"--mib", "16", "--children", "1"});
  ASSERT_EQ(ask(source.port(), "INCR"), "1");
  const std::string seed = field(ask(source.port(), "INFO"), "seed");

  auto cp = agent.run("/v1/checkpoints", {{"artifact", "snap"}, {"pid", source.pid()}});
  ASSERT_EQ(cp["state"], "succeeded") << cp.dump(2);
  EXPECT_TRUE(cp["error"].is_null());
  EXPECT_EQ(phase_names(cp),
            (std::vector<std::string>{"resolve", "preflight", "dump", "checksum", "commit"}));
  EXPECT_EQ(cp["notes"][0], "capturing pid " + std::to_string(source.pid()) +
                                " as it runs: it does not speak the workload handshake");
  const json& result = cp["result"];
  EXPECT_EQ(result["artifact"], (agent.storage() / "snap").string());
  EXPECT_EQ(result["processes"], 2);
  EXPECT_TRUE(result["source_left_running"].get<bool>());  // the API's default
  EXPECT_EQ(ask(source.port(), "INCR"), "2");
  EXPECT_EQ(cp["request"],
            (json{{"artifact", "snap"}, {"pid", source.pid()}, {"leave_running", true}}));
  EXPECT_TRUE(std::filesystem::is_empty(agent.state() / "operations"));  // ended: no journal

  auto list = agent.get("/v1/snapshots");
  ASSERT_EQ(list.status, 200) << list.body;
  ASSERT_EQ(list.doc["snapshots"].size(), 1u);
  EXPECT_EQ(list.doc["snapshots"][0]["name"], "snap");
  EXPECT_EQ(list.doc["snapshots"][0]["id"], result["id"]);
  EXPECT_EQ(list.doc["snapshots"][0]["bytes"], result["bytes"]);
  auto inspect = agent.get("/v1/snapshots/snap");
  ASSERT_EQ(inspect.status, 200) << inspect.body;
  EXPECT_EQ(inspect.doc["processes"].size(), 2u);
  EXPECT_EQ(inspect.doc["processes"][0]["pid"], source.pid());
  // The same document as `gpusnap inspect --json`.
  auto direct = gpusnap({"inspect", (agent.storage() / "snap").string(), "--json"});
  ASSERT_EQ(direct.exit_code, 0) << direct.err;
  EXPECT_EQ(inspect.doc, json::parse(direct.out));

  auto rs = agent.run("/v1/restores",
                      {{"artifact", "snap"}, {"publish", {std::to_string(source.port())}}});
  ASSERT_EQ(rs["state"], "succeeded") << rs.dump(2);
  Copies copies(rs["result"]);
  ASSERT_EQ(copies.copies.size(), 1u);
  EXPECT_EQ(phase_names(rs),
            (std::vector<std::string>{"open", "verify", "criu-restore", "locate", "release"}));
  auto info = ask(copies.port(0), "INFO");
  EXPECT_EQ(field(info, "seed"), seed) << info;
  EXPECT_EQ(ask(copies.port(0), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask(copies.port(0), "INCR"), "2");  // the counter as captured

  auto ops = agent.get("/v1/operations");
  ASSERT_EQ(ops.doc["operations"].size(), 2u);
  EXPECT_EQ(ops.doc["operations"][0]["id"], cp["id"]);
  EXPECT_EQ(ops.doc["operations"][1]["id"], rs["id"]);

  const std::string metrics = agent.get("/metrics").body;
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_total{kind="checkpoint",result="succeeded"})"),
            1);
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_total{kind="restore",result="succeeded"})"), 1);
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_total{kind="restore",result="failed"})"), 0);
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_in_flight{kind="checkpoint"})"), 0);
  EXPECT_EQ(sample(metrics, R"(gpusnap_operation_duration_seconds_count{kind="restore"})"), 1);
  EXPECT_EQ(
      sample(metrics, R"(gpusnap_phase_duration_seconds_count{kind="checkpoint",phase="dump"})"),
      1);
  EXPECT_EQ(sample(metrics, R"(gpusnap_artifact_bytes_total{kind="checkpoint"})"),
            result["bytes"].get<double>());
  EXPECT_EQ(sample(metrics, R"(gpusnap_artifact_bytes_total{kind="restore"})"),
            result["bytes"].get<double>());
}

TEST(Agent, OperationsRunOneAtATimeTheRestWaitPending) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  Workload source(dir, {"--mib", "64"});
  auto first = agent.post("/v1/checkpoints", {{"artifact", "a"}, {"pid", source.pid()}});
  auto second = agent.post("/v1/checkpoints", {{"artifact", "b"}, {"pid", source.pid()}});
  ASSERT_EQ(first.status, 202);
  ASSERT_EQ(second.status, 202);
  // While the first runs, the second waits.
  bool overlapped = false;
  json a, b;
  eventually(
      [&] {
        a = agent.get("/v1/operations/" + first.doc["operation"]["id"].get<std::string>()).doc;
        b = agent.get("/v1/operations/" + second.doc["operation"]["id"].get<std::string>()).doc;
        overlapped |= a["state"] == "running" && b["state"] == "running";
        return b["state"] == "succeeded" || b["state"] == "failed";
      },
      std::chrono::seconds(120));
  EXPECT_FALSE(overlapped);
  EXPECT_EQ(a["state"], "succeeded") << a.dump(2);
  EXPECT_EQ(b["state"], "succeeded") << b.dump(2);
  EXPECT_LE(a["finished_at"].get<std::string>(), b["started_at"].get<std::string>());
}

TEST(Agent, BadRequestsAreRefusedWithTheirStatusAndError) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  auto expect_error = [&](const Answer& a, int status, const std::string& kind, int exit_code,
                          const std::string& message) {
    EXPECT_EQ(a.status, status) << a.body;
    EXPECT_EQ(a.doc["error"]["kind"], kind) << a.body;
    EXPECT_EQ(a.doc["error"]["exit_code"], exit_code) << a.body;
    EXPECT_EQ(a.doc["error"]["message"], message) << a.body;
  };
  expect_error(agent.post("/v1/checkpoints", {{"artifact", "a"}, {"pid", 1}, {"force", true}}), 400,
               "usage", 2, "unknown field \"force\" in a checkpoint request");
  expect_error(agent.post("/v1/checkpoints", {{"artifact", "../etc"}, {"pid", 1}}), 400, "usage", 2,
               "artifact name '../etc' is a path, not a name");
  expect_error(agent.post("/v1/checkpoints", {{"artifact", ".."}, {"pid", 1}}), 400, "usage", 2,
               "artifact name '..' is not a name");
  expect_error(agent.post("/v1/checkpoints", {{"artifact", "a"}}), 400, "usage", 2,
               "a checkpoint request needs \"pid\" or \"container\"");
  expect_error(agent.request("POST", "/v1/checkpoints", nullptr, "{\"artifact\":"), 400, "usage", 2,
               agent.request("POST", "/v1/checkpoints", nullptr, "{\"artifact\":")
                   .doc["error"]["message"]
                   .get<std::string>());
  EXPECT_EQ(agent.request("POST", "/v1/checkpoints", nullptr, "[]").doc["error"]["message"],
            "the request body must be a JSON object, not []");
  expect_error(agent.post("/v1/restores", {{"artifact", "a"}, {"replicas", -1}}), 400, "usage", 2,
               "\"replicas\" must be a whole number from 1 to 1024, not -1");
  expect_error(agent.post("/v1/restores", {{"artifact", "a"}, {"publish", {"x:y"}}}), 400, "usage",
               2, "bad port 'y' in --publish x:y");
  expect_error(agent.post("/v1/checkpoints", {{"artifact", "a"}, {"container", {{"id", "x/y"}}}}),
               400, "usage", 2, "bad container id 'x/y' in \"container\"");
  expect_error(agent.get("/v1/operations/nope"), 404, "not-found", 3, "no operation nope");
  expect_error(agent.get("/v1/snapshots/missing"), 404, "not-found", 3,
               "artifact " + (agent.storage() / "missing").string() + " does not exist");
  expect_error(agent.get("/v1/snapshots/.hidden"), 400, "usage", 2,
               "artifact name '.hidden' is hidden: hidden names are for staging");
  expect_error(agent.get("/v2/anything"), 404, "not-found", 3, "no such endpoint /v2/anything");
  auto del = agent.request("DELETE", "/v1/operations");
  expect_error(del, 405, "usage", 2, "DELETE is not allowed on /v1/operations");
  EXPECT_EQ(del.allow, "GET, HEAD");
  auto get = agent.get("/v1/checkpoints");
  expect_error(get, 405, "usage", 2, "GET is not allowed on /v1/checkpoints");
  EXPECT_EQ(get.allow, "POST");
  // Nothing was queued by any of them.
  EXPECT_EQ(agent.get("/v1/operations").doc["operations"].size(), 0u);

  // Accepted, then failing in the engine: the operation carries the engine's error.
  auto no_container = agent.run("/v1/checkpoints",
                                {{"artifact", "c"}, {"container", {{"id", "no-such-container"}}}});
  EXPECT_EQ(no_container["state"], "failed") << no_container.dump(2);
  EXPECT_EQ(no_container["error"]["exit_code"], 3) << no_container.dump(2);
  auto missing = agent.run("/v1/restores", {{"artifact", "missing"}});
  EXPECT_EQ(missing["state"], "failed");
  EXPECT_EQ(missing["error"]["kind"], "not-found");
  EXPECT_EQ(missing["error"]["exit_code"], 3);
  EXPECT_EQ(missing["error"]["message"],
            "artifact " + (agent.storage() / "missing").string() + " does not exist");
  const pid_t gone = dead_pid();
  auto no_pid = agent.run("/v1/checkpoints", {{"artifact", "x"}, {"pid", gone}});
  EXPECT_EQ(no_pid["error"]["message"], "no process with pid " + std::to_string(gone));
  const std::string metrics = agent.get("/metrics").body;
  EXPECT_EQ(
      sample(metrics, R"(gpusnap_operation_failures_total{kind="restore",error_kind="not-found"})"),
      1);
  // The missing container and the missing pid.
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_total{kind="checkpoint",result="failed"})"), 2);
}

// connect(2) to a Unix socket as uid:gid in a forked child; the child's errno (0: connected).
int connect_as(const std::string& socket, uid_t uid, gid_t gid) {
  pid_t pid = ::fork();
  if (pid == 0) {
    // Only async-signal-safe calls here: the parent may have threads.
    if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(255);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) ::_exit(0);
    ::_exit(errno);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(AgentAccess, TheSocketIsForRootAndItsGroupOnly) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  // Let everyone reach the socket file: what refuses them must be the socket's own mode.
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  {
    Agent agent(dir);
    struct stat st {};
    ASSERT_EQ(::stat(agent.socket().c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 07777, 0660u);
    EXPECT_EQ(st.st_uid, 0u);
    EXPECT_EQ(st.st_gid, 0u);
    EXPECT_EQ(connect_as(agent.socket(), kNobody, kNobody), EACCES);
    EXPECT_EQ(connect_as(agent.socket(), 0, 0), 0);

    // The CLI says what is wrong.
    auto as_nobody = [&] {
      pid_t pid = ::fork();
      if (pid == 0) {
        if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) {
          ::_exit(255);
        }
        const std::string bin = gpusnap_bin();
        const std::string out = (dir / "nobody.err").string();
        int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
        ::dup2(fd, 2);
        ::execl(bin.c_str(), bin.c_str(), "--agent", agent.socket().c_str(), "list",
                static_cast<char*>(nullptr));
        ::_exit(127);
      }
      int status = 0;
      ::waitpid(pid, &status, 0);
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    };
    ASSERT_EQ(::chmod(dir.path().c_str(), 0777), 0);
    EXPECT_EQ(as_nobody(), 10);
    EXPECT_EQ(fs::read_file(dir / "nobody.err"),
              "gpusnap: error: cannot reach the gpusnap agent at " + agent.socket() +
                  ": connect: Permission denied (fix: the socket is for root and the agent's "
                  "--socket-group only)\n");
    ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  }
  // With --socket-group, that group's members may call.
  Agent grouped(dir, {"--socket-group", std::to_string(kNobody)});
  struct stat st {};
  ASSERT_EQ(::stat(grouped.socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, kNobody);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  EXPECT_EQ(connect_as(grouped.socket(), kNobody, kNobody), 0);
  EXPECT_EQ(connect_as(grouped.socket(), kNobody, kNobody - 1), EACCES);
}

// Starts gpusnap-agent on TCP with `token_file` in `dir`, for an agent that must refuse to start;
// its exit code and what it wrote on stderr.
std::pair<int, std::string> agent_refusing_to_start(const std::filesystem::path& dir,
                                                    const std::filesystem::path& token_file,
                                                    const std::string& listen = "127.0.0.1:0") {
  common::SpawnOptions o;
  o.argv = {build_path("gpusnap-agent"),
            "--socket",
            (dir / "s").string(),
            "--storage",
            (dir / "snap").string(),
            "--state-dir",
            (dir / "state").string(),
            "--listen",
            listen,
            "--token-file",
            token_file.string()};
  common::UniqueFd err(::open((dir / "err").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
  o.stderr_fd = err.get();
  common::Subprocess p(o);
  auto status = p.wait(std::chrono::seconds(30));
  return {status ? status->code : -1, fs::read_file(dir / "err")};
}

// An agent's arguments to also serve TCP on a free port with kTcpToken, its token file written.
std::vector<std::string> tcp_agent_args(const TempDir& dir) {
  return {"--listen", "127.0.0.1:0", "--token-file", token_file(dir)};
}

// The TCP port the agent says it serves ("serving SOCKET and 127.0.0.1:PORT (bearer token)"),
// or 0 when its log does not say.
int tcp_port_of(const Agent& agent) {
  const std::string log = agent.log();
  const auto at = log.find("and 127.0.0.1:");
  return at == std::string::npos ? 0 : std::stoi(log.substr(at + 14));
}

TEST(AgentAccess, TcpCallersNeedTheBearerToken) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  const std::string token = kTcpToken;
  Agent agent(dir, tcp_agent_args(dir));
  const int port = tcp_port_of(agent);
  ASSERT_GT(port, 0) << agent.log();
  httplib::Client client("127.0.0.1", port);
  auto none = client.Get("/v1/healthz");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 401);
  EXPECT_EQ(none->get_header_value("WWW-Authenticate"), "Bearer");
  EXPECT_EQ(json::parse(none->body)["error"]["message"], "missing or wrong bearer token");
  auto wrong = client.Get("/metrics", {{"Authorization", "Bearer " + token.substr(1) + "x"}});
  EXPECT_EQ(wrong->status, 401);
  auto prefix = client.Get("/metrics", {{"Authorization", "Bearer " + token.substr(0, 10)}});
  EXPECT_EQ(prefix->status, 401);
  auto post = client.Post("/v1/checkpoints", R"({"artifact":"a","pid":1})", "application/json");
  EXPECT_EQ(post->status, 401);
  auto right = client.Get("/v1/healthz", {{"Authorization", "Bearer " + token}});
  ASSERT_TRUE(right);
  EXPECT_EQ(right->status, 200);
  EXPECT_TRUE(json::parse(right->body)["ok"].get<bool>());
  EXPECT_EQ(agent.get("/v1/operations").doc["operations"].size(), 0u);  // nothing got through

  // A token everybody can read protects nothing: the agent refuses to start with it.
  ASSERT_EQ(::chmod((dir / "token").c_str(), 0644), 0);
  agent.kill();
  TempDir other;
  auto [code, err] = agent_refusing_to_start(other.path(), dir / "token");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(err, "gpusnap-agent: error: token file " + (dir / "token").string() +
                     " is readable by everyone (fix: chmod o-r " + (dir / "token").string() +
                     ")\n");
}

// --listen with an IPv6 address in brackets, as a dual-stack cluster's pods have them: the agent
// binds it, says it as [ADDR]:PORT, and asks TCP callers for the token there as on IPv4.
TEST(AgentAccess, ListensOnAnIpv6AddressInBrackets) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir, {"--listen", "[::1]:0", "--token-file", token_file(dir)});
  const std::string log = agent.log();
  const auto at = log.find("and [::1]:");
  ASSERT_NE(at, std::string::npos) << log;
  const int port = std::stoi(log.substr(at + 10));
  ASSERT_GT(port, 0) << log;
  httplib::Client client("::1", port);
  auto none = client.Get("/v1/healthz");
  ASSERT_TRUE(none) << httplib::to_string(none.error());
  EXPECT_EQ(none->status, 401);
  auto right = client.Get("/v1/healthz", {{"Authorization", "Bearer " + std::string(kTcpToken)}});
  ASSERT_TRUE(right);
  EXPECT_EQ(right->status, 200);
  // One bracket alone is no address.
  TempDir other;
  auto [code, err] = agent_refusing_to_start(other.path(), dir / "token", "[::1:0");
  EXPECT_EQ(code, 2) << err;
  EXPECT_NE(err.find("bad --listen '[::1:0'"), std::string::npos) << err;
}

// The handshake worker's counter after an INCR; -1 while it answers anything else (paused).
long counter(uint16_t port) {
  const auto reply = ask(port, "INCR");
  if (reply.empty() || reply.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stol(reply);
}

// The workload handshake example, taking 3 s to pause: a capture killed while it waits.
class SlowPausingWorker {
 public:
  explicit SlowPausingWorker(const TempDir& dir) : control_(dir / "control") {
    std::filesystem::create_directories(control_);
    process_ = std::make_unique<Workload>(
        dir,
        std::vector<std::string>{"/usr/bin/env", "GPUSNAP_CONTROL_DIR=" + control_.string(),
                                 "GPUSNAP_EXAMPLE_PAUSE=slow",
                                 build_path("tests/gpusnap-example-handshake-worker")},
        std::chrono::seconds(30));
    EXPECT_TRUE(eventually([&] { return std::filesystem::exists(control_ / "ready"); }));
  }
  pid_t pid() const { return process_->pid(); }
  uint16_t port() const { return process_->port(); }
  // gpusnap has asked it to pause.
  bool asked_to_pause() const { return std::filesystem::exists(control_ / "pause"); }

 private:
  std::filesystem::path control_;
  std::unique_ptr<Workload> process_;
};

TEST(AgentRecovery, AgentKilledDuringACheckpointReportsItFailedAndTheWorkloadServes) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  auto agent = std::make_unique<Agent>(dir);
  SlowPausingWorker worker(dir);
  ASSERT_EQ(counter(worker.port()), 1);

  auto accepted = agent->post("/v1/checkpoints", {{"artifact", "snap"}, {"pid", worker.pid()}});
  ASSERT_EQ(accepted.status, 202) << accepted.body;
  const std::string id = accepted.doc["operation"]["id"].get<std::string>();
  // Killed while the workload is pausing, with the staging directory made.
  ASSERT_TRUE(eventually([&] {
    auto op = agent->get("/v1/operations/" + id).doc;
    return op.is_object() && !op["phases"].empty() && op["phases"].back()["name"] == "pause";
  }));
  ASSERT_TRUE(eventually([&] { return worker.asked_to_pause(); }));
  agent->kill();
  // The capture's guardian (engine/dump_guard.h) outlives the agent: once the workload's slow
  // pause ends, it is resumed, and the staging directory goes, with no agent running. Left
  // behind: only the agent's journal entry.
  EXPECT_TRUE(std::filesystem::exists(agent->state() / "operations" / (id + ".json")));
  EXPECT_TRUE(eventually([&] { return counter(worker.port()) > 1; }, std::chrono::seconds(20)))
      << ask(worker.port(), "INFO");
  EXPECT_TRUE(eventually([&] { return entries(agent->storage()).empty(); }));

  agent->start();
  auto op = agent->get("/v1/operations/" + id);
  ASSERT_EQ(op.status, 200) << op.body;
  EXPECT_EQ(op.doc["state"], "failed");
  EXPECT_EQ(op.doc["kind"], "checkpoint");
  EXPECT_EQ(op.doc["error"]["kind"], "internal");
  EXPECT_EQ(op.doc["error"]["message"],
            "the agent restarted during the checkpoint of pid " + std::to_string(worker.pid()) +
                " into snap (phase pause); the workload was resumed and nothing was written");
  EXPECT_EQ(op.doc["error"]["hint"], "send the request again");
  // The workload serves again, resumed as the source with its cache back.
  EXPECT_TRUE(eventually([&] { return counter(worker.port()) > 1; })) << ask(worker.port(), "INFO");
  const auto info = ask(worker.port(), "INFO");
  EXPECT_EQ(field(info, "restored"), "0") << info;
  EXPECT_EQ(field(info, "cache_mib"), "64") << info;
  EXPECT_TRUE(running(worker.pid()));
  // No artifact, no staging directory, no journal entry.
  EXPECT_EQ(entries(agent->storage()), std::vector<std::string>{});
  EXPECT_TRUE(std::filesystem::is_empty(agent->state() / "operations"));
  const std::string metrics = agent->get("/metrics").body;
  EXPECT_EQ(sample(metrics,
                   R"(gpusnap_operation_failures_total{kind="checkpoint",error_kind="internal"})"),
            1);

  // The agent works on: a capture of the same workload now succeeds.
  auto again = agent->run("/v1/checkpoints", {{"artifact", "snap"}, {"pid", worker.pid()}});
  EXPECT_EQ(again["state"], "succeeded") << again.dump(2);
}

// Dump guardians (`gpusnap __dump-guard SPEC`) whose spec names a staging directory in `dir`.
int guardians_writing_into(const std::filesystem::path& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    std::string cmdline;
    if (fs::try_read_file(e.path() / "cmdline", &cmdline) &&
        cmdline.find("__dump-guard") != std::string::npos &&
        cmdline.find(dir.string() + "/.") != std::string::npos) {
      ++n;
    }
  }
  return n;
}

TEST(AgentRecovery, AgentKilledDuringTheDumpWaitsForItsGuardian) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  // The real CRIU, started 4 s late for dumps: a dump the test can be sure to interrupt.
  write(dir / "slow-criu", "#!/bin/sh\nif [ \"$1\" = dump ]; then sleep 4; fi\nexec " +
                               criu::locate().path + " \"$@\"\n");
  ASSERT_EQ(::chmod((dir / "slow-criu").c_str(), 0755), 0);
  auto agent = std::make_unique<Agent>(
      dir, std::vector<std::string>{"--criu", (dir / "slow-criu").string()});
  Workload source(dir, {"--mib", "64", "--children", "1"});
  ASSERT_EQ(ask(source.port(), "INCR"), "1");
  auto accepted = agent->post("/v1/checkpoints", {{"artifact", "big"}, {"pid", source.pid()}});
  ASSERT_EQ(accepted.status, 202) << accepted.body;
  const std::string id = accepted.doc["operation"]["id"].get<std::string>();
  ASSERT_TRUE(eventually([&] {
    auto op = agent->get("/v1/operations/" + id).doc;
    return op.is_object() && !op["phases"].empty() && op["phases"].back()["name"] == "dump";
  }));
  // Killed once CRIU dumps (slowly) under its guardian, into the agent's staging directory.
  ASSERT_TRUE(eventually([&] { return guardians_writing_into(agent->storage()) >= 1; }));
  agent->kill();
  ASSERT_GE(guardians_writing_into(agent->storage()), 1);

  agent->start();
  // The new agent served nothing before the dump had ended and been cleaned up.
  EXPECT_EQ(guardians_writing_into(agent->storage()), 0);
  auto op = agent->get("/v1/operations/" + id).doc;
  EXPECT_EQ(op["state"], "failed");
  EXPECT_EQ(op["error"]["message"],
            "the agent restarted during the checkpoint of pid " + std::to_string(source.pid()) +
                " into big (phase dump); the workload was resumed and nothing was written");
  EXPECT_EQ(entries(agent->storage()), std::vector<std::string>{});
  EXPECT_TRUE(running(source.pid()));
  EXPECT_EQ(ask(source.port(), "CHECK").substr(0, 2), "OK");
  EXPECT_EQ(ask(source.port(), "INCR"), "2");
}

TEST(AgentRecovery, AnOperationAcceptedButNotStartedIsReportedNotRun) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  auto agent = std::make_unique<Agent>(dir);
  SlowPausingWorker worker(dir);
  auto first = agent->post("/v1/checkpoints", {{"artifact", "one"}, {"pid", worker.pid()}});
  auto second = agent->post("/v1/checkpoints", {{"artifact", "two"}, {"pid", worker.pid()}});
  ASSERT_EQ(second.status, 202);
  const std::string id = second.doc["operation"]["id"].get<std::string>();
  ASSERT_EQ(agent->get("/v1/operations/" + id).doc["state"], "pending");
  agent->kill();
  agent->start();
  auto op = agent->get("/v1/operations/" + id).doc;
  EXPECT_EQ(op["state"], "failed");
  EXPECT_EQ(op["error"]["message"],
            "the agent restarted before the checkpoint of two started; nothing was done");
  EXPECT_EQ(agent->get("/v1/operations").doc["operations"].size(), 2u);
  // Not only in the journal: the restarted agent's log says so too, with no duration.
  EXPECT_NE(
      agent->log().find(" gpusnap-agent: operation " + id +
                        " checkpoint failed (artifact two, pid " + std::to_string(worker.pid()) +
                        "): internal: the agent restarted before the checkpoint of two "
                        "started; nothing was done (fix: send the request again)\n"),
      std::string::npos)
      << agent->log();
  EXPECT_TRUE(eventually([&] { return counter(worker.port()) > 0; })) << ask(worker.port(), "INFO");
}

// SIGTERM: the running checkpoint finishes, the pending one is failed, and the log says both
// before the agent exits 0.
TEST(AgentStop, SigtermFinishesTheRunningCheckpointAndFailsThePendingOne) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  SlowPausingWorker worker(dir);
  auto running = agent.post("/v1/checkpoints", {{"artifact", "a"}, {"pid", worker.pid()}});
  auto pending = agent.post("/v1/checkpoints", {{"artifact", "b"}, {"pid", worker.pid()}});
  ASSERT_EQ(running.status, 202) << running.body;
  ASSERT_EQ(pending.status, 202) << pending.body;
  ASSERT_TRUE(eventually([&] { return worker.asked_to_pause(); }));
  agent.signal(SIGTERM);
  const auto status = agent.wait_exit(std::chrono::seconds(60));
  ASSERT_TRUE(status.has_value()) << agent.log();
  EXPECT_TRUE(status->ok()) << status->describe() << "\n" << agent.log();
  EXPECT_TRUE(std::filesystem::is_directory(agent.storage() / "a")) << agent.log();
  EXPECT_FALSE(std::filesystem::exists(agent.storage() / "b"));
  EXPECT_TRUE(std::filesystem::is_empty(agent.state() / "operations"));
  const std::string log = agent.log();
  const std::string a = running.doc["operation"]["id"], b = pending.doc["operation"]["id"];
  const std::string pid = std::to_string(worker.pid());
  EXPECT_NE(log.find(" gpusnap-agent: signal 15: finishing the running operations\n"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find(" gpusnap-agent: operation " + a + " checkpoint succeeded in "),
            std::string::npos)
      << log;
  EXPECT_NE(
      log.find(" gpusnap-agent: operation " + b + " checkpoint failed (artifact b, pid " + pid +
               "): internal: the agent stopped before this checkpoint started; nothing was "
               "done (fix: send the request again)\n"),
      std::string::npos)
      << log;
  EXPECT_EQ(log.find("operation " + b + " checkpoint started"), std::string::npos) << log;
  EXPECT_TRUE(eventually([&] { return counter(worker.port()) > 0; })) << ask(worker.port(), "INFO");
}

TEST(AgentCli, ThroughTheAgentTheCliPrintsAndExitsAsDirect) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  // A failure: the same message and exit code (3, not found).
  const pid_t gone = dead_pid();
  auto direct = gpusnap({"checkpoint", "--pid", std::to_string(gone), "-o", (dir / "x").string()});
  auto via =
      gpusnap({"--agent", agent.socket(), "checkpoint", "--pid", std::to_string(gone), "-o", "x"});
  EXPECT_EQ(direct.exit_code, 3) << direct.err;
  EXPECT_EQ(via.exit_code, 3) << via.err;
  EXPECT_EQ(via.err, direct.err);
  EXPECT_EQ(via.err, "gpusnap: error: no process with pid " + std::to_string(gone) +
                         " (fix: check the pid with `ps -p " + std::to_string(gone) + "`)\n");
  auto via_json = gpusnap({"--agent", agent.socket(), "checkpoint", "--pid", std::to_string(gone),
                           "-o", "x", "--json"});
  EXPECT_EQ(via_json.exit_code, 3);
  EXPECT_EQ(json::parse(via_json.out)["error"]["kind"], "not-found");

  // A bad name is the agent's usage error, exit 2.
  auto bad = gpusnap({"--agent", agent.socket(), "checkpoint", "--pid", "1", "-o", "a/b"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_EQ(bad.err,
            "gpusnap: error: artifact name 'a/b' is a path, not a name (fix: name the snapshot "
            "with letters, digits, '.', '-' or '_', no slash)\n");
  // A flag the agent decides itself.
  auto flag = gpusnap({"--agent", agent.socket(), "restore", "x", "--no-verify"});
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_EQ(flag.err,
            "gpusnap: error: --no-verify is not available through the agent (fix: the agent "
            "applies its own setting; drop --no-verify or run without --agent)\n");
  auto verify = gpusnap({"--agent", agent.socket(), "verify", "x"});
  EXPECT_EQ(verify.exit_code, 2);
  EXPECT_EQ(verify.err,
            "gpusnap: error: gpusnap verify does not run through the agent (fix: run it without "
            "--agent, on the agent's host)\n");

  // A success: the same document as the direct command, and through $GPUSNAP_AGENT too.
  Workload source(dir, {"--mib", "8"});
  auto cp = gpusnap({"--agent", agent.socket(), "checkpoint", "--pid", std::to_string(source.pid()),
                     "-o", "snap", "--leave-running", "--json"});
  ASSERT_EQ(cp.exit_code, 0) << cp.err;
  auto doc = json::parse(cp.out);
  auto here = gpusnap({"checkpoint", "--pid", std::to_string(source.pid()), "-o",
                       (dir / "here").string(), "--leave-running", "--json"});
  ASSERT_EQ(here.exit_code, 0) << here.err;
  auto here_doc = json::parse(here.out);
  for (const auto& [key, value] : here_doc.items()) EXPECT_TRUE(doc.contains(key)) << key;
  EXPECT_EQ(doc.size(), here_doc.size());
  EXPECT_EQ(doc["artifact"], (agent.storage() / "snap").string());
  EXPECT_TRUE(running(source.pid()));
  // `gpusnap list DIR --json` here, and the agent's GET /v1/snapshots, are one document.
  auto listed = gpusnap({"list", agent.storage().string(), "--json"});
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_EQ(json::parse(listed.out), agent.get("/v1/snapshots").doc);
  auto human = gpusnap({"--agent", agent.socket(), "list"});
  EXPECT_EQ(human.exit_code, 0) << human.err;
  EXPECT_NE(human.out.find("snap "), std::string::npos) << human.out;
  EXPECT_EQ(gpusnap({"--agent", agent.socket(), "inspect", "snap", "--json"}).out,
            gpusnap({"inspect", (agent.storage() / "snap").string(), "--json"}).out);
  auto rs = gpusnap({"--agent", agent.socket(), "restore", "snap", "--publish",
                     std::to_string(source.port()), "--json"});
  ASSERT_EQ(rs.exit_code, 0) << rs.err;
  Copies copies(json::parse(rs.out));
  ASSERT_EQ(copies.copies.size(), 1u);
  EXPECT_EQ(ask(copies.port(0), "CHECK").substr(0, 2), "OK");
}

// The lines of the agent's log that mention `needle`.
std::vector<std::string> lines_with(const std::string& log, const std::string& needle) {
  std::vector<std::string> out;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.find(needle) != std::string::npos) out.push_back(line);
  }
  return out;
}

// A failed checkpoint left no trace in the agent's log, which held request lines alone, with no
// time. Each operation now logs its start and its end: the time, its id, kind, outcome and
// duration, and when it failed its error's kind and message; in text, or JSON lines.
class AgentLogFormat : public ::testing::TestWithParam<std::string> {};

TEST_P(AgentLogFormat, OperationsLogTheirStartAndEndWithOutcomeAndError) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir, {"--log-format", GetParam()});
  Workload source(dir, {"--mib", "4"});
  const pid_t gone = dead_pid();
  auto failed = agent.run("/v1/checkpoints", {{"artifact", "x"}, {"pid", gone}});
  ASSERT_EQ(failed["state"], "failed") << failed.dump(2);
  auto done = agent.run("/v1/checkpoints", {{"artifact", "snap"}, {"pid", source.pid()}});
  ASSERT_EQ(done["state"], "succeeded") << done.dump(2);
  const std::string failed_id = failed["id"], done_id = done["id"];
  const std::string log = agent.log();
  const std::string time = R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)";
  const std::string gone_text = std::to_string(gone), pid_text = std::to_string(source.pid());

  if (GetParam() == "text") {
    auto expect_line = [&](const std::string& id, const std::string& pattern) {
      const auto lines = lines_with(log, "operation " + id + " ");
      EXPECT_EQ(std::count_if(
                    lines.begin(), lines.end(),
                    [&](const std::string& l) { return std::regex_match(l, std::regex(pattern)); }),
                1)
          << pattern << "\nin:\n"
          << log;
    };
    const std::string prefix = time + " gpusnap-agent: operation ";
    expect_line(failed_id, prefix + failed_id + R"( checkpoint started \(artifact x, pid )" +
                               gone_text + R"(\))");
    expect_line(failed_id, prefix + failed_id +
                               R"( checkpoint failed in \d+\.\d{3} s \(artifact x, pid )" +
                               gone_text + R"(\): not-found: no process with pid )" + gone_text +
                               R"(( \(fix: .*\))?)");
    expect_line(done_id, prefix + done_id + R"( checkpoint started \(artifact snap, pid )" +
                             pid_text + R"(\))");
    expect_line(done_id, prefix + done_id +
                             R"( checkpoint succeeded in \d+\.\d{3} s \(artifact snap, pid )" +
                             pid_text + R"(\))");
    // Request lines keep their time, and every line opens with one.
    EXPECT_EQ(lines_with(log, " gpusnap-agent: POST /v1/checkpoints -> 202").size(), 2u) << log;
    std::istringstream in(log);
    for (std::string line; std::getline(in, line);) {
      EXPECT_TRUE(std::regex_search(line, std::regex("^" + time + " gpusnap-agent: "))) << line;
    }
    return;
  }
  // JSON lines: every line is an object opening with its time.
  std::vector<json> events;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    const json doc = json::parse(line, nullptr, false);
    ASSERT_TRUE(doc.is_object()) << line;
    EXPECT_TRUE(std::regex_match(doc.value("time", ""), std::regex(time))) << line;
    EXPECT_EQ(line.rfind("{\"time\":", 0), 0u) << line;
    events.push_back(doc);
  }
  auto event = [&](const std::string& name, const std::string& id) {
    json found;
    int n = 0;
    for (const auto& e : events) {
      if (e.value("event", "") == name && e.value("id", "") == id) found = e, ++n;
    }
    EXPECT_EQ(n, 1) << name << " " << id << "\nin:\n" << log;
    found.erase("time");
    return found;
  };
  EXPECT_EQ(event("operation-started", failed_id), (json{{"event", "operation-started"},
                                                         {"id", failed_id},
                                                         {"kind", "checkpoint"},
                                                         {"artifact", "x"},
                                                         {"pid", gone}}));
  json end = event("operation-finished", failed_id);
  EXPECT_EQ(end["outcome"], "failed") << end;
  EXPECT_GE(end["duration_s"].get<double>(), 0) << end;
  EXPECT_EQ(end["error"]["kind"], "not-found") << end;
  EXPECT_EQ(end["error"]["message"], "no process with pid " + gone_text) << end;
  EXPECT_EQ(event("operation-started", done_id)["pid"], source.pid());
  end = event("operation-finished", done_id);
  EXPECT_EQ(end["outcome"], "succeeded") << end;
  EXPECT_GT(end["duration_s"].get<double>(), 0) << end;
  EXPECT_FALSE(end.contains("error")) << end;
  int requests = 0;
  for (const auto& e : events) {
    requests += e.value("event", "") == "request" && e.value("path", "") == "/v1/checkpoints" &&
                e.value("status", 0) == 202;
  }
  EXPECT_EQ(requests, 2) << log;
}

INSTANTIATE_TEST_SUITE_P(TextAndJson, AgentLogFormat, ::testing::Values("text", "json"));

// Raw bytes to the agent's Unix socket; the status of its answer (0: none).
int raw_status(const std::string& socket, const std::string& request) {
  common::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket.c_str(), sizeof addr.sun_path - 1);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return 0;
  for (size_t off = 0; off < request.size();) {
    ssize_t n = ::send(fd.get(), request.data() + off, request.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;  // the agent may stop reading early: its answer still counts
    off += static_cast<size_t>(n);
  }
  std::string reply;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd.get(), buf, sizeof buf, 0)) > 0;) reply.append(buf, n);
  return reply.rfind("HTTP/1.1 ", 0) == 0 ? std::stoi(reply.substr(9, 3)) : 0;
}

TEST(AgentBadInput, DeeplyNestedBodiesAreRefusedAndTheAgentLives) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  // 160 KB each: the first crashed the agent (stack overflow formatting the error).
  const std::string deep = std::string(80000, '[') + std::string(80000, ']');
  auto a = agent.request("POST", "/v1/checkpoints", nullptr, deep);
  EXPECT_EQ(a.status, 400);
  EXPECT_EQ(a.doc["error"]["message"],
            "the request body is not JSON: nested deeper than 64 levels");
  const std::string settings = R"({"artifact":"a","settings":{"k":)" + deep + "}}";
  EXPECT_EQ(agent.request("POST", "/v1/restores", nullptr, settings).status, 400);
  EXPECT_EQ(agent.get("/v1/healthz").status, 200);
}

TEST(AgentBadInput, InvalidUtf8IsTheCallersFault) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  for (const std::string& body : {std::string("{\"artifact\":\"a\xff\xfe\",\"pid\":5}"),
                                  std::string("{\"\xc3\x28\":1}"), std::string("\xff")}) {
    auto a = agent.request("POST", "/v1/checkpoints", nullptr, body);
    EXPECT_EQ(a.status, 400) << a.body;
    EXPECT_EQ(a.doc["error"]["kind"], "usage") << a.body;
  }
}

TEST(AgentBadInput, ChunkedBodiesAreBoundedLikeOthers) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  // 3.4 MB in 64 KiB chunks was accepted (202); the limit is 1 MiB however it is sent.
  std::string request =
      "POST /v1/checkpoints HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  const std::string chunk = std::string(65536, ' ');
  for (int i = 0; i < 52; ++i) request += "10000\r\n" + chunk + "\r\n";
  request += "0\r\n\r\n";
  EXPECT_EQ(raw_status(agent.socket(), request), 413);
  // A small chunked request is still served.
  const std::string body = R"({"artifact":"a","pid":1})";
  char size[16];
  std::snprintf(size, sizeof size, "%zx", body.size());
  EXPECT_EQ(raw_status(agent.socket(),
                       "POST /v1/checkpoints HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
                           std::string(size) + "\r\n" + body + "\r\n0\r\n\r\n"),
            202);
  EXPECT_EQ(agent.get("/v1/healthz").status, 200);
}

// A body over 1 MiB sent with Content-Length was cut at the bound and answered 400 "not JSON
// ... unexpected end of input" instead of 413.
TEST(AgentBadInput, BodiesWithContentLengthOverTheBoundGet413) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  Agent agent(dir);
  auto with_length = [](size_t n) {
    return "POST /v1/checkpoints HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
           "Content-Type: application/json\r\nContent-Length: " +
           std::to_string(n) + "\r\n\r\n" + std::string(n, ' ');
  };
  EXPECT_EQ(raw_status(agent.socket(), with_length(1536 * 1024)), 413);
  EXPECT_EQ(raw_status(agent.socket(), with_length((1 << 20) + 1)), 413);
  // At the bound itself the body is read whole and judged as JSON.
  EXPECT_EQ(raw_status(agent.socket(), with_length(1 << 20)), 400);
  EXPECT_EQ(agent.get("/v1/healthz").status, 200);
}

// The front once refused connections beyond 16 still sending their head, and an authorised
// request waited for the first slow peer's 5 s head deadline (3.2 s; 20 s before the front).
TEST(AgentBadInput, SlowUnauthenticatedPeersDoNotStallTcpCallers) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  const std::string token = kTcpToken;
  Agent agent(dir, tcp_agent_args(dir));
  const int port = tcp_port_of(agent);
  ASSERT_GT(port, 0) << agent.log();
  // 40 peers that send a header line a second, as long as they are let: they took the HTTP
  // library's threads, and an authorised request waited 20 s.
  std::atomic<bool> stop{false};
  std::vector<std::jthread> slow;
  std::atomic<int> cut_off{0};
  for (int i = 0; i < 40; ++i) {
    slow.emplace_back([&] {
      common::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(port));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return;
      std::string line = "GET /v1/healthz HTTP/1.1\r\n";
      for (int n = 0; !stop && n < 30; ++n) {
        if (::send(fd.get(), line.data(), line.size(), MSG_NOSIGNAL) <= 0) {
          ++cut_off;
          return;
        }
        line = "X-Slow-" + std::to_string(n) + ": 1\r\n";
        std::this_thread::sleep_for(std::chrono::seconds(1));
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));
  httplib::Client client("127.0.0.1", port);
  const auto started = std::chrono::steady_clock::now();
  auto right = client.Get("/v1/healthz", {{"Authorization", "Bearer " + token}});
  const auto took = std::chrono::steady_clock::now() - started;
  ASSERT_TRUE(right);
  EXPECT_EQ(right->status, 200);
  EXPECT_LT(took, std::chrono::seconds(2)) << "an authorised request waited behind slow peers";
  std::printf(
      "tcp front: authorised request answered in %lld ms behind 40 slow peers\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
  // Each slow peer is cut off at the head deadline (5 s), not served for ever.
  EXPECT_TRUE(eventually([&] { return cut_off == 40; }, std::chrono::seconds(15)))
      << cut_off << " of 40 slow peers were cut off";
  stop = true;
}

TEST(AgentBadInput, MissingTokenFileIsAUsageError) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  auto [code, err] = agent_refusing_to_start(dir.path(), dir / "no-token");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(err, "gpusnap-agent: error: token file " + (dir / "no-token").string() +
                     " does not exist (fix: write the token there first (`openssl rand -hex 32 "
                     "> FILE; chmod 600 FILE`), or give the right --token-file)\n");
}

// ---- registry storage: two agents standing for two nodes -----------------------------------

// Modes under `root` that give anything to group or others: what the store, the cache and the
// pulled snapshots hold is root's alone. Empty when none does.
std::vector<std::string> not_root_only(const std::filesystem::path& root) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) != 0) continue;
    if ((st.st_mode & 077) != 0 || st.st_uid != 0) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
      out.push_back(e.path().string() + " " + mode);
    }
  }
  return out;
}

// The registry's blob downloads so far (its access log: one line per request).
size_t blob_gets(const LocalRegistry& registry) {
  size_t n = 0;
  const std::string log = registry.log();
  for (size_t at = 0; (at = log.find("\"GET /v2/snapshots/blobs/", at)) != std::string::npos;
       ++at) {
    ++n;
  }
  return n;
}

// Whether any interface of the host has this IPv4 address.
bool host_has_address(const std::string& address) {
  const auto r = common::run_capture({"ip", "-o", "-4", "addr", "show"});
  return r.output.find(" " + address + " ") != std::string::npos ||
         r.output.find(" " + address + "/") != std::string::npos;
}

// The nodes the two-agent tests stand on: each its own namespace, the host's address reached
// from each (and seen from the node's own address), the node's loopback its own; two networks
// at once take two ranges; nothing of one is left on the host once it is destroyed.
TEST(NodeNetworkSetUp, EachNodeIsANamespaceOfItsOwnAndNothingOutlivesIt) {
  GPUSNAP_SKIP_IF_BLOCKED(NodeNetwork::blocker());
  std::vector<std::string> links;
  std::string host;
  {
    NodeNetwork nodes(2);
    host = nodes.host_address();
    EXPECT_TRUE(host_has_address(host));
    const ino_t host_ns = net_namespace_of(::getpid());
    EXPECT_NE(nodes.node(0).inode(), host_ns);
    EXPECT_NE(nodes.node(1).inode(), host_ns);
    EXPECT_NE(nodes.node(0).inode(), nodes.node(1).inode());

    // A listener at the host's address; each node connects to it from its own address.
    common::UniqueFd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in at{};
    at.sin_family = AF_INET;
    ASSERT_EQ(::inet_pton(AF_INET, host.c_str(), &at.sin_addr), 1);
    socklen_t len = sizeof at;
    ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
    ASSERT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&at), &len), 0);
    ASSERT_EQ(::listen(listener.get(), 4), 0);
    for (size_t i = 0; i < 2; ++i) {
      const Node& node = nodes.node(i);
      links.push_back(node.link());
      EXPECT_NE(::if_nametoindex(node.link().c_str()), 0U);
      const std::string from = node.run([&] {
        EXPECT_EQ(net_namespace_of(::gettid()), node.inode());  // this thread alone moved
        common::UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_in mine{};
        socklen_t n = sizeof mine;
        if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&at), sizeof at) != 0 ||
            ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&mine), &n) != 0) {
          return "connect: " + errno_text(errno);
        }
        char text[INET_ADDRSTRLEN];
        return std::string(::inet_ntop(AF_INET, &mine.sin_addr, text, sizeof text));
      });
      EXPECT_EQ(from, node.address());
      common::UniqueFd peer(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      EXPECT_TRUE(peer.valid());
      // Its interfaces: loopback and its end of the link, nothing of the host's.
      const auto ifaces = common::run_capture(node.enter({"ip", "-o", "link", "show"}));
      EXPECT_EQ(std::count(ifaces.output.begin(), ifaces.output.end(), '\n'), 2) << ifaces.output;
    }
    NodeNetwork other(1);
    EXPECT_NE(other.host_address(), host);
  }
  for (const auto& link : links) EXPECT_EQ(::if_nametoindex(link.c_str()), 0U) << link;
  EXPECT_FALSE(host_has_address(host));
}

// Agents A and B standing for two nodes: each in a network namespace of its own (testing/
// node_network.h), asked by the test over TCP at its node's address, with its own socket,
// storage, state, run directory and node cache; both with the real docker-registry as their
// registry storage, listening at the host's address on the nodes' links. The source workloads
// run on node A, where A's CRIU finds their sockets; a copy's published port is node B's.
class AgentsAndRegistry : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CRIU();
    if (auto why = LocalRegistry::blocker()) GTEST_SKIP() << "skipped: " << *why;
    if (auto why = NodeNetwork::blocker()) GTEST_SKIP() << "skipped: " << *why;
    nodes_.emplace(2);
    LocalRegistry::Options options = registry_options();
    options.address = nodes_->host_address();
    registry_.emplace(registry_dir_, options);
    // Over TLS each test starts the agents with the settings it checks.
    if (!options.tls) start_agents(registry_args(a_dir_), registry_args(b_dir_));
  }
  void TearDown() override {
    if (HasFailure() && registry_) {
      std::fprintf(stderr, "agent A:\n%s\nagent B:\n%s\n", a_ ? a_->log().c_str() : "",
                   b_ ? b_->log().c_str() : "");
    }
  }
  // The registry's settings: plain HTTP here.
  virtual LocalRegistry::Options registry_options() const { return {}; }
  std::vector<std::string> registry_args(const TempDir& node) const {
    return {"--registry", registry_->ref("snapshots"), "--registry-plain-http", "--cache",
            (node / "cache").string()};
  }
  // Starts A and B on their nodes with these arguments; checks each is in its node's namespace,
  // neither in the host's nor in the other's.
  void start_agents(const std::vector<std::string>& a_args,
                    const std::vector<std::string>& b_args) {
    a_.emplace(a_dir_, a_args, &node_a());
    b_.emplace(b_dir_, b_args, &node_b());
    const ino_t host = net_namespace_of(::getpid());
    EXPECT_EQ(net_namespace_of(a_->pid()), node_a().inode());
    EXPECT_EQ(net_namespace_of(b_->pid()), node_b().inode());
    EXPECT_NE(node_a().inode(), host);
    EXPECT_NE(node_b().inode(), host);
    EXPECT_NE(node_a().inode(), node_b().inode());
  }
  const Node& node_a() const { return nodes_->node(0); }
  const Node& node_b() const { return nodes_->node(1); }
  // The test workload on node A, with these extra arguments.
  Workload workload_on_a(const std::vector<std::string>& extra) const {
    std::vector<std::string> argv = {build_path("tests/gpusnap-test-workload")};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Workload(a_dir_, node_a().enter(argv), std::chrono::seconds(30));
  }
  // One request line to 127.0.0.1:port on a node (a workload on A, a copy's published port on
  // B); "" when the connection fails.
  static std::string ask_on(const Node& node, uint16_t port, const std::string& line) {
    return node.run([&] { return ask(port, line); });
  }
  // A capture on A of `source`, pushed; its reference by digest.
  std::string capture_on_a(const std::string& name, pid_t pid) {
    auto cp = a_->run("/v1/checkpoints", {{"artifact", name}, {"pid", pid}});
    EXPECT_EQ(cp["state"], "succeeded") << cp.dump(2);
    return cp["result"].value("reference", "");
  }

  TempDir registry_dir_, a_dir_, b_dir_;
  std::optional<NodeNetwork> nodes_;  // before the agents: it outlives them
  std::optional<LocalRegistry> registry_;
  std::optional<Agent> a_, b_;
};

// Position of the phase `name` in an operation's phases (in the order they started); the
// list's size when it is not there.
size_t started_at(const std::vector<std::string>& names, const std::string& name) {
  return static_cast<size_t>(std::find(names.begin(), names.end(), name) - names.begin());
}

// The phases among `names` that start with `prefix` (or, with `others`, those that do not), in
// their order.
std::vector<std::string> phases_of(const std::vector<std::string>& names, const std::string& prefix,
                                   bool others = false) {
  std::vector<std::string> out;
  for (const auto& n : names) {
    if (n.starts_with(prefix) != others) out.push_back(n);
  }
  return out;
}

// A captures and pushes; B, which never saw the artifact, restores it while it still pulls it
// through its node cache (as `gpusnap restore oci://` does): the restore opens the snapshot as
// its first files arrive and awaits the rest, and the pull commits it only once the restore
// asked for it. The copy serves the captured state. Everything B wrote is root-only.
TEST_F(AgentsAndRegistry, ASnapshotCapturedOnOneNodeIsRestoredOnAnotherWhileItArrives) {
  Workload source = workload_on_a({"--mib", "16", "--children", "1"});
  ASSERT_EQ(ask_on(node_a(), source.port(), "INCR"), "1");
  const std::string seed = field(ask_on(node_a(), source.port(), "INFO"), "seed");

  auto cp = a_->run("/v1/checkpoints", {{"artifact", "snap"}, {"pid", source.pid()}});
  ASSERT_EQ(cp["state"], "succeeded") << cp.dump(2);
  EXPECT_EQ(phase_names(cp),
            (std::vector<std::string>{"resolve", "preflight", "dump", "checksum", "commit",
                                      "push-open", "push-upload", "push-manifest"}));
  const json& result = cp["result"];
  const std::string reference = result.value("reference", "");
  ASSERT_TRUE(reference.starts_with(registry_->ref("snapshots") + "@sha256:")) << result.dump(2);
  EXPECT_EQ(result["pushed"]["reference"], reference);
  EXPECT_GT(result["pushed"]["chunks_uploaded"].get<uint64_t>(), 0U);
  EXPECT_EQ(result["pushed"]["chunks_uploaded"], result["pushed"]["chunks"]);  // a new registry
  // The registry holds it under the name's tag and under the digest: the same snapshot.
  auto by_tag = gpusnap({"inspect", registry_->ref("snapshots:snap"), "--plain-http", "--json"});
  ASSERT_EQ(by_tag.exit_code, 0) << by_tag.err;
  EXPECT_EQ(json::parse(by_tag.out)["artifact"], reference);
  EXPECT_EQ(json::parse(by_tag.out)["id"], result["id"]);

  ASSERT_TRUE(entries(b_->storage()).empty());
  const size_t gets_before = blob_gets(*registry_);
  auto rs = b_->run("/v1/restores", {{"artifact", "snap"},
                                     {"reference", reference},
                                     {"publish", {std::to_string(source.port())}}});
  ASSERT_EQ(rs["state"], "succeeded") << rs.dump(2);
  // The pull's phases and the restore's, each in its order, interleaved: a snapshot without GPU
  // state is awaited whole before CRIU's restore (await-artifact), which lets the copy run.
  const auto names = phase_names(rs);
  std::printf("restore on B: %s\n", ::testing::PrintToString(names).c_str());
  EXPECT_EQ(phases_of(names, "pull-"),
            (std::vector<std::string>{"pull-manifest", "pull-fetch", "pull-write", "pull-commit",
                                      "pull-cache"}));
  EXPECT_EQ(phases_of(names, "pull-", true),
            (std::vector<std::string>{"open", "await-artifact", "verify", "criu-restore", "locate",
                                      "release"}));
  // The overlap: the restore opened the snapshot and awaited it while the pull still wrote
  // it, before the pull committed it (which waits for the restore's await-artifact).
  EXPECT_LT(started_at(names, "open"), started_at(names, "pull-commit"));
  EXPECT_LT(started_at(names, "await-artifact"), started_at(names, "pull-commit"));
  // The restore goes on once the pull has committed the snapshot; the node cache's record of it
  // (pull-cache) may run beside the restore's verify.
  EXPECT_GT(started_at(names, "verify"), started_at(names, "pull-commit"));
  const json& pulled = rs["result"]["pulled"];
  const auto hex = reference.substr(reference.find("@sha256:") + 8);
  EXPECT_EQ(pulled["reference"], reference);
  EXPECT_TRUE(pulled["pulled"].get<bool>());
  EXPECT_EQ(pulled["artifact"], (b_dir_ / "run" / "pulled" / hex).string());
  EXPECT_EQ(pulled["chunks_fetched"], result["pushed"]["chunks"]);
  EXPECT_EQ(pulled["chunks_from_cache"], 0);
  // Every chunk once, and the layout (the OCI config blob).
  EXPECT_EQ(blob_gets(*registry_) - gets_before, result["pushed"]["chunks"].get<size_t>() + 1);
  {
    Copies copies(rs["result"]);
    ASSERT_EQ(copies.copies.size(), 1U);
    EXPECT_EQ(field(ask_on(node_b(), copies.port(0), "INFO"), "seed"), seed);
    EXPECT_EQ(ask_on(node_b(), copies.port(0), "CHECK").substr(0, 2), "OK");
    EXPECT_EQ(ask_on(node_b(), copies.port(0), "INCR"), "2");  // the counter as captured
    EXPECT_EQ(ask(copies.port(0), "INFO"), "");  // published on node B, not on the host
  }
  EXPECT_TRUE(entries(b_->storage()).empty());  // B's storage holds only its own captures
  // B's node cache lists the snapshot by its digest.
  auto list = gpusnap({"list", "--cache", (b_dir_ / "cache").string(), "--json"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  ASSERT_EQ(json::parse(list.out)["snapshots"].size(), 1U) << list.out;
  EXPECT_EQ(json::parse(list.out)["snapshots"][0]["reference"], reference);
  EXPECT_EQ(not_root_only(b_dir_ / "cache"), std::vector<std::string>{});
  EXPECT_EQ(not_root_only(b_dir_ / "run" / "pulled"), std::vector<std::string>{});
  struct stat st {};
  ASSERT_EQ(::stat((b_dir_ / "cache").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700U);
  ASSERT_EQ(::stat((b_dir_ / "run" / "pulled").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700U);
}

// A second snapshot is prefetched on B ahead of its restore (an operation like the others);
// the restore then fetches nothing from the registry, by reference or by name.
TEST_F(AgentsAndRegistry, PrefetchWarmsTheNodeCacheAndTheRestoreFetchesNothing) {
  Workload source = workload_on_a({"--mib", "16"});
  ASSERT_EQ(ask_on(node_a(), source.port(), "INCR"), "1");
  const std::string first = capture_on_a("first", source.pid());
  ASSERT_FALSE(first.empty());
  ASSERT_EQ(ask_on(node_a(), source.port(), "INCR"), "2");
  const std::string second = capture_on_a("second", source.pid());
  ASSERT_FALSE(second.empty());
  ASSERT_NE(first, second);

  // B restores the first: every chunk fetched.
  const json publish = {std::to_string(source.port())};
  auto rs =
      b_->run("/v1/restores", {{"artifact", "first"}, {"reference", first}, {"publish", publish}});
  ASSERT_EQ(rs["state"], "succeeded") << rs.dump(2);
  EXPECT_GT(rs["result"]["pulled"]["chunks_fetched"].get<uint64_t>(), 0U);
  { Copies ended(rs["result"]); }  // B only warms up for the second

  // Prefetch of the second: accepted as an operation, polled to its end.
  auto accepted = b_->post("/v1/prefetch", {{"reference", second}});
  ASSERT_EQ(accepted.status, 202) << accepted.body;
  const json& op = accepted.doc["operation"];
  EXPECT_EQ(op["kind"], "prefetch");
  EXPECT_EQ(op["state"], "pending");
  EXPECT_EQ(op["request"], (json{{"reference", second}}));
  auto pf = b_->wait_operation(op["id"].get<std::string>());
  ASSERT_EQ(pf["state"], "succeeded") << pf.dump(2);
  EXPECT_EQ(phase_names(pf), (std::vector<std::string>{"pull-manifest", "pull-fetch", "pull-write",
                                                       "pull-commit", "pull-cache"}));
  const json& warmed = pf["result"];
  EXPECT_TRUE(warmed["pulled"].get<bool>());
  EXPECT_EQ(warmed["reference"], second);
  // The two captures of one workload share chunks: those came from B's cache, not the registry.
  EXPECT_GT(warmed["chunks_from_cache"].get<uint64_t>(), 0U) << warmed.dump(2);
  const uint64_t fetched = warmed["chunks_fetched"].get<uint64_t>();
  std::printf("prefetch: %llu chunks fetched, %llu from the node cache\n",
              static_cast<unsigned long long>(fetched),
              static_cast<unsigned long long>(warmed["chunks_from_cache"].get<uint64_t>()));

  // The restore of the second fetches nothing: not a chunk, not even its manifest.
  const size_t gets = blob_gets(*registry_);
  const std::string log_before = registry_->log();
  auto again = b_->run("/v1/restores",
                       {{"artifact", "second"}, {"reference", second}, {"publish", publish}});
  ASSERT_EQ(again["state"], "succeeded") << again.dump(2);
  // The node's copy is verified as it is found (a damaged one would be pulled again), and the
  // restore does not read it a second time.
  EXPECT_EQ(phase_names(again),
            (std::vector<std::string>{"pull-verify", "open", "criu-restore", "locate", "release"}));
  EXPECT_FALSE(again["result"]["pulled"]["pulled"].get<bool>());
  EXPECT_EQ(again["result"]["pulled"]["chunks_fetched"], 0);
  EXPECT_EQ(registry_->log(), log_before);
  {
    Copies copies(again["result"]);
    ASSERT_EQ(copies.copies.size(), 1U);
    EXPECT_EQ(ask_on(node_b(), copies.port(0), "INCR"), "3");  // captured at 2
  }
  // By name alone, the tag is resolved (manifest and layout) and no chunk moves.
  auto by_name = b_->run("/v1/restores", {{"artifact", "first"}});
  ASSERT_EQ(by_name["state"], "succeeded") << by_name.dump(2);
  EXPECT_EQ(by_name["result"]["pulled"]["reference"], first);
  EXPECT_FALSE(by_name["result"]["pulled"]["pulled"].get<bool>());
  EXPECT_EQ(blob_gets(*registry_) - gets, 1U);  // the layout (the OCI config blob) only
  { Copies ended(by_name["result"]); }

  const std::string metrics = b_->get("/metrics").body;
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_total{kind="prefetch",result="succeeded"})"), 1);
  // B's registry counters are the sums of what its two pulls reported (the restore's while it
  // restored, the prefetch's); the restores that found their copy added nothing.
  const json& restored = rs["result"]["pulled"];
  const auto sum = [&](const char* key) {
    return static_cast<double>(restored[key].get<uint64_t>() + warmed[key].get<uint64_t>());
  };
  EXPECT_EQ(sample(metrics, R"(gpusnap_registry_chunks_total{direction="pull"})"),
            sum("chunks_fetched"));
  EXPECT_EQ(sample(metrics, R"(gpusnap_registry_bytes_total{direction="pull"})"),
            sum("bytes_fetched"));
  EXPECT_EQ(sample(metrics, "gpusnap_node_cache_misses_total"), sum("chunks_fetched"));
  EXPECT_EQ(sample(metrics, "gpusnap_node_cache_hits_total"), sum("chunks_from_cache"));
  EXPECT_EQ(sample(metrics, "gpusnap_node_cache_hit_bytes_total"), sum("bytes_from_cache"));
  EXPECT_EQ(sample(metrics, R"(gpusnap_registry_chunks_total{direction="push"})"), 0);
  // A pushed both captures and pulled nothing.
  const std::string a_metrics = a_->get("/metrics").body;
  EXPECT_GT(sample(a_metrics, R"(gpusnap_registry_chunks_total{direction="push"})"), 0);
  EXPECT_GT(sample(a_metrics, R"(gpusnap_registry_bytes_total{direction="push"})"), 0);
  EXPECT_EQ(sample(a_metrics, R"(gpusnap_registry_chunks_total{direction="pull"})"), 0);
  EXPECT_EQ(not_root_only(b_dir_ / "cache"), std::vector<std::string>{});
  EXPECT_EQ(not_root_only(b_dir_ / "run" / "pulled"), std::vector<std::string>{});
}

// B is killed (SIGKILL) while it pulls: nothing half-pulled is visible, the restarted agent
// reports the prefetch failed and removes what the pull left, and the prefetch again takes the
// chunks already fetched from the node cache: a killed pull resumes.
TEST_F(AgentsAndRegistry, AKilledPullLeavesNothingAndThePrefetchAgainResumes) {
  Workload source = workload_on_a({"--mib", "384"});
  const std::string reference = capture_on_a("big", source.pid());
  ASSERT_FALSE(reference.empty());
  auto accepted = b_->post("/v1/prefetch", {{"reference", reference}});
  ASSERT_EQ(accepted.status, 202) << accepted.body;
  const std::string id = accepted.doc["operation"]["id"];
  // Killed once some chunks, not all, have arrived.
  ASSERT_TRUE(eventually(
      [&] {
        const json progress = b_->get("/v1/operations/" + id).doc.value("progress", json());
        return progress.is_object() && progress.value("phase", "") == "pull-fetch" &&
               progress.value("done", 0ULL) > 0 &&
               progress.value("done", 0ULL) < progress.value("total", 0ULL);
      },
      std::chrono::seconds(60)));
  b_->kill();
  const auto pulled = b_dir_ / "run" / "pulled";
  for (const auto& name : entries(pulled)) EXPECT_EQ(name[0], '.') << name;  // staging only
  const auto partial = entries(pulled);
  ASSERT_FALSE(partial.empty());
  b_->start();
  // The dead pull's staging stays, hidden: its uncompressed chunks are written nowhere else.
  EXPECT_EQ(entries(pulled), partial);
  auto op = b_->get("/v1/operations/" + id).doc;
  EXPECT_EQ(op["state"], "failed") << op.dump(2);
  // The phase is the pull's innermost (fetch, or the writing of the files it runs).
  const std::string message = op["error"].value("message", "");
  EXPECT_TRUE(message.starts_with("the agent restarted during the prefetch of " + reference +
                                  " (phase pull-"))
      << message;
  EXPECT_TRUE(message.ends_with("); nothing half-pulled is visible, and the chunks it had "
                                "fetched stay in the node cache"))
      << message;

  auto again = b_->run("/v1/prefetch", {{"reference", reference}});
  ASSERT_EQ(again["state"], "succeeded") << again.dump(2);
  EXPECT_GT(again["result"]["chunks_from_cache"].get<uint64_t>(), 0U) << again.dump(2);
  // Read from the dead pull's staging, which then goes: the copy alone is left.
  EXPECT_EQ(entries(pulled),
            std::vector<std::string>{again["result"]["reference"].get<std::string>().substr(
                again["result"]["reference"].get<std::string>().find("sha256:") + 7)});
  std::printf(
      "after the kill: %llu chunks fetched, %llu from the node cache\n",
      static_cast<unsigned long long>(again["result"]["chunks_fetched"].get<uint64_t>()),
      static_cast<unsigned long long>(again["result"]["chunks_from_cache"].get<uint64_t>()));
  EXPECT_EQ(gpusnap({"verify", again["result"]["artifact"].get<std::string>()}).exit_code, 0);
  EXPECT_EQ(not_root_only(pulled), std::vector<std::string>{});
}

// A prefetch that fails part way (the registry serves its last chunk damaged, which the pull
// refuses by its digest) has moved the chunks before it: the registry counters count each chunk
// as it arrives, not when the pull ends, so the failure's cost shows.
TEST_F(AgentsAndRegistry, APrefetchThatFailsPartWayCountsTheChunksItMoved) {
  Workload source = workload_on_a({"--mib", "48"});
  const std::string reference = capture_on_a("damaged", source.pid());
  ASSERT_FALSE(reference.empty());
  httplib::Client client(registry_->host());
  auto got = client.Get("/v2/snapshots/manifests/" + reference.substr(reference.find('@') + 1),
                        {{"Accept", "application/vnd.oci.image.manifest.v1+json"}});
  ASSERT_TRUE(got && got->status == 200);
  const json layers = json::parse(got->body).at("layers");  // the layout, then the chunks
  ASSERT_GT(layers.size(), 3U);
  const auto data = registry_->blob_data(layers.back().at("digest"));
  std::string bytes = fs::read_file(data);
  ASSERT_FALSE(bytes.empty());
  bytes[bytes.size() / 2] ^= 0x5a;
  fs::write_file(data, bytes);

  auto op = b_->run("/v1/prefetch", {{"reference", reference}});
  ASSERT_EQ(op["state"], "failed") << op.dump(2);
  const std::string metrics = b_->get("/metrics").body;
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_total{kind="prefetch",result="failed"})"), 1);
  const double chunks = sample(metrics, R"(gpusnap_registry_chunks_total{direction="pull"})");
  EXPECT_GT(chunks, 0) << metrics;
  EXPECT_LT(chunks, static_cast<double>(layers.size() - 1)) << metrics;  // not the damaged one
  EXPECT_GT(sample(metrics, R"(gpusnap_registry_bytes_total{direction="pull"})"), chunks);
  EXPECT_EQ(sample(metrics, "gpusnap_node_cache_misses_total"), chunks);
}

// A `gpusnap pull` on B's node and B's prefetch of the same snapshot at once take turns on it
// (the lock under RUN_DIR/locks): the prefetch waits for the pull, then finds its copy and
// fetches nothing; no staging is left.
TEST_F(AgentsAndRegistry, APullAndAPrefetchOfOneSnapshotOnOneNodeTakeTurns) {
  Workload source = workload_on_a({"--mib", "48"});
  const std::string reference = capture_on_a("turns", source.pid());
  ASSERT_FALSE(reference.empty());
  const auto pulled = b_dir_ / "run" / "pulled";
  const auto out = b_dir_ / "pull.out";
  common::UniqueFd out_fd(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  common::SpawnOptions o;
  o.argv = {gpusnap_bin(),
            "pull",
            reference,
            "--run-dir",
            (b_dir_ / "run").string(),
            "--cache",
            (b_dir_ / "cache").string(),
            "--plain-http",
            "--max-rate-mib",
            "16",
            "--json",
            "-q"};
  o.stdout_fd = out_fd.get();
  common::Subprocess cli(o);
  // The prefetch asks once the pull is writing.
  ASSERT_TRUE(eventually(
      [&] {
        for (const auto& name : entries(pulled)) {
          if (name[0] == '.') return true;
        }
        return false;
      },
      std::chrono::seconds(60)));
  auto pf = b_->run("/v1/prefetch", {{"reference", reference}});
  auto status = cli.wait(std::chrono::minutes(2));
  ASSERT_TRUE(status && status->ok()) << fs::read_file(out);
  ASSERT_EQ(pf["state"], "succeeded") << pf.dump(2);
  EXPECT_FALSE(pf["result"]["pulled"].get<bool>()) << pf.dump(2);
  EXPECT_EQ(pf["result"]["chunks_fetched"], 0);
  EXPECT_NE(pf["result"]["notes"].dump().find("waiting for another pull of sha256:"),
            std::string::npos)
      << pf.dump(2);
  EXPECT_GT(json::parse(fs::read_file(out))["chunks_fetched"].get<uint64_t>(), 0U);
  EXPECT_EQ(entries(pulled),
            std::vector<std::string>{reference.substr(reference.find("sha256:") + 7)});
}

// Prefetch requests are bounded and checked like every other request, and a reference outside
// the agent's own repository is refused before anything is queued.
TEST_F(AgentsAndRegistry, PrefetchRequestsAreValidatedAndBounded) {
  auto expect_usage = [&](const Answer& a, const std::string& message) {
    EXPECT_EQ(a.status, 400) << a.body;
    EXPECT_EQ(a.doc["error"]["kind"], "usage") << a.body;
    EXPECT_EQ(a.doc["error"]["message"], message) << a.body;
  };
  expect_usage(b_->post("/v1/prefetch", {{"reference", "oci://elsewhere:5000/snapshots:x"}}),
               "reference oci://elsewhere:5000/snapshots:x is not in the agent's registry "
               "storage " +
                   registry_->ref("snapshots"));
  expect_usage(b_->post("/v1/prefetch", {{"reference", registry_->ref("Snapshots:x")}}),
               "bad reference '" + registry_->ref("Snapshots:x") +
                   "': the repository is not lower-case letters, digits and . _ - / as OCI "
                   "allows");
  expect_usage(b_->post("/v1/prefetch", {{"artifact", "x@y"}}),
               "artifact name 'x@y' cannot be a registry tag, which the agent's registry storage "
               "needs");
  expect_usage(
      b_->post("/v1/prefetch", {{"reference", registry_->ref("snapshots:x")}, {"artifact", "x"}}),
      "a prefetch request names either \"artifact\" or \"reference\", not both");
  expect_usage(b_->post("/v1/restores", {{"artifact", "x"}, {"reference", "oci://h/r:x"}}),
               "reference oci://h/r:x is not in the agent's registry storage " +
                   registry_->ref("snapshots"));
  const std::string deep = std::string(80000, '[') + std::string(80000, ']');
  expect_usage(b_->request("POST", "/v1/prefetch", nullptr, deep),
               "the request body is not JSON: nested deeper than 64 levels");
  EXPECT_EQ(b_->get("/v1/prefetch").status, 405);
  // A tag the registry does not have: accepted, and the operation says what is missing.
  auto missing = b_->run("/v1/prefetch", {{"artifact", "never-pushed"}});
  ASSERT_EQ(missing["state"], "failed") << missing.dump(2);
  EXPECT_EQ(missing["error"]["kind"], "not-found") << missing.dump(2);
  EXPECT_EQ(b_->get("/v1/healthz").status, 200);
  EXPECT_TRUE(entries(b_dir_ / "run" / "pulled").empty());

  // An agent without registry storage refuses a prefetch and a restore by reference.
  TempDir plain_dir;
  Agent plain(plain_dir);
  const std::string needs = " needs registry storage, which this agent has not";
  expect_usage(plain.post("/v1/prefetch", {{"artifact", "x"}}), "a prefetch" + needs);
  expect_usage(plain.post("/v1/restores", {{"artifact", "x"}, {"reference", "oci://h/r:x"}}),
               "a restore from a reference" + needs);
}

// A pushes its capture encrypted for B's key (--encrypt); B without a key refuses the restore
// (exit 12, naming the fix), nothing pulled; B with its key, read from a directory laid out as a
// mounted Secret, restores the copy as captured. The registry's copy opens for no one else.
TEST_F(AgentsAndRegistry, AnEncryptedCaptureIsRestoredOnlyByTheNodeWithTheKey) {
  const std::filesystem::path keys = b_dir_ / "keys";
  const std::filesystem::path data = keys / "..data";
  std::filesystem::create_directories(data);
  for (const auto& argv : std::vector<std::vector<std::string>>{
           {"openssl", "genpkey", "-algorithm", "X25519", "-out", (data / "node.pem").string()},
           {"openssl", "pkey", "-in", (data / "node.pem").string(), "-pubout", "-out",
            (a_dir_ / "node-b.pub").string()}}) {
    auto r = common::run_capture(argv);
    ASSERT_TRUE(r.status.ok()) << r.output;
  }
  std::filesystem::permissions(data / "node.pem", std::filesystem::perms::owner_read,
                               std::filesystem::perm_options::replace);
  std::filesystem::create_symlink("..data/node.pem", keys / "node.pem");
  auto with = [](std::vector<std::string> args, const std::vector<std::string>& more) {
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  a_.reset();
  b_.reset();
  const auto a_args = with(registry_args(a_dir_), {"--encrypt", (a_dir_ / "node-b.pub").string(),
                                                   "--dedup-secret", (a_dir_ / "dedup").string()});
  start_agents(a_args, registry_args(b_dir_));
  Workload source = workload_on_a({"--mib", "16"});
  ASSERT_EQ(ask_on(node_a(), source.port(), "INCR"), "1");
  const std::string reference = capture_on_a("snap", source.pid());
  ASSERT_TRUE(reference.starts_with(registry_->ref("snapshots") + "@sha256:")) << reference;

  auto refused = b_->run("/v1/restores", {{"artifact", "snap"}, {"reference", reference}});
  ASSERT_EQ(refused["state"], "failed") << refused.dump(2);
  EXPECT_EQ(refused["error"]["kind"], "key");
  EXPECT_EQ(refused["error"]["exit_code"], 12);
  EXPECT_NE(refused["error"]["message"].get<std::string>().find(" is encrypted (for sha256:"),
            std::string::npos)
      << refused.dump(2);
  EXPECT_FALSE(std::filesystem::exists(b_dir_ / "run" / "pulled" /
                                       reference.substr(reference.find('@') + 8)));

  b_.reset();
  start_agents(a_args, with(registry_args(b_dir_), {"--decryption-key", keys.string()}));
  const std::string same_port = std::to_string(source.port()) + ":" + std::to_string(source.port());
  auto rs = b_->run("/v1/restores",
                    {{"artifact", "snap"}, {"reference", reference}, {"publish", {same_port}}});
  ASSERT_EQ(rs["state"], "succeeded") << rs.dump(2);
  Copies copies(rs["result"]);
  ASSERT_EQ(copies.copies.size(), 1U);
  EXPECT_EQ(ask_on(node_b(), copies.port(0), "INCR"), "2");  // the counter as captured
  // B's log names its key by file and fingerprint, never by its bytes.
  const std::string log = b_->log();
  EXPECT_NE(log.find("decryption keys " + (keys / "node.pem").string() + " (sha256:"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("PRIVATE KEY"), std::string::npos);
}

// The two nodes with the registry over TLS (a certificate from a self-signed CA) and htpasswd
// basic authentication, the tests/store fixture's; the agents get the CA with
// --registry-ca-file and the credentials with --registry-auth-file, as from the chart's Secret.
// The registry sends its blobs' GETs to object storage on another host by redirect (a
// recording server of the test's own, serving the registry's storage), and wants basic
// authentication: what RegistryTransport.ARedirectedBlobGoesOnWithoutThePassword checks of the
// transport, checked here of the agent's pulls and the CLI's.
class AgentsAndARedirectingRegistry : public AgentsAndRegistry {
 protected:
  static constexpr const char* kPassword = "s3cret-pass";
  void SetUp() override {
    // Before the registry, whose configuration names it; on every address of the host, so the
    // nodes reach it at the host's address on their links.
    storage_.emplace(
        [this](const httplib::Request& req, httplib::Response& res) {
          if (!registry_) {
            res.status = 503;
            return;
          }
          serve_files(registry_->storage())(req, res);
        },
        "0.0.0.0");
    AgentsAndRegistry::SetUp();
  }
  LocalRegistry::Options registry_options() const override {
    const std::string target = storage_->host();
    return {.username = "gpusnap",
            .password = kPassword,
            .extra_config = redirect_middleware("http://" + nodes_->host_address() +
                                                target.substr(target.find(':')) + "/")};
  }
  // A node's registry arguments with its auth.json.
  std::vector<std::string> auth_args(const TempDir& node) const {
    write(
        node / "auth.json",
        json{{"auths", {{registry_->host(), {{"auth", "Z3B1c25hcDpzM2NyZXQtcGFzcw=="}}}}}}.dump());
    std::vector<std::string> args = registry_args(node);
    args.insert(args.end(), {"--registry-auth-file", (node / "auth.json").string()});
    return args;
  }
  std::optional<RecordingServer> storage_;
};

// A pushes with the password; B's prefetch and a `gpusnap pull` on the host fetch every chunk
// from the object storage the registry redirects to, and not one of those requests carries the
// registry's password. The copies are whole.
TEST_F(AgentsAndARedirectingRegistry, ChunksFollowTheRedirectWithoutThePasswordForAgentAndCli) {
  start_agents(auth_args(a_dir_), auth_args(b_dir_));
  Workload source = workload_on_a({"--mib", "16"});
  const std::string reference = capture_on_a("snap", source.pid());
  ASSERT_FALSE(reference.empty());
  ASSERT_TRUE(storage_->seen().empty());  // a push is not redirected

  auto warmed = b_->run("/v1/prefetch", {{"reference", reference}});
  ASSERT_EQ(warmed["state"], "succeeded") << warmed.dump(2);
  const uint64_t chunks = warmed["result"]["chunks_fetched"].get<uint64_t>();
  ASSERT_GT(chunks, 0U);
  const size_t by_agent = storage_->seen().size();
  EXPECT_GT(by_agent, chunks);  // every chunk, and the layout
  EXPECT_EQ(gpusnap({"verify", warmed["result"]["artifact"].get<std::string>()}).exit_code, 0);

  const auto out = b_dir_ / "by-cli";
  auto pulled =
      gpusnap({"pull", reference, "-o", out.string(), "--plain-http", "--auth-file",
               (b_dir_ / "auth.json").string(), "--cache", (b_dir_ / "cli-cache").string(), "-q"});
  ASSERT_EQ(pulled.exit_code, 0) << pulled.err;
  EXPECT_GT(storage_->seen().size(), by_agent + chunks);
  EXPECT_EQ(gpusnap({"verify", out.string()}).exit_code, 0);

  for (const auto& s : storage_->seen()) {
    EXPECT_EQ(s.method, "GET") << s.path;
    EXPECT_EQ(s.authorization, "") << s.method << " " << s.path;
  }
  // The registry itself had the password on what it served: its log names the user.
  EXPECT_NE(registry_->log().find("auth.user.name=gpusnap"), std::string::npos);
}

class AgentsAndRegistryOverTls : public AgentsAndRegistry {
 protected:
  static constexpr const char* kPassword = "s3cret-pass";
  LocalRegistry::Options registry_options() const override {
    return {.tls = true, .username = "gpusnap", .password = kPassword};
  }
  // A node's registry arguments: its auth.json holding `password` for the registry's host (in
  // the `auth` form skopeo and podman write: base64 of user:password, else as username and
  // password), and the CA unless `with_ca` is false.
  std::vector<std::string> tls_args(const TempDir& node, const std::string& password,
                                    bool with_ca) const {
    const json entry = password == kPassword
                           ? json{{"auth", "Z3B1c25hcDpzM2NyZXQtcGFzcw=="}}  // gpusnap:s3cret-pass
                           : json{{"username", "gpusnap"}, {"password", password}};
    write(node / "auth.json", json{{"auths", {{registry_->host(), entry}}}}.dump());
    std::vector<std::string> args = {"--registry",
                                     registry_->ref("snapshots"),
                                     "--registry-auth-file",
                                     (node / "auth.json").string(),
                                     "--cache",
                                     (node / "cache").string()};
    if (with_ca) args.insert(args.end(), {"--registry-ca-file", registry_->ca_file().string()});
    return args;
  }
};

// A captures and pushes over TLS with its credentials; B, with the same CA and credentials,
// pulls and restores on its node; the registry saw the user on every request it served.
TEST_F(AgentsAndRegistryOverTls, ACaptureIsPushedAndRestoredWithTheCaAndTheCredentials) {
  start_agents(tls_args(a_dir_, kPassword, true), tls_args(b_dir_, kPassword, true));
  Workload source = workload_on_a({"--mib", "16"});
  ASSERT_EQ(ask_on(node_a(), source.port(), "INCR"), "1");
  const std::string reference = capture_on_a("snap", source.pid());
  ASSERT_TRUE(reference.starts_with(registry_->ref("snapshots") + "@sha256:")) << reference;

  // Published on node B at the port the source holds on node A: the nodes' ports are apart.
  const std::string same_port = std::to_string(source.port()) + ":" + std::to_string(source.port());
  auto rs = b_->run("/v1/restores",
                    {{"artifact", "snap"}, {"reference", reference}, {"publish", {same_port}}});
  ASSERT_EQ(rs["state"], "succeeded") << rs.dump(2);
  const json& pulled = rs["result"]["pulled"];
  EXPECT_TRUE(pulled["pulled"].get<bool>());
  EXPECT_EQ(pulled["reference"], reference);
  EXPECT_GT(pulled["chunks_fetched"].get<uint64_t>(), 0U);
  {
    Copies copies(rs["result"]);
    ASSERT_EQ(copies.copies.size(), 1U);
    EXPECT_EQ(copies.port(0), source.port());
    EXPECT_EQ(ask_on(node_b(), copies.port(0), "INCR"), "2");  // the counter as captured
    EXPECT_EQ(ask_on(node_a(), source.port(), "INCR"), "2");   // and the source its own
  }
  // The registry knew the user, and refused nothing: the credentials went with every request.
  const std::string log = registry_->log();
  EXPECT_GT(blob_gets(*registry_), 0U);
  EXPECT_NE(log.find("auth.user.name=gpusnap"), std::string::npos) << log;
  EXPECT_EQ(log.find("\" 401 "), std::string::npos) << log;
  EXPECT_EQ(log.find("\" 403 "), std::string::npos) << log;
}

// A with the wrong password: its capture stays in its storage, the push is refused, and the
// operation says so and how to mend it; the workload serves on. B without the CA: its restore
// fails at the first exchange with the registry, naming TLS and the setting, and nothing is
// pulled or restored. Neither agent is harmed: both answer after.
TEST_F(AgentsAndRegistryOverTls, WrongCredentialsOrNoCaFailTheRequestAndNothingIsRestored) {
  start_agents(tls_args(a_dir_, "not-the-password", true), tls_args(b_dir_, kPassword, false));
  Workload source = workload_on_a({"--mib", "16"});
  ASSERT_EQ(ask_on(node_a(), source.port(), "INCR"), "1");
  auto cp = a_->run("/v1/checkpoints", {{"artifact", "snap"}, {"pid", source.pid()}});
  ASSERT_EQ(cp["state"], "failed") << cp.dump(2);
  EXPECT_TRUE(cp["result"].is_null()) << cp.dump(2);
  EXPECT_EQ(cp["error"]["kind"], "environment") << cp.dump(2);
  const std::string pushed_message = cp["error"].value("message", "");
  EXPECT_TRUE(pushed_message.starts_with("captured into " + (a_->storage() / "snap").string() +
                                         ", but the push to " + registry_->ref("snapshots") +
                                         " failed: registry " + registry_->host() + " refused to "))
      << pushed_message;
  EXPECT_TRUE(pushed_message.ends_with(" (HTTP 401)")) << pushed_message;
  // The hint names the file the credentials came from.
  EXPECT_TRUE(cp["error"].value("hint", "").starts_with("check the credentials in /"))
      << cp.dump(2);
  EXPECT_TRUE(cp["error"].value("hint", "").ends_with("auth.json")) << cp.dump(2);
  EXPECT_EQ(ask_on(node_a(), source.port(), "INCR"), "2");  // not left frozen

  // The capture, pushed by hand with the right settings, for B to try.
  write(a_dir_ / "right.json",
        json{{"auths", {{registry_->host(), {{"auth", "Z3B1c25hcDpzM2NyZXQtcGFzcw=="}}}}}}.dump());
  auto push = gpusnap({"push", (a_->storage() / "snap").string(), registry_->ref("snapshots:snap"),
                       "--ca-file", registry_->ca_file().string(), "--auth-file",
                       (a_dir_ / "right.json").string(), "--json"});
  ASSERT_EQ(push.exit_code, 0) << push.err;
  const std::string reference = json::parse(push.out)["reference"];

  // Were a copy restored, it would serve at the source's port on node B.
  const std::string same_port = std::to_string(source.port()) + ":" + std::to_string(source.port());
  auto rs = b_->run("/v1/restores",
                    {{"artifact", "snap"}, {"reference", reference}, {"publish", {same_port}}});
  ASSERT_EQ(rs["state"], "failed") << rs.dump(2);
  EXPECT_TRUE(rs["result"].is_null()) << rs.dump(2);
  EXPECT_EQ(rs["error"]["kind"], "environment") << rs.dump(2);
  const std::string pull_message = rs["error"].value("message", "");
  EXPECT_TRUE(pull_message.starts_with("registry " + registry_->host() + ": TLS failed ("))
      << pull_message;
  EXPECT_EQ(rs["error"]["hint"], "give the registry's CA with --registry-ca-file, or "
                                 "--registry-plain-http for a registry without TLS")
      << rs.dump(2);
  EXPECT_EQ(ask_on(node_b(), source.port(), "INFO"), "");  // no copy serves on node B
  EXPECT_EQ(entries(b_dir_ / "run" / "pulled"), std::vector<std::string>{});
  EXPECT_EQ(entries(b_->storage()), std::vector<std::string>{});

  // A's wrong password fails a pull too, before anything is fetched.
  auto pf = a_->run("/v1/prefetch", {{"reference", reference}});
  ASSERT_EQ(pf["state"], "failed") << pf.dump(2);
  EXPECT_EQ(pf["error"]["kind"], "environment") << pf.dump(2);
  EXPECT_TRUE(pf["error"].value("message", "").ends_with(" (HTTP 401)")) << pf.dump(2);
  EXPECT_EQ(entries(a_dir_ / "run" / "pulled"), std::vector<std::string>{});
  EXPECT_EQ(a_->get("/v1/healthz").status, 200);
  EXPECT_EQ(b_->get("/v1/healthz").status, 200);
}

// A front for a real registry that relays each request to it, one request a connection, and
// sends the registry's answers to GET requests (manifests and blobs: what a pull reads) back one
// byte a second, as a registry behind a congested or throttled link does. Uploads and their
// answers pass at full speed, so that a push through the front is as fast as without it.
class TricklingFront {
 public:
  explicit TricklingFront(const LocalRegistry& registry)
      : registry_port_(static_cast<uint16_t>(
            std::stoi(registry.host().substr(registry.host().rfind(':') + 1)))) {
    listener_ = common::UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof addr;
    if (!listener_ || ::bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), size) != 0 ||
        ::listen(listener_.get(), 64) != 0 ||
        ::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &size) != 0) {
      throw std::runtime_error("the trickling front cannot listen");
    }
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::jthread([this](const std::stop_token& stop) { accept(stop); });
  }

  // oci://127.0.0.1:PORT/REPO, through the front.
  std::string ref(const std::string& repo) const {
    return "oci://127.0.0.1:" + std::to_string(port_) + "/" + repo;
  }
  // GET answers being sent now, byte by byte.
  int trickling() const { return trickling_; }

 private:
  void accept(const std::stop_token& stop) {
    while (!stop.stop_requested()) {
      pollfd p{listener_.get(), POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      auto client = std::make_shared<common::UniqueFd>(
          ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!*client) continue;
      connections_.emplace_back(
          [this, client](const std::stop_token& s) { serve(client->get(), s); });
    }
  }

  void serve(int client, const std::stop_token& stop) {
    // The request head, then the same head to the registry with "Connection: close".
    std::string data;
    char buf[65536];
    size_t end = std::string::npos;
    while (end == std::string::npos) {
      pollfd p{client, POLLIN, 0};
      if (stop.stop_requested()) return;
      if (::poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = ::recv(client, buf, sizeof buf, 0);
      if (n <= 0) return;
      data.append(buf, static_cast<size_t>(n));
      end = data.find("\r\n\r\n");
    }
    const bool trickle = data.rfind("GET ", 0) == 0;
    std::string head;
    for (size_t at = 0; at < end;) {
      const size_t eol = std::min(data.find("\r\n", at), end);
      std::string line = data.substr(at, eol - at);
      at = eol + 2;
      std::string lower = line;
      std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
      if (lower.rfind("connection:", 0) != 0) head += line + "\r\n";
    }
    head += "Connection: close\r\n\r\n" + data.substr(end + 4);
    common::UniqueFd server(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(registry_port_);
    if (::connect(server.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::send(server.get(), head.data(), head.size(), MSG_NOSIGNAL) !=
            static_cast<ssize_t>(head.size())) {
      return;
    }
    // Both ways until the registry has answered and closed, and its answer is all sent.
    if (trickle) ++trickling_;
    std::string answer;  // read from the registry, not yet sent
    bool server_open = true;
    auto next_byte = std::chrono::steady_clock::now();
    while (!stop.stop_requested() && (server_open || !answer.empty())) {
      pollfd p[2] = {{server_open ? server.get() : -1, POLLIN, 0}, {client, POLLIN, 0}};
      ::poll(p, 2, 100);
      if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const ssize_t n = ::recv(server.get(), buf, sizeof buf, 0);
        if (n <= 0) server_open = false;
        if (n > 0) answer.append(buf, static_cast<size_t>(n));
      }
      if ((p[1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const ssize_t n = ::recv(client, buf, sizeof buf, 0);
        if (n <= 0) break;  // the caller left
        ::send(server.get(), buf, static_cast<size_t>(n), MSG_NOSIGNAL);
      }
      const size_t bytes = trickle ? 1 : answer.size();
      if (answer.empty() || std::chrono::steady_clock::now() < next_byte) continue;
      if (::send(client, answer.data(), bytes, MSG_NOSIGNAL) != static_cast<ssize_t>(bytes)) break;
      answer.erase(0, bytes);
      next_byte = std::chrono::steady_clock::now() + std::chrono::seconds(trickle ? 1 : 0);
    }
    if (trickle) --trickling_;
  }

  uint16_t registry_port_;
  uint16_t port_ = 0;
  common::UniqueFd listener_;
  std::atomic<int> trickling_{0};
  // The acceptor alone adds to it; joined after the acceptor (declared before it).
  std::list<std::jthread> connections_;
  std::jthread acceptor_;
};

// An agent whose registry storage is a real registry behind a TricklingFront: its prefetches
// trickle, its pushes do not.
class AgentBesideATricklingRegistry : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_CRIU();
    if (auto why = LocalRegistry::blocker()) GTEST_SKIP() << "skipped: " << *why;
    registry_.emplace(registry_dir_, LocalRegistry::Options{});
    front_.emplace(*registry_);
  }
  std::vector<std::string> args(std::vector<std::string> more = {}) const {
    std::vector<std::string> out = {"--registry", front_->ref("snapshots"), "--registry-plain-http",
                                    "--cache", (dir_ / "cache").string()};
    out.insert(out.end(), more.begin(), more.end());
    return out;
  }
  // Posts a prefetch the registry does not have, and waits until the front trickles its answer
  // (a 404 of some 150 bytes: two and a half minutes) beside the `before` it trickled already,
  // and the operation runs.
  std::string held_prefetch(const Agent& agent, int before = 0) const {
    auto a = agent.post("/v1/prefetch", {{"artifact", "trickled"}});
    EXPECT_EQ(a.status, 202) << a.body;
    const std::string id = a.doc["operation"].value("id", "");
    EXPECT_TRUE(eventually(
        [&] {
          return front_->trickling() == before + 1 &&
                 agent.get("/v1/operations/" + id).doc.value("state", "") == "running";
        },
        std::chrono::seconds(30)))
        << agent.log();
    return id;
  }

  TempDir registry_dir_, dir_;
  std::optional<LocalRegistry> registry_;
  std::optional<TricklingFront> front_;
};

// A prefetch from a trickling registry held the agent's single queue, and a checkpoint stayed
// pending for 50 s and more behind it. Prefetches now have a lane of their own.
TEST_F(AgentBesideATricklingRegistry, ACheckpointAndARestoreDoNotWaitBehindAPrefetch) {
  Agent agent(dir_, args());
  Workload source(dir_, {"--mib", "16"});
  const std::string prefetch = held_prefetch(agent);

  const auto since = std::chrono::steady_clock::now();
  auto cp = agent.run("/v1/checkpoints", {{"artifact", "snap"}, {"pid", source.pid()}});
  ASSERT_EQ(cp["state"], "succeeded") << cp.dump(2);
  EXPECT_NE(cp["result"].value("reference", ""), "") << cp.dump(2);  // pushed, at full speed
  auto rs = agent.run("/v1/restores",
                      {{"artifact", "snap"}, {"publish", {std::to_string(source.port())}}});
  ASSERT_EQ(rs["state"], "succeeded") << rs.dump(2);
  Copies copies(rs["result"]);
  const auto took = std::chrono::steady_clock::now() - since;
  EXPECT_LT(took, std::chrono::seconds(60));
  EXPECT_EQ(ask(copies.port(0), "CHECK").substr(0, 2), "OK");
  // Both ran while the prefetch still trickled: beside it, not after it.
  EXPECT_EQ(agent.get("/v1/operations/" + prefetch).doc["state"], "running");
  EXPECT_EQ(front_->trickling(), 1);
  const std::string metrics = agent.get("/metrics").body;
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_in_flight{kind="prefetch"})"), 1);
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_pending{lane="gpu"})"), 0);
}

// With the lanes apart, a restore of a snapshot a prefetch is pulling would fetch it beside the
// prefetch, and one of the two pulls fail on the other's node copy. It waits for that pull
// instead, and for no other.
TEST_F(AgentBesideATricklingRegistry, ARestoreWaitsForThePrefetchOfItsSnapshotAlone) {
  Agent agent(dir_, args());
  const std::string prefetch = held_prefetch(agent);  // of "trickled"
  auto same = agent.post("/v1/restores", {{"artifact", "trickled"}});
  ASSERT_EQ(same.status, 202) << same.body;
  const std::string id = same.doc["operation"]["id"];
  ASSERT_TRUE(eventually([&] {
    return agent.get("/v1/operations/" + id).doc.value("state", "") == "running";
  })) << agent.log();
  // Running, but asking the registry nothing: it waits for the prefetch's pull.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  const json waiting = agent.get("/v1/operations/" + id).doc;
  EXPECT_EQ(waiting["state"], "running") << waiting.dump(2);
  EXPECT_TRUE(waiting["phases"].empty()) << waiting.dump(2);
  EXPECT_EQ(front_->trickling(), 1);
  EXPECT_EQ(agent.get("/v1/operations/" + prefetch).doc["state"], "running");
  // On another agent, a restore of another snapshot does not wait for that prefetch: its own
  // pull trickles beside it; nor does a prefetch of a third, with two prefetch workers.
  TempDir other_dir;
  Agent other(other_dir, args({"--prefetch-workers", "2"}));
  held_prefetch(other, 1);
  auto restore = other.post("/v1/restores", {{"artifact", "another"}});
  ASSERT_EQ(restore.status, 202) << restore.body;
  EXPECT_TRUE(eventually([&] { return front_->trickling() == 3; })) << front_->trickling();
  auto third = other.post("/v1/prefetch", {{"artifact", "third"}});
  ASSERT_EQ(third.status, 202) << third.body;
  EXPECT_TRUE(eventually([&] { return front_->trickling() == 4; })) << front_->trickling();
}

// 2,000 prefetches were accepted behind a trickling one, each journaled with an fsync. A lane
// now holds --max-pending pending operations; beyond it a request gets 429 and nothing of it
// is kept, while the other lane still takes work.
TEST_F(AgentBesideATricklingRegistry, PrefetchesPastTheBoundGet429AndNoJournalEntry) {
  Agent agent(dir_, args({"--max-pending", "4"}));
  const std::string running = held_prefetch(agent);
  for (int i = 0; i < 4; ++i) {
    auto a = agent.post("/v1/prefetch", {{"artifact", "p" + std::to_string(i)}});
    EXPECT_EQ(a.status, 202) << a.body;
  }
  for (int i = 0; i < 40; ++i) {
    auto a = agent.post("/v1/prefetch", {{"artifact", "flood" + std::to_string(i)}});
    ASSERT_EQ(a.status, 429) << a.body;
    EXPECT_EQ(a.doc["error"]["kind"], "environment") << a.body;
    EXPECT_EQ(a.doc["error"]["message"],
              "the agent already holds 4 pending prefetches, the most it queues (--max-pending 4)")
        << a.body;
    EXPECT_EQ(a.doc["error"]["hint"],
              "send the request again after Retry-After seconds, or start the agent with a larger "
              "--max-pending")
        << a.body;
    // No prefetch has ended yet: the lane's first guess, 5 s.
    EXPECT_EQ(a.retry_after, "5") << a.body;
  }
  // The journal holds the running prefetch and the bound's pending ones, no more.
  EXPECT_EQ(entries(agent.state() / "operations").size(), 5u);
  EXPECT_EQ(agent.get("/v1/operations").doc["operations"].size(), 5u);
  const std::string metrics = agent.get("/metrics").body;
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_pending{lane="prefetch"})"), 4);
  EXPECT_EQ(sample(metrics, R"(gpusnap_operations_pending{lane="gpu"})"), 0);
  EXPECT_NE(agent.log().find("POST /v1/prefetch -> 429: environment: the agent already holds 4 "
                             "pending prefetches"),
            std::string::npos)
      << agent.log();
  // The other lane has room: a checkpoint is taken and runs.
  Workload source(dir_, {"--mib", "4"});
  auto cp = agent.run("/v1/checkpoints", {{"artifact", "snap"}, {"pid", source.pid()}});
  EXPECT_EQ(cp["state"], "succeeded") << cp.dump(2);
  EXPECT_EQ(agent.get("/v1/operations/" + running).doc["state"], "running");
}

TEST(AgentBadInput, RegistrySettingsAreCheckedAtStart) {
  SKIP_WITHOUT_CRIU();
  TempDir dir;
  auto refused = [&](std::vector<std::string> extra) {
    common::SpawnOptions o;
    o.argv = {build_path("gpusnap-agent"), "--socket",    (dir / "s").string(),     "--storage",
              (dir / "snap").string(),     "--state-dir", (dir / "state").string(), "--run-dir",
              (dir / "run").string()};
    o.argv.insert(o.argv.end(), extra.begin(), extra.end());
    common::UniqueFd err(
        ::open((dir / "err").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    o.stderr_fd = err.get();
    common::Subprocess p(o);
    auto status = p.wait(std::chrono::seconds(30));
    return std::pair{status ? status->code : -1, fs::read_file(dir / "err")};
  };
  auto [code, err] = refused({"--registry", "oci://127.0.0.1:5000/snapshots:v1"});
  EXPECT_EQ(code, 2);
  EXPECT_EQ(err,
            "gpusnap-agent: error: --registry oci://127.0.0.1:5000/snapshots:v1 names a tag or a "
            "digest (fix: give the repository alone, oci://HOST[:PORT]/REPO: each snapshot is "
            "tagged with its name)\n");
  std::tie(code, err) = refused({"--registry", "oci://127.0.0.1:5000/snapshots",
                                 "--registry-auth-file", (dir / "missing.json").string()});
  EXPECT_EQ(code, 2);
  EXPECT_EQ(err, "gpusnap-agent: error: --registry-auth-file " + (dir / "missing.json").string() +
                     " is not a readable file (fix: name the mounted file, e.g. the registry "
                     "Secret's auth.json)\n");
  std::tie(code, err) = refused({"--cache", (dir / "cache").string()});
  EXPECT_EQ(code, 2);
  EXPECT_EQ(err, "gpusnap-agent: error: --cache needs --registry (fix: see `gpusnap-agent "
                 "--help`)\n");
  EXPECT_FALSE(std::filesystem::exists(dir / "cache"));
}

}  // namespace
}  // namespace gpusnap::testing
