#include "kube/fake_apiserver.h"

#include <algorithm>
#include <chrono>
#include <regex>
#include <sstream>

#include <httplib.h>

namespace gpusnap::testing {

namespace {

json status_object(int code, const std::string& reason, const std::string& message) {
  return {{"kind", "Status"},    {"apiVersion", "v1"}, {"metadata", json::object()},
          {"status", "Failure"}, {"message", message}, {"reason", reason},
          {"code", code}};
}

std::string kind_of(const std::string& resource) {
  if (resource == "pods") return "Pod";
  if (resource == "events") return "Event";
  if (resource == "gpusnapshots") return "GpuSnapshot";
  return resource;
}

std::string api_version_of(const std::string& resource) {
  return resource == "gpusnapshots" ? "gpusnap.io/v1alpha1" : "v1";
}

// The value of a dotted field path ("spec.nodeName") as a string, "" when absent.
std::string field(const json& o, const std::string& path) {
  const json* at = &o;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) {
    if (!at->is_object() || !at->contains(part)) return "";
    at = &(*at)[part];
  }
  return at->is_string() ? at->get<std::string>() : "";
}

struct Selector {
  std::vector<std::tuple<std::string, std::string, bool>> terms;  // key, value, equal
  bool labels = false;
  bool exists_only(const std::tuple<std::string, std::string, bool>& t) const {
    return labels && std::get<1>(t).empty() && std::get<2>(t);
  }
};

Selector parse_selector(const std::string& text, bool labels) {
  Selector s;
  s.labels = labels;
  std::stringstream ss(text);
  for (std::string term; std::getline(ss, term, ',');) {
    if (term.empty()) continue;
    bool equal = true;
    size_t at = term.find("!=");
    size_t vlen = 2;
    if (at != std::string::npos) {
      equal = false;
    } else if ((at = term.find("==")) != std::string::npos) {
    } else if ((at = term.find('=')) != std::string::npos) {
      vlen = 1;
    }
    if (at == std::string::npos) {
      s.terms.emplace_back(term, "", true);  // label exists
    } else {
      s.terms.emplace_back(term.substr(0, at), term.substr(at + vlen), equal);
    }
  }
  return s;
}

bool matches(const Selector& s, const json& o) {
  for (const auto& t : s.terms) {
    const auto& [key, value, equal] = t;
    std::string have;
    bool present = false;
    if (s.labels) {
      const json& labels = o.value("/metadata/labels"_json_pointer, json::object());
      present = labels.contains(key);
      if (present && labels[key].is_string()) have = labels[key].get<std::string>();
      if (s.exists_only(t)) {
        if (!present) return false;
        continue;
      }
    } else {
      have = field(o, key);
    }
    if ((have == value) != equal) return false;
  }
  return true;
}

}  // namespace

