#include "kube/informer.h"

#include <random>

#include "gpusnap/error.h"

namespace gpusnap::kube {

using nlohmann::json;

namespace {

std::string version_of(const json& object) {
  if (!object.is_object()) return "";
  const auto& md = object.value("metadata", json::object());
  return md.is_object() ? md.value("resourceVersion", "") : "";
}

}  // namespace

Informer::Informer(const ApiConfig& api, InformerOptions options, Handler on_change)
    : api_(api), options_(std::move(options)), on_change_(std::move(on_change)) {}

Informer::~Informer() { stop(); }

std::string Informer::key_of(const json& object) {
  const auto& md = object.at("metadata");
  std::string ns = md.value("namespace", "");
  std::string name = md.value("name", "");
  return ns.empty() ? name : ns + "/" + name;
}

void Informer::start() {
  thread_ = std::jthread([this] { run(); });
}

void Informer::stop() noexcept {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (!thread_.joinable()) return;
  // The thread may be about to open a watch when the first cut lands: cut until it has left.
  for (;;) {
    api_.cancel_watches();
    std::unique_lock lock(mu_);
    if (cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return finished_; })) break;
  }
  thread_.join();
}

void Informer::say(const std::string& line) const {
  if (options_.log) options_.log(line);
}

std::optional<json> Informer::get(const std::string& key) const {
  std::lock_guard lock(mu_);
  auto it = objects_.find(key);
  if (it == objects_.end()) return std::nullopt;
  return it->second;
}

std::vector<json> Informer::items() const {
  std::lock_guard lock(mu_);
  std::vector<json> out;
  out.reserve(objects_.size());
  for (const auto& [key, object] : objects_) out.push_back(object);
  return out;
}

bool Informer::wait_synced(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return synced_; });
}

InformerStats Informer::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Informer::run() {
  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (stopping_) break;
    }
    try {
      bool relist;
      {
        std::lock_guard lock(mu_);
        relist = need_list_;
      }
      if (relist) list();
      watch_once();
    } catch (const Error& e) {
      say("watch of " + options_.path + " failed: " + e.what() + "; trying again");
      sleep_backoff();
    }
  }
  std::lock_guard lock(mu_);
  finished_ = true;
  cv_.notify_all();
}

void Informer::list() {
  std::string path = options_.path;
  if (!options_.selector.empty()) path += "?" + options_.selector;
  Response r = api_.get(path);
  if (!r.ok()) {
    throw Error(
        ErrorKind::kEnvironment,
        "list " + options_.path + " answered " + std::to_string(r.status) + ": " + r.message(),
        "check the controller's RBAC rules and the API server");
  }
  std::map<std::string, json> fresh;
  for (const auto& item : r.body.value("items", json::array())) fresh[key_of(item)] = item;
  std::vector<std::string> changed;
  {
    std::lock_guard lock(mu_);
    // Objects that vanished while no watch ran are reported like a DELETED event; objects that
    // appeared or changed like ADDED/MODIFIED. Unchanged ones too: a re-list is also how a
    // controller catches up on work it may have dropped.
    for (const auto& [key, object] : objects_) {
      if (!fresh.contains(key)) changed.push_back(key);
    }
    for (const auto& [key, object] : fresh) changed.push_back(key);
    objects_ = std::move(fresh);
    stats_.resource_version = version_of(r.body);
    ++stats_.lists;
    need_list_ = false;
    synced_ = true;
    backoff_ = std::chrono::milliseconds(0);
  }
  cv_.notify_all();
  for (const auto& key : changed) on_change_(key);
}

void Informer::watch_once() {
  std::string version;
  {
    std::lock_guard lock(mu_);
    version = stats_.resource_version;
    ++stats_.watches;
  }
  std::string path = options_.path + "?watch=1&allowWatchBookmarks=true&resourceVersion=" +
                     common::url_encode(version) +
                     "&timeoutSeconds=" + std::to_string(options_.watch_timeout.count());
  if (!options_.selector.empty()) path += "&" + options_.selector;
  // The server ends the stream after timeoutSeconds; a read that waits longer than that (and
  // a margin) means the connection is dead.
  Response r = api_.watch(
      path, [this](const json& event) { return apply(event); },
      options_.watch_timeout + std::chrono::seconds(30));
  if (r.status == 410) {
    std::lock_guard lock(mu_);
    ++stats_.expired;
    need_list_ = true;
    say("watch of " + options_.path + " from version " + version + " expired; listing again");
    return;
  }
  if (r.status != 200) {
    throw Error(
        ErrorKind::kEnvironment,
        "watch " + options_.path + " answered " + std::to_string(r.status) + ": " + r.message(),
        "check the controller's RBAC rules and the API server");
  }
  std::lock_guard lock(mu_);
  backoff_ = std::chrono::milliseconds(0);
}

bool Informer::apply(const json& event) {
  std::string type = event.value("type", "");
  const json& object = event.contains("object") ? event["object"] : json();
  if (type == "ERROR") {
    std::lock_guard lock(mu_);
    int code = object.is_object() ? object.value("code", 0) : 0;
    if (code == 410) {
      ++stats_.expired;
      say("watch of " + options_.path + " expired (" +
          (object.is_object() ? object.value("message", std::string()) : std::string()) +
          "); listing again");
    } else {
      say("watch of " + options_.path + " sent an error (" + object.dump() + "); listing again");
    }
    need_list_ = true;
    return false;
  }
  if (type == "BOOKMARK") {
    std::lock_guard lock(mu_);
    ++stats_.bookmarks;
    if (auto v = version_of(object); !v.empty()) stats_.resource_version = v;
    return true;
  }
  if (type != "ADDED" && type != "MODIFIED" && type != "DELETED") return true;
  if (!object.is_object() || !object.contains("metadata")) return true;
  std::string key = key_of(object);
  {
    std::lock_guard lock(mu_);
    if (stopping_) return false;
    if (type == "DELETED") {
      objects_.erase(key);
    } else {
      objects_[key] = object;
    }
    if (auto v = version_of(object); !v.empty()) stats_.resource_version = v;
  }
  on_change_(key);
  return true;
}

void Informer::sleep_backoff() {
  std::unique_lock lock(mu_);
  // Doubling with jitter, so that every node's controller does not hit a recovering API
  // server at the same instant.
  backoff_ =
      backoff_.count() == 0 ? options_.backoff_min : std::min(backoff_ * 2, options_.backoff_max);
  static thread_local std::minstd_rand rng{std::random_device{}()};
  auto jitter = std::chrono::milliseconds(rng() % (backoff_.count() / 4 + 1));
  cv_.wait_for(lock, backoff_ + jitter, [&] { return stopping_; });
}

}  // namespace gpusnap::kube
