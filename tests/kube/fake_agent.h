// A stand-in for the node agent's HTTP API on a Unix socket (the contract in docs/agent.md),
// for the controller's tests only: operations that run for a few polls and then succeed or
// fail as the test scripted, artifacts that a successful checkpoint adds (a restore naming a
// registry reference is taken as pulled from there), and a restart that
// forgets every operation. It records each request, so tests assert on exactly what the
// controller asked.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace httplib {
class Server;
}

namespace gpusnap::testing {

using nlohmann::json;

class FakeAgent {
 public:
  explicit FakeAgent(std::filesystem::path socket);
  ~FakeAgent();
  FakeAgent(const FakeAgent&) = delete;
  FakeAgent& operator=(const FakeAgent&) = delete;

  const std::filesystem::path& socket() const { return socket_; }

  // Scripting (set before the operation starts).
  void set_polls_until_done(int n);
  // The next checkpoint/restore operation fails with this error ({kind, exit_code, message}).
  void fail_next_checkpoint(json error);
  void fail_next_restore(json error);
  // The next checkpoint/restore request is refused outright with this HTTP status and error.
  void refuse_next_checkpoint(int status, json error);
  void set_bytes(uint64_t bytes);
  void add_artifact(const std::string& name);
  bool has_artifact(const std::string& name) const;
  // Forgets every operation, as a restarted agent does; artifacts stay on disk. With
  // finish_running, operations still running complete first (their artifacts appear).
  void restart(bool finish_running = false);

  // The POST bodies received, per path ("/v1/checkpoints", "/v1/restores").
  std::vector<json> posts(const std::string& path) const;
  // The number of operations still running.
  int running() const;

 private:
  struct Op {
    json object;
    int polls = 0;
    std::optional<json> error;
  };
  void finish(Op& op);  // under mu_

  std::filesystem::path socket_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  mutable std::mutex mu_;
  int polls_until_done_ = 2;
  std::optional<json> fail_checkpoint_, fail_restore_;
  std::optional<std::pair<int, json>> refuse_checkpoint_;
  uint64_t bytes_ = 123456789;
  std::set<std::string> artifacts_;
  std::map<std::string, Op> ops_;
  int next_id_ = 1;
  std::map<std::string, std::vector<json>> posts_;
};

}  // namespace gpusnap::testing