FakeApiServer::FakeApiServer(std::string token)
    : token_(std::move(token)), server_(std::make_unique<httplib::Server>()) {
  // Watches hold a worker for their whole life: give them plenty.
  server_->new_task_queue = [] { return new httplib::ThreadPool(64); };
  auto h = [this](const httplib::Request& req, httplib::Response& res) { handle(req, res); };
  server_->Get(".*", h);
  server_->Post(".*", h);
  server_->Put(".*", h);
  server_->Patch(".*", h);
  server_->Delete(".*", h);
  port_ = server_->bind_to_any_port("127.0.0.1");
  if (port_ <= 0) throw std::runtime_error("fake API server: cannot bind 127.0.0.1");
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  while (!server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

FakeApiServer::~FakeApiServer() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

std::string FakeApiServer::url() const { return "http://127.0.0.1:" + std::to_string(port_); }

uint64_t FakeApiServer::resource_version() const {
  std::lock_guard lock(mu_);
  return rv_;
}

FakeApiServer::Route FakeApiServer::route(const std::string& path) {
  static const std::regex re(
      R"(^/(?:api/v1|apis/gpusnap\.io/v1alpha1)(?:/namespaces/([^/]+))?/([a-z]+)(?:/([^/]+))?(?:/(status))?$)");
  std::smatch m;
  Route r;
  if (!std::regex_match(path, m, re)) return r;
  r.ok = true;
  r.ns = m[1];
  r.resource = m[2];
  r.name = m[3];
  r.sub = m[4];
  bool custom = path.starts_with("/apis/");
  if (custom != (r.resource == "gpusnapshots")) r.ok = false;
  if (r.resource != "pods" && r.resource != "events" && r.resource != "gpusnapshots") r.ok = false;
  return r;
}

json FakeApiServer::store_write(const std::string& resource, const json& object,
                                const std::string& type, const json& old) {
  json o = object;
  o["metadata"]["resourceVersion"] = std::to_string(next_rv());
  Key key{resource, o["metadata"].value("namespace", ""), o["metadata"].value("name", "")};
  if (type == "DELETED") {
    objects_.erase(key);
  } else {
    objects_[key] = o;
  }
  history_.push_back({rv_, resource, type, o, old});
  cv_.notify_all();
  return o;
}

json FakeApiServer::create(const std::string& resource, const std::string& ns, json object) {
  std::lock_guard lock(mu_);
  json& md = object["metadata"];
  md["namespace"] = ns;
  if (md.value("name", "").empty())
    md["name"] = md.value("generateName", "obj-") + std::to_string(++uid_);
  Key key{resource, ns, md["name"].get<std::string>()};
  if (objects_.contains(key)) throw std::runtime_error("fake API server: already exists");
  md["uid"] = "uid-" + std::to_string(++uid_);
  md["creationTimestamp"] = "2026-01-01T00:00:00Z";
  md["generation"] = 1;
  object["apiVersion"] = api_version_of(resource);
  object["kind"] = kind_of(resource);
  return store_write(resource, object, "ADDED", json());
}

json FakeApiServer::update(const std::string& resource, const std::string& ns,
                           const std::string& name, const std::function<void(json&)>& mutate) {
  std::lock_guard lock(mu_);
  auto it = objects_.find({resource, ns, name});
  if (it == objects_.end()) throw std::runtime_error("fake API server: no such object " + name);
  json old = it->second;
  json next = old;
  mutate(next);
  if (next.value("spec", json()) != old.value("spec", json())) {
    next["metadata"]["generation"] = old["metadata"].value("generation", 1) + 1;
  }
  return store_write(resource, next, "MODIFIED", old);
}

void FakeApiServer::remove(const std::string& resource, const std::string& ns,
                           const std::string& name) {
  std::lock_guard lock(mu_);
  auto it = objects_.find({resource, ns, name});
  if (it == objects_.end()) return;
  store_write(resource, it->second, "DELETED", it->second);
}

std::optional<json> FakeApiServer::get(const std::string& resource, const std::string& ns,
                                       const std::string& name) const {
  std::lock_guard lock(mu_);
  auto it = objects_.find({resource, ns, name});
  if (it == objects_.end()) return std::nullopt;
  return it->second;
}

std::vector<json> FakeApiServer::list(const std::string& resource) const {
  std::lock_guard lock(mu_);
  std::vector<json> out;
  for (const auto& [key, o] : objects_) {
    if (std::get<0>(key) == resource) out.push_back(o);
  }
  return out;
}

std::vector<std::string> FakeApiServer::events_about(const std::string& kind,
                                                     const std::string& name) const {
  auto all = list("events");
  std::sort(all.begin(), all.end(), [](const json& a, const json& b) {
    return std::stoull(a["metadata"]["resourceVersion"].get<std::string>()) <
           std::stoull(b["metadata"]["resourceVersion"].get<std::string>());
  });
  std::vector<std::string> out;
  for (const auto& e : all) {
    if (e["involvedObject"]["kind"] == kind && e["involvedObject"]["name"] == name) {
      out.push_back(e["type"].get<std::string>() + " " + e["reason"].get<std::string>() + ": " +
                    e["message"].get<std::string>());
    }
  }
  return out;
}

void FakeApiServer::compact() {
  std::lock_guard lock(mu_);
  compacted_ = rv_;
  history_.clear();
}

void FakeApiServer::end_watches(bool hold) {
  {
    std::lock_guard lock(mu_);
    ++watch_epoch_;
    hold_ = hold;
  }
  cv_.notify_all();
}

void FakeApiServer::release_watches() {
  {
    std::lock_guard lock(mu_);
    hold_ = false;
  }
  cv_.notify_all();
}

void FakeApiServer::send_bookmarks() {
  {
    std::lock_guard lock(mu_);
    ++bookmark_epoch_;
  }
  cv_.notify_all();
}

void FakeApiServer::interfere_with_status_writes(const std::string& resource, const std::string& ns,
                                                 const std::string& name, int times) {
  std::lock_guard lock(mu_);
  interfere_[{resource, ns, name}] += times;
}

std::vector<FakeApiServer::Request> FakeApiServer::requests() const {
  std::lock_guard lock(mu_);
  return requests_;
}

int FakeApiServer::count(const std::string& method, const std::string& path_suffix,
                         int status) const {
  std::lock_guard lock(mu_);
  int n = 0;
  for (const auto& r : requests_) {
    if (r.method == method && r.path.ends_with(path_suffix) &&
        (status == 0 || r.status == status)) {
      ++n;
    }
  }
  return n;
}

void FakeApiServer::handle(const httplib::Request& req, httplib::Response& res) {
  auto reply = [&](int code, const json& body) {
    res.status = code;
    res.set_content(body.dump(), "application/json");
  };
  std::string query;
  for (const auto& [k, v] : req.params) query += (query.empty() ? "" : "&") + k + "=" + v;
  auto record = [&](int status) {
    std::lock_guard lock(mu_);
    requests_.push_back({req.method, req.path, query, status});
  };
  if (req.get_header_value("Authorization") != "Bearer " + token_) {
    record(401);
    return reply(401, status_object(401, "Unauthorized", "Unauthorized"));
  }
  Route r = route(req.path);
  if (!r.ok) {
    record(404);
    return reply(
        404, status_object(404, "NotFound", "the server could not find the requested resource"));
  }
  if (req.method == "GET" && r.name.empty() && req.has_param("watch") &&
      req.get_param_value("watch") != "false" && req.get_param_value("watch") != "0") {
    record(200);
    return watch(req, res, r);
  }
  std::string what = r.resource + " \"" + r.name + "\"";
  std::unique_lock lock(mu_);
  auto finish = [&](int code, const json& body) {
    requests_.push_back({req.method, req.path, query, code});
    lock.unlock();
    reply(code, body);
  };
  Key key{r.resource, r.ns, r.name};
  auto it = objects_.find(key);

  if (req.method == "GET" && r.name.empty()) {
    Selector fs = parse_selector(req.get_param_value("fieldSelector"), false);
    Selector ls = parse_selector(req.get_param_value("labelSelector"), true);
    json items = json::array();
    for (const auto& [k, o] : objects_) {
      if (std::get<0>(k) != r.resource || (!r.ns.empty() && std::get<1>(k) != r.ns)) continue;
      if (matches(fs, o) && matches(ls, o)) items.push_back(o);
    }
    return finish(200, {{"kind", kind_of(r.resource) + "List"},
                        {"apiVersion", api_version_of(r.resource)},
                        {"metadata", {{"resourceVersion", std::to_string(rv_)}}},
                        {"items", items}});
  }
  if (req.method == "POST") {
    if (!r.name.empty() || r.ns.empty())
      return finish(405,
                    status_object(405, "MethodNotAllowed", "create needs a namespaced collection"));
    json o = json::parse(req.body, nullptr, false);
    if (!o.is_object())
      return finish(400, status_object(400, "BadRequest", "body is not a JSON object"));
    json& md = o["metadata"];
    if (md.value("namespace", r.ns) != r.ns) {
      return finish(
          400,
          status_object(400, "BadRequest",
                        "the namespace of the object does not match the namespace on the request"));
    }
    md["namespace"] = r.ns;
    if (md.value("name", "").empty()) {
      if (md.value("generateName", "").empty()) {
        return finish(422, status_object(422, "Invalid", "metadata.name: Required value"));
      }
      md["name"] = md.value("generateName", "") + std::to_string(10000 + ++uid_);
    }
    std::string name = md["name"];
    if (objects_.contains({r.resource, r.ns, name})) {
      return finish(409, status_object(409, "AlreadyExists",
                                       r.resource + " \"" + name + "\" already exists"));
    }
    md["uid"] = "uid-" + std::to_string(++uid_);
    md["creationTimestamp"] = "2026-01-01T00:00:00Z";
    md["generation"] = 1;
    md.erase("resourceVersion");
    o["apiVersion"] = api_version_of(r.resource);
    o["kind"] = kind_of(r.resource);
    if (r.resource == "pods") o["status"] = {{"phase", "Pending"}};
    if (r.resource == "gpusnapshots") o.erase("status");
    return finish(201, store_write(r.resource, o, "ADDED", json()));
  }
  if (r.name.empty())
    return finish(405,
                  status_object(405, "MethodNotAllowed", "method not allowed on a collection"));
  if (it == objects_.end()) return finish(404, status_object(404, "NotFound", what + " not found"));
  json current = it->second;

  if (req.method == "GET") return finish(200, current);
  if (req.method == "DELETE") {
    store_write(r.resource, current, "DELETED", current);
    return finish(200, current);
  }
  json body = json::parse(req.body, nullptr, false);
  if (!body.is_object())
    return finish(400, status_object(400, "BadRequest", "body is not a JSON object"));
  if (r.sub == "status") {
    if (auto in = interfere_.find(key); in != interfere_.end() && in->second > 0) {
      --in->second;
      json other = current;
      other["metadata"]["annotations"]["test/interference"] = std::to_string(
          other.value("/metadata/annotations/test~1interference"_json_pointer, json("0"))
              .get<std::string>()
              .size());
      current = store_write(r.resource, other, "MODIFIED", current);
    }
  }
  json next;
  std::string precondition;
  if (req.method == "PUT") {
    next = body;
    precondition =
        body.value("/metadata/resourceVersion"_json_pointer, json("")).get<std::string>();
  } else if (req.method == "PATCH") {
    if (req.get_header_value("Content-Type") != "application/merge-patch+json") {
      return finish(
          415, status_object(415, "UnsupportedMediaType", "the fake serves merge-patch+json only"));
    }
    precondition =
        body.value("/metadata/resourceVersion"_json_pointer, json("")).get<std::string>();
    next = current;
    next.merge_patch(body);
  } else {
    return finish(405, status_object(405, "MethodNotAllowed", req.method));
  }
  if (!precondition.empty() && precondition != current["metadata"].value("resourceVersion", "")) {
    return finish(409,
                  status_object(409, "Conflict",
                                "Operation cannot be fulfilled on " + r.resource + " \"" + r.name +
                                    "\": the object has been modified; please apply your "
                                    "changes to the latest version and try again"));
  }
  json stored = current;
  if (r.sub == "status") {
    stored["status"] = next.value("status", json::object());
  } else {
    // The main resource ignores status; metadata that the server owns stays.
    json status = current.value("status", json());
    stored = next;
    if (status.is_null()) {
      stored.erase("status");
    } else {
      stored["status"] = status;
    }
    for (const char* k : {"uid", "creationTimestamp", "generation", "namespace", "name"}) {
      if (current["metadata"].contains(k)) stored["metadata"][k] = current["metadata"][k];
    }
    if (stored.value("spec", json()) != current.value("spec", json())) {
      stored["metadata"]["generation"] = current["metadata"].value("generation", 1) + 1;
    }
  }
  stored["apiVersion"] = api_version_of(r.resource);
  stored["kind"] = kind_of(r.resource);
  return finish(200, store_write(r.resource, stored, "MODIFIED", current));
}

void FakeApiServer::watch(const httplib::Request& req, httplib::Response& res, const Route& r) {
  struct State {
    std::string resource, ns;
    Selector fields, labels;
    uint64_t from = 0;   // events with a larger version are still to send
    uint64_t epoch = 0;  // watch_epoch_ at the start: a change ends the stream
    uint64_t bookmark = 0;
    bool bookmarks = false;
    std::chrono::steady_clock::time_point deadline;
    std::vector<json> initial;  // synthetic ADDED events (version "" or "0")
    bool expired = false;
    bool started = false;
  };
  auto st = std::make_shared<State>();
  st->resource = r.resource;
  st->ns = r.ns;
  st->fields = parse_selector(req.get_param_value("fieldSelector"), false);
  st->labels = parse_selector(req.get_param_value("labelSelector"), true);
  st->bookmarks = req.get_param_value("allowWatchBookmarks") == "true";
  long timeout =
      req.has_param("timeoutSeconds") ? std::stol(req.get_param_value("timeoutSeconds")) : 1800;
  st->deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout);
  std::string version = req.get_param_value("resourceVersion");

  std::unique_lock lock(mu_);
  // A held partition: the request waits here, as a request to an unreachable server would.
  cv_.wait(lock, [&] { return !hold_ || stopping_; });
  auto visible = [st](const json& o) {
    return (st->ns.empty() || o.value("/metadata/namespace"_json_pointer, json("")) == st->ns) &&
           matches(st->fields, o) && matches(st->labels, o);
  };
  if (version.empty() || version == "0") {
    for (const auto& [k, o] : objects_) {
      if (std::get<0>(k) == st->resource && visible(o)) {
        st->initial.push_back({{"type", "ADDED"}, {"object", o}});
      }
    }
    st->from = rv_;
  } else {
    st->from = std::stoull(version);
    if (st->from < compacted_) st->expired = true;
  }
  std::string too_old =
      "too old resource version: " + version + " (" + std::to_string(compacted_) + ")";
  if (st->expired && http_410) {
    lock.unlock();
    res.status = 410;
    res.set_content(status_object(410, "Expired", too_old).dump(), "application/json");
    return;
  }
  st->epoch = watch_epoch_;
  st->bookmark = bookmark_epoch_;
  lock.unlock();

  res.set_chunked_content_provider("application/json", [this, st, visible, too_old](
                                                           size_t, httplib::DataSink& sink) {
    std::string out;
    bool end = false;
    {
      std::unique_lock lock(mu_);
      if (st->expired) {
        out = json{{"type", "ERROR"}, {"object", status_object(410, "Expired", too_old)}}.dump() +
              "\n";
        end = true;
      } else if (!st->started) {
        for (const auto& e : st->initial) out += e.dump() + "\n";
        st->started = true;
      }
      if (!end && out.empty()) {
        auto has_news = [&] {
          return stopping_ || watch_epoch_ != st->epoch || bookmark_epoch_ != st->bookmark ||
                 (!history_.empty() && history_.back().rv > st->from) ||
                 std::chrono::steady_clock::now() >= st->deadline;
        };
        cv_.wait_until(lock,
                       std::min(st->deadline,
                                std::chrono::steady_clock::now() + std::chrono::milliseconds(200)),
                       has_news);
        for (const auto& e : history_) {
          if (e.rv <= st->from) continue;
          st->from = e.rv;
          if (e.resource != st->resource) continue;
          bool now_in = e.type != "DELETED" && visible(e.object);
          bool was_in =
              e.type == "DELETED" ? visible(e.object) : (!e.old.is_null() && visible(e.old));
          std::string type;
          if (e.type == "DELETED") {
            if (was_in) type = "DELETED";
          } else if (now_in && was_in) {
            type = "MODIFIED";
          } else if (now_in) {
            type = "ADDED";
          } else if (was_in) {
            type = "DELETED";
          }
          if (!type.empty()) out += json{{"type", type}, {"object", e.object}}.dump() + "\n";
        }
        if (bookmark_epoch_ != st->bookmark) {
          st->bookmark = bookmark_epoch_;
          if (st->bookmarks) {
            st->from = std::max(st->from, rv_);
            out += json{{"type", "BOOKMARK"},
                        {"object",
                         {{"kind", kind_of(st->resource)},
                          {"apiVersion", api_version_of(st->resource)},
                          {"metadata", {{"resourceVersion", std::to_string(st->from)}}}}}}
                       .dump() +
                   "\n";
          }
        }
        end = stopping_ || watch_epoch_ != st->epoch ||
              std::chrono::steady_clock::now() >= st->deadline;
      }
    }
    if (!out.empty() && !sink.write(out.data(), out.size())) return false;
    if (end) sink.done();
    return true;
  });
}

}  // namespace gpusnap::testing
