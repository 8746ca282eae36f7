// The API client and the informer against the local fake API server: the Kubernetes semantics
// the controller rests on (versions, watches from a version, 410 Gone, bookmarks, 409 Conflict).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "kube/api_client.h"
#include "kube/fake_apiserver.h"
#include "kube/informer.h"
#include "kube/objects.h"
#include "testing/unit.h"

namespace gpusnap::kube {
namespace {

using namespace std::chrono_literals;
using testing::FakeApiServer;
using testing::TempDir;

template <class Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = 10s) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

json pod(const std::string& name, const std::string& node) {
  return {{"metadata", {{"name", name}}},
          {"spec", {{"nodeName", node}, {"containers", {{{"name", "main"}, {"image", "x"}}}}}}};
}

class ApiClientTest : public ::testing::Test {
 protected:
  ApiConfig config() {
    std::ofstream(dir_ / "token") << server_.token() << "\n";
    ApiConfig c;
    c.server = server_.url();
    c.token_file = dir_ / "token";
    return c;
  }
  TempDir dir_;
  FakeApiServer server_;
};

TEST_F(ApiClientTest, WritesCarryVersionsAndStaleOnesConflict) {
  ApiClient api(config());
  Response created = api.create(pods_path("ns"), pod("p", "n1"));
  ASSERT_EQ(created.status, 201) << created.body;
  EXPECT_EQ(created.body["status"]["phase"], "Pending");
  std::string v1 = created.body["metadata"]["resourceVersion"];

  json updated = created.body;
  updated["status"]["phase"] = "Running";
  Response ok = api.update(pod_path("ns", "p") + "/status", updated);
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_GT(std::stoull(ok.body["metadata"]["resourceVersion"].get<std::string>()),
            std::stoull(v1));

  Response stale = api.update(pod_path("ns", "p") + "/status", updated);  // still v1
  EXPECT_EQ(stale.status, 409);
  EXPECT_EQ(stale.reason(), "Conflict");

  Response list = api.get(pods_path() + "?fieldSelector=" + common::url_encode("spec.nodeName=n1"));
  ASSERT_EQ(list.status, 200);
  EXPECT_EQ(list.body["metadata"]["resourceVersion"], std::to_string(server_.resource_version()));
  ASSERT_EQ(list.body["items"].size(), 1U);
  EXPECT_EQ(api.get(pods_path() + "?fieldSelector=" + common::url_encode("spec.nodeName=n2"))
                .body["items"]
                .size(),
            0U);
  EXPECT_EQ(api.create(pods_path("ns"), pod("p", "n1")).reason(), "AlreadyExists");
}

TEST_F(ApiClientTest, WrongTokenIsRefused) {
  ApiConfig c = config();
  std::ofstream(dir_ / "token") << "wrong\n";
  ApiClient api(c);
  EXPECT_EQ(api.get(pods_path()).status, 401);
}

TEST_F(ApiClientTest, UnreachableServerIsAnEnvironmentError) {
  ApiConfig c = config();
  c.server = "http://127.0.0.1:1";
  ApiClient api(c);
  Error e = testing::catch_error([&] { api.get("/api/v1/pods"); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_STREQ(e.what(),
               "Kubernetes API server http://127.0.0.1:1 did not answer GET /api/v1/pods: "
               "could not connect");
}

TEST_F(ApiClientTest, WatchFromTooOldVersionIsGone) {
  ApiClient api(config());
  server_.create("pods", "ns", pod("a", "n1"));
  server_.compact();
  std::vector<json> events;
  Response r = api.watch(
      pods_path() + "?watch=1&resourceVersion=1",
      [&](const json& e) {
        events.push_back(e);
        return true;
      },
      10s);
  EXPECT_EQ(r.status, 200);
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0]["type"], "ERROR");
  EXPECT_EQ(events[0]["object"]["code"], 410);
  EXPECT_EQ(events[0]["object"]["reason"], "Expired");

  server_.http_410 = true;
  Response gone = api.watch(
      pods_path() + "?watch=1&resourceVersion=1", [](const json&) { return true; }, 10s);
  EXPECT_EQ(gone.status, 410);
  EXPECT_EQ(gone.reason(), "Expired");
}

// The informer: a list, a watch from its version, and every change reported; a node's field
// selector turns a pod bound elsewhere into nothing, and a pod bound here into an ADDED.
TEST_F(ApiClientTest, InformerFollowsTheCollection) {
  std::mutex mu;
  std::vector<std::string> changed;
  InformerOptions o;
  o.path = pods_path();
  o.selector = "fieldSelector=" + common::url_encode("spec.nodeName=n1");
  Informer informer(config(), o, [&](const std::string& key) {
    std::lock_guard lock(mu);
    changed.push_back(key);
  });
  server_.create("pods", "ns", pod("before", "n1"));
  informer.start();
  ASSERT_TRUE(informer.wait_synced(5s));
  EXPECT_TRUE(informer.get("ns/before").has_value());

  server_.create("pods", "ns", pod("elsewhere", "n2"));
  server_.create("pods", "ns", pod("unbound", ""));
  server_.update("pods", "ns", "unbound", [](json& p) { p["spec"]["nodeName"] = "n1"; });
  ASSERT_TRUE(eventually([&] { return informer.get("ns/unbound").has_value(); }));
  server_.remove("pods", "ns", "before");
  ASSERT_TRUE(eventually([&] { return !informer.get("ns/before").has_value(); }));
  EXPECT_FALSE(informer.get("ns/elsewhere").has_value());
  InformerStats s = informer.stats();
  EXPECT_EQ(s.lists, 1);
  EXPECT_EQ(s.expired, 0);
  std::lock_guard lock(mu);
  EXPECT_EQ(changed, (std::vector<std::string>{"ns/before", "ns/unbound", "ns/before"}));
}

// A watch that ends is opened again from the last version; a bookmark moves that version on
// while nothing the informer sees changes, so a compaction of the quiet time costs no re-list.
TEST_F(ApiClientTest, BookmarkKeepsTheResumeVersionCurrent) {
  InformerOptions o;
  o.path = pods_path();
  o.selector = "fieldSelector=" + common::url_encode("spec.nodeName=n1");
  Informer informer(config(), o, [](const std::string&) {});
  informer.start();
  ASSERT_TRUE(informer.wait_synced(5s));
  for (int i = 0; i < 5; ++i) server_.create("pods", "ns", pod("other-" + std::to_string(i), "n2"));
  std::string now = std::to_string(server_.resource_version());
  // The real server sends a bookmark about once a minute; here, until one has arrived.
  ASSERT_TRUE(eventually([&] {
    server_.send_bookmarks();
    return informer.stats().resource_version == now;
  })) << informer.stats().resource_version
      << " vs " << now;
  EXPECT_GE(informer.stats().bookmarks, 1);
  server_.compact();
  server_.end_watches();
  ASSERT_TRUE(eventually([&] { return informer.stats().watches >= 2; }));
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(informer.stats().expired, 0);
  EXPECT_EQ(informer.stats().lists, 1);
  // The second watch started from the bookmark's version.
  int from_bookmark = 0;
  for (const auto& r : server_.requests()) {
    if (r.query.find("watch=1") != std::string::npos &&
        r.query.find("resourceVersion=" + now) != std::string::npos) {
      ++from_bookmark;
    }
  }
  EXPECT_GE(from_bookmark, 1);
}

// In a pod, the service account's files and the service's address come from the kubelet; here
// only the refusals can run (the machine is no pod). Environment edits happen while no other
// thread runs.
TEST(InClusterConfig, OutsideAPodSaysWhatIsMissing) {
  ::unsetenv("KUBERNETES_SERVICE_HOST");  // NOLINT(concurrency-mt-unsafe): single-threaded here
  Error e = testing::catch_error([] { ApiConfig::in_cluster(); });
  EXPECT_EQ(e.kind(), ErrorKind::kEnvironment);
  EXPECT_EQ(e.one_line(),
            "KUBERNETES_SERVICE_HOST is not set: not in a pod (fix: run inside a pod, or give "
            "--api-server URL --token-file FILE)");
  if (std::filesystem::exists("/var/run/secrets/kubernetes.io/serviceaccount/token")) {
    GTEST_SKIP() << "skipped: this machine has a service-account token";
  }
  ::setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1", 1);  // NOLINT(concurrency-mt-unsafe)
  Error no_token = testing::catch_error([] { ApiConfig::in_cluster(); });
  ::unsetenv("KUBERNETES_SERVICE_HOST");  // NOLINT(concurrency-mt-unsafe)
  EXPECT_EQ(no_token.one_line(),
            "no service-account token at /var/run/secrets/kubernetes.io/serviceaccount/token "
            "(fix: give the pod a service account with automountServiceAccountToken: true)");
}

}  // namespace
}  // namespace gpusnap::kube
