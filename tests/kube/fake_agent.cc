#include "kube/fake_agent.h"

#include <sys/socket.h>

#include <chrono>

#include <httplib.h>

namespace gpusnap::testing {

namespace {

json error_body(const std::string& kind, int exit_code, const std::string& message) {
  return {{"error", {{"kind", kind}, {"exit_code", exit_code}, {"message", message}}}};
}

}  // namespace

FakeAgent::FakeAgent(std::filesystem::path socket)
    : socket_(std::move(socket)), server_(std::make_unique<httplib::Server>()) {
  auto json_reply = [](httplib::Response& res, int status, const json& body) {
    res.status = status;
    res.set_content(body.dump(), "application/json");
  };
  server_->Get("/v1/healthz", [=](const httplib::Request&, httplib::Response& res) {
    json_reply(res, 200, {{"ok", true}, {"version", "test"}, {"node", "fake"}});
  });
  auto start = [this, json_reply](const std::string& kind) {
    return [this, kind, json_reply](const httplib::Request& req, httplib::Response& res) {
      json body = json::parse(req.body, nullptr, false);
      std::lock_guard lock(mu_);
      std::string path = kind == "checkpoint" ? "/v1/checkpoints" : "/v1/restores";
      posts_[path].push_back(body);
      if (!body.is_object() || !body.contains("artifact")) {
        return json_reply(res, 400, error_body("usage", 2, "the request names no artifact"));
      }
      if (kind == "checkpoint" && refuse_checkpoint_) {
        auto [status, error] = *refuse_checkpoint_;
        refuse_checkpoint_.reset();
        return json_reply(res, status, {{"error", error}});
      }
      // An agent with registry storage pulls what it does not hold from the reference.
      if (kind == "restore" && !body.contains("reference") &&
          !artifacts_.contains(body["artifact"].get<std::string>())) {
        return json_reply(
            res, 404,
            error_body("not-found", 3, "no artifact " + body["artifact"].get<std::string>()));
      }
      Op op;
      std::string id = "op-" + std::to_string(next_id_++);
      op.object = {{"id", id},
                   {"kind", kind},
                   {"state", "running"},
                   {"request", body},
                   {"phases", json::array({{{"name", kind == "checkpoint" ? "resolve" : "open"},
                                            {"seconds", 0.25},
                                            {"done", true}}})},
                   {"error", nullptr},
                   {"result", nullptr},
                   {"created_at", "2026-01-01T00:00:00Z"},
                   {"finished_at", nullptr}};
      auto& fail = kind == "checkpoint" ? fail_checkpoint_ : fail_restore_;
      op.error = fail;
      fail.reset();
      ops_[id] = op;
      json_reply(res, 202, {{"operation", op.object}});
    };
  };
  server_->Post("/v1/checkpoints", start("checkpoint"));
  server_->Post("/v1/restores", start("restore"));
  server_->Get(R"(/v1/operations/([^/]+))", [this, json_reply](const httplib::Request& req,
                                                               httplib::Response& res) {
    std::lock_guard lock(mu_);
    auto it = ops_.find(req.matches[1]);
    if (it == ops_.end()) {
      return json_reply(res, 404,
                        error_body("not-found", 3, "no operation " + std::string(req.matches[1])));
    }
    Op& op = it->second;
    if (op.object["state"] == "running" && ++op.polls >= polls_until_done_) finish(op);
    json_reply(res, 200, op.object);
  });
  server_->Get(R"(/v1/snapshots/([^/]+))",
               [this, json_reply](const httplib::Request& req, httplib::Response& res) {
                 std::lock_guard lock(mu_);
                 std::string name = req.matches[1];
                 if (!artifacts_.contains(name)) {
                   return json_reply(res, 404, error_body("not-found", 3, "no artifact " + name));
                 }
                 // As the real agent's inspect document: the manifest, its size as total_bytes.
                 json_reply(res, 200, {{"artifact", name}, {"total_bytes", bytes_}});
               });
  server_->set_address_family(AF_UNIX);
  std::filesystem::remove(socket_);
  if (!server_->bind_to_port(socket_.string(), 80)) {
    throw std::runtime_error("fake agent: cannot listen on " + socket_.string());
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  while (!server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

FakeAgent::~FakeAgent() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
  std::error_code ec;
  std::filesystem::remove(socket_, ec);
}

void FakeAgent::finish(Op& op) {
  json& o = op.object;
  o["finished_at"] = "2026-01-01T00:01:00Z";
  o["phases"].push_back({{"name", o["kind"] == "checkpoint" ? "dump" : "criu-restore"},
                         {"seconds", 1.5},
                         {"done", true}});
  if (op.error) {
    o["state"] = "failed";
    o["error"] = *op.error;
    return;
  }
  o["state"] = "succeeded";
  std::string artifact = o["request"]["artifact"];
  if (o["kind"] == "checkpoint") {
    artifacts_.insert(artifact);
    o["result"] = {{"artifact", artifact}, {"bytes", bytes_}, {"id", "artifact-id-1"}};
  } else {
    o["result"] = {{"artifact", artifact}, {"copies", json::array()}};
    if (o["request"].contains("reference")) {
      o["result"]["pulled"] = {{"pulled", true}, {"reference", o["request"]["reference"]}};
    }
  }
}

void FakeAgent::set_polls_until_done(int n) {
  std::lock_guard lock(mu_);
  polls_until_done_ = n;
}
void FakeAgent::fail_next_checkpoint(json error) {
  std::lock_guard lock(mu_);
  fail_checkpoint_ = std::move(error);
}
void FakeAgent::fail_next_restore(json error) {
  std::lock_guard lock(mu_);
  fail_restore_ = std::move(error);
}
void FakeAgent::refuse_next_checkpoint(int status, json error) {
  std::lock_guard lock(mu_);
  refuse_checkpoint_ = {status, std::move(error)};
}
void FakeAgent::set_bytes(uint64_t bytes) {
  std::lock_guard lock(mu_);
  bytes_ = bytes;
}
void FakeAgent::add_artifact(const std::string& name) {
  std::lock_guard lock(mu_);
  artifacts_.insert(name);
}
bool FakeAgent::has_artifact(const std::string& name) const {
  std::lock_guard lock(mu_);
  return artifacts_.contains(name);
}
void FakeAgent::restart(bool finish_running) {
  std::lock_guard lock(mu_);
  if (finish_running) {
    for (auto& [id, op] : ops_) {
      if (op.object["state"] == "running") finish(op);
    }
  }
  ops_.clear();
}
std::vector<json> FakeAgent::posts(const std::string& path) const {
  std::lock_guard lock(mu_);
  auto it = posts_.find(path);
  return it == posts_.end() ? std::vector<json>{} : it->second;
}
int FakeAgent::running() const {
  std::lock_guard lock(mu_);
  int n = 0;
  for (const auto& [id, op] : ops_) n += op.object["state"] == "running" ? 1 : 0;
  return n;
}

}  // namespace gpusnap::testing
