// Keeps a local, current copy of one collection of Kubernetes objects, the way every controller
// does: list (which returns the collection's resourceVersion), then watch from that version,
// and on each event update the copy and tell the owner which object changed. A watch that ends
// (the server's timeout, a cut connection) is opened again from the last version seen, with a
// growing backoff on errors; a version the server no longer has (410 Gone, reason Expired)
// means events may have been missed, so the collection is listed again and every object that
// appeared, changed or vanished meanwhile is reported. Bookmarks move the version forward
// without an object, so a quiet collection does not fall behind the server's history.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "kube/api_client.h"

namespace gpusnap::kube {

struct InformerOptions {
  // The collection, e.g. "/api/v1/pods" or "/apis/gpusnap.io/v1alpha1/gpusnapshots".
  std::string path;
  // Extra query, already encoded, e.g. "fieldSelector=spec.nodeName%3Dnode-1"; may be empty.
  std::string selector;
  // Asked of the server for each watch (timeoutSeconds): it ends the stream after this long.
  std::chrono::seconds watch_timeout{300};
  std::chrono::milliseconds backoff_min{200};
  std::chrono::milliseconds backoff_max{30000};
  // Where one-line diagnostics go (a watch that failed, a re-list).
  std::function<void(const std::string&)> log;
};

struct InformerStats {
  int lists = 0;                 // full lists, the first one included
  int watches = 0;               // watch requests opened
  int expired = 0;               // 410 Gone answers (HTTP or in-stream) that forced a re-list
  int bookmarks = 0;             // BOOKMARK events
  std::string resource_version;  // the version the next watch starts from
};

// Thread-safe. One thread per informer, started by start() and joined by stop() or the
// destructor.
class Informer {
 public:
  // on_change(key) is called from the informer's thread, key "namespace/name" (or "name" for
  // a cluster-scoped object), after the copy has been updated; get(key) then answers the new
  // state (nullopt once deleted). It must not block for long and must not throw.
  using Handler = std::function<void(const std::string& key)>;

  Informer(const ApiConfig& api, InformerOptions options, Handler on_change);
  ~Informer();
  Informer(const Informer&) = delete;
  Informer& operator=(const Informer&) = delete;

  void start();
  void stop() noexcept;

  std::optional<nlohmann::json> get(const std::string& key) const;
  std::vector<nlohmann::json> items() const;
  // Whether the first list has been loaded; waits up to `timeout` for it.
  bool wait_synced(std::chrono::milliseconds timeout) const;
  InformerStats stats() const;

  static std::string key_of(const nlohmann::json& object);

 private:
  void run();
  void list();
  // Opens one watch; returns when it ends. Sets need_list_ when the version expired.
  void watch_once();
  // Applies one watch event; false ends the stream.
  bool apply(const nlohmann::json& event);
  void sleep_backoff();
  void say(const std::string& line) const;

  ApiClient api_;
  InformerOptions options_;
  Handler on_change_;

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::map<std::string, nlohmann::json> objects_;
  InformerStats stats_;
  bool synced_ = false;
  bool stopping_ = false;
  bool need_list_ = true;
  bool finished_ = false;  // run() has returned
  std::chrono::milliseconds backoff_{0};
  std::jthread thread_;
};

}  // namespace gpusnap::kube
