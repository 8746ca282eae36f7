// A local stand-in for kube-apiserver, for the controller's tests: the only fake of the
// Kubernetes side, so it keeps to what the real server does for the calls the controller makes.
//   - One resourceVersion counter for every write (etcd's revision); each object carries the
//     version of its last write; a list carries the collection's version.
//   - Watches stream newline-delimited JSON events (ADDED, MODIFIED, DELETED, BOOKMARK) from a
//     given version, replaying the history after it; version "" or "0" starts with synthetic
//     ADDED events for what exists. A version older than the compacted history is answered
//     like the real server: 200 and one ERROR event holding a Status with code 410, reason
//     Expired (or, with http_410, an HTTP 410 with that Status). timeoutSeconds ends a stream.
//     With a field or label selector, an object that starts or stops matching is seen as
//     ADDED or DELETED, as the watch cache does.
//   - Writes: create (409 AlreadyExists, generateName), update and merge-patch with the
//     resourceVersion precondition (409 Conflict on a stale one), the status subresource
//     (only status changes; the main resource ignores status), generation bumped on spec
//     changes, delete. Create resets a pod's status to Pending and drops a custom resource's.
//   - Field selectors (spec.nodeName, metadata.name, metadata.namespace, status.phase) and
//     equality label selectors; bearer-token authentication.
// Not modelled: admission, validation against the CRD schema, graceful deletion, finalizers,
// garbage collection of owned objects, pagination, strategic merge patch.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace gpusnap::testing {

using nlohmann::json;

class FakeApiServer {
 public:
  explicit FakeApiServer(std::string token = "test-token");
  ~FakeApiServer();
  FakeApiServer(const FakeApiServer&) = delete;
  FakeApiServer& operator=(const FakeApiServer&) = delete;

  std::string url() const;
  const std::string& token() const { return token_; }

  // Writes as another client would make them (a user, the scheduler, the kubelet): each bumps
  // the version and reaches the watches. `resource` is the plural ("pods", "gpusnapshots").
  json create(const std::string& resource, const std::string& ns, json object);
  // Replaces the stored object with mutate(copy), status included.
  json update(const std::string& resource, const std::string& ns, const std::string& name,
              const std::function<void(json&)>& mutate);
  void remove(const std::string& resource, const std::string& ns, const std::string& name);
  std::optional<json> get(const std::string& resource, const std::string& ns,
                          const std::string& name) const;
  std::vector<json> list(const std::string& resource) const;
  // The Events about one object, "Type Reason: message", in the order they were written.
  std::vector<std::string> events_about(const std::string& kind, const std::string& name) const;

  uint64_t resource_version() const;

  // Faults.
  // Forgets the history up to now: a watch from an older version gets 410 Gone.
  void compact();
  // Ends every open watch stream. With hold, new watch requests wait until release_watches():
  // a network partition during which the test changes things the controller does not see.
  void end_watches(bool hold = false);
  void release_watches();
  // Sends a BOOKMARK with the current version to every watch that asked for bookmarks.
  void send_bookmarks();
  // The next `times` status writes to this object find that someone else wrote it just
  // before (an annotation "test/interference" is set): a genuine stale-version 409.
  void interfere_with_status_writes(const std::string& resource, const std::string& ns,
                                    const std::string& name, int times = 1);
  bool http_410 = false;

  struct Request {
    std::string method, path, query;
    int status = 0;
  };
  std::vector<Request> requests() const;
  int count(const std::string& method, const std::string& path_suffix, int status) const;

 private:
  struct Event {
    uint64_t rv;
    std::string resource, type;
    json object, old;  // old: the object before a MODIFIED (for selectors)
  };
  using Key = std::tuple<std::string, std::string, std::string>;  // resource, ns, name

  struct Route {
    bool ok = false;
    std::string resource, ns, name, sub;
  };
  static Route route(const std::string& path);
  void handle(const httplib::Request& req, httplib::Response& res);
  void watch(const httplib::Request& req, httplib::Response& res, const Route& r);
  json store_write(const std::string& resource, const json& object, const std::string& type,
                   const json& old);  // under mu_
  uint64_t next_rv() { return ++rv_; }

  std::string token_;
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  std::thread thread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t rv_ = 100;
  uint64_t compacted_ = 0;
  std::map<Key, json> objects_;
  std::vector<Event> history_;
  std::map<Key, int> interfere_;
  uint64_t watch_epoch_ = 0;
  uint64_t bookmark_epoch_ = 0;
  bool hold_ = false;
  bool stopping_ = false;
  int uid_ = 0;
  std::vector<Request> requests_;
};

}  // namespace gpusnap::testing
