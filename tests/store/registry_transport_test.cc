// The registry client's transport (src/store/registry.cc) against registries as production runs
// them: a real docker-registry on loopback whose blobs are redirected to another host, and
// servers written here that misbehave the ways registries, object storage and proxies do.
// Registry's calls are driven directly: push and pull, the CLI and the agent all reach a
// registry through them. The redirect is also checked end to end, for the agent's pulls and
// `gpusnap pull` (AgentsAndARedirectingRegistry in tests/agent/agent_system_test.cc).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <nlohmann/json.hpp>

// The receive buffer is the build's (CPPHTTPLIB_RECV_BUFSIZ, set for every user of httplib),
// so that this test and src/store/registry.cc see one httplib.
#include <httplib.h>

#include "common/fs.h"
#include "gpusnap/error.h"
#include "store/digest.h"
#include "store/recording_server.h"
#include "store/registry.h"
#include "store/registry_fixture.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

namespace sfs = std::filesystem;
using store::OciRef;
using store::Registry;
using store::RegistryOptions;

std::string auth_json(const sfs::path& file, const std::string& host, const std::string& user,
                      const std::string& password) {
  const std::string pair = user + ":" + password;
  fs::write_file(file, R"({"auths":{")" + host + R"(":{"auth":")" +
                           httplib::detail::base64_encode(pair) + R"("}}})");
  return file.string();
}

std::string blob_of(int i) { return "chunk " + std::to_string(i) + std::string(70000, 'x'); }

class RegistryTransport : public ::testing::Test {
 protected:
  void SetUp() override { GPUSNAP_SKIP_IF_BLOCKED(LocalRegistry::blocker()); }
  TempDir dir_;
};

// Expects `fn` to throw an Error of `kind` whose message holds `text`; returns the message.
template <class Fn>
std::string expect_error(Fn&& fn, ErrorKind kind, const std::string& text) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.one_line();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.one_line();
    EXPECT_FALSE(e.hint().empty()) << e.one_line();
    return e.one_line();
  }
  ADD_FAILURE() << "no Error with '" << text << "'";
  return {};
}

TEST_F(RegistryTransport, ARedirectedBlobGoesOnWithoutThePassword) {
  sfs::path storage;
  RecordingServer target([&storage](const httplib::Request& req, httplib::Response& res) {
    serve_files(storage)(req, res);
  });
  LocalRegistry::Options o;
  o.username = "gpusnap";
  o.password = "s3cret-pass";
  o.extra_config = redirect_middleware("http://" + target.host() + "/");
  LocalRegistry registry(dir_, o);
  storage = registry.storage();

  RegistryOptions ro;
  ro.plain_http = true;
  ro.retries = 0;
  ro.auth_file = auth_json(dir_ / "auth.json", registry.host(), o.username, o.password);
  Registry r(OciRef::parse(registry.ref("t/redirect:1")), ro);
  for (int i = 0; i < 3; ++i) {
    const std::string data = blob_of(i);
    r.upload_blob(store::sha256_digest(data), data);
  }
  for (int i = 0; i < 3; ++i) {
    const std::string data = blob_of(i);
    EXPECT_EQ(r.fetch_blob(store::sha256_digest(data), data.size()), data);
    EXPECT_TRUE(r.blob_exists(store::sha256_digest(data)));
  }
  // Every blob came from the other host, and none of its requests carried the password.
  const auto seen = target.seen();
  ASSERT_GE(seen.size(), 3u);
  for (const auto& s : seen) EXPECT_EQ(s.authorization, "") << s.method << " " << s.path;
  // The registry itself wanted it: without credentials it refuses.
  RegistryOptions anonymous = ro;
  anonymous.auth_file = auth_json(dir_ / "none.json", "elsewhere:1", "a", "b");
  Registry without(OciRef::parse(registry.ref("t/redirect:1")), anonymous);
  const std::string data = blob_of(0);
  expect_error([&] { without.fetch_blob(store::sha256_digest(data), data.size()); },
               ErrorKind::kEnvironment, "HTTP 401");
}

TEST_F(RegistryTransport, ARedirectFromHttpsToHttpIsRefused) {
  RecordingServer target(serve_files(dir_ / "nothing"));
  LocalRegistry::Options o;
  o.tls = true;
  o.extra_config = redirect_middleware("http://" + target.host() + "/");
  LocalRegistry registry(dir_, o);
  RegistryOptions ro;
  ro.ca_file = registry.ca_file().string();
  ro.retries = 0;
  Registry r(OciRef::parse(registry.ref("t/tls:1")), ro);
  const std::string data = blob_of(7);
  r.upload_blob(store::sha256_digest(data), data);
  expect_error([&] { r.fetch_blob(store::sha256_digest(data), data.size()); },
               ErrorKind::kEnvironment, "from https to http://" + target.host());
  EXPECT_TRUE(target.seen().empty());
}

// A registry (a front written here) whose redirects are bad: a port out of range, a loop, a
// target that has nothing. Each a clear Error naming the host, never an internal error.
TEST_F(RegistryTransport, BadRedirectsAreClearErrorsNamingTheHost) {
  RecordingServer empty_storage(serve_files(dir_ / "nothing"));
  RecordingServer front([&](const httplib::Request& req, httplib::Response& res) {
    res.status = 307;
    if (req.path.find("badport") != std::string::npos) {
      res.set_header("Location", "http://127.0.0.1:99999999999/data");
    } else if (req.path.find("loop") != std::string::npos) {
      res.set_header("Location", req.path);  // relative, to itself
    } else {
      res.set_header("Location", "http://" + empty_storage.host() + "/data");
    }
  });
  RegistryOptions ro;
  ro.plain_http = true;
  ro.retries = 0;
  const std::string digest = store::sha256_digest("x");
  Registry badport(OciRef::parse("oci://" + front.host() + "/badport/r:1"), ro);
  expect_error([&] { badport.fetch_blob(digest, 1); }, ErrorKind::kEnvironment,
               "the port is not a number of 1 to 65535");
  Registry loop(OciRef::parse("oci://" + front.host() + "/loop/r:1"), ro);
  expect_error([&] { loop.fetch_blob(digest, 1); }, ErrorKind::kEnvironment, "redirects for");
  Registry missing(OciRef::parse("oci://" + front.host() + "/missing/r:1"), ro);
  expect_error([&] { missing.fetch_blob(digest, 1); }, ErrorKind::kNotFound,
               empty_storage.host() + " (a redirect of registry " + front.host() + ")");
  EXPECT_EQ(empty_storage.seen().size(), 1u);
}

// Sets an environment variable for one test (unset: nullptr), and restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value != nullptr ? ::setenv(name, value, 1) : ::unsetenv(name);
  }
  ~ScopedEnv() { old_ ? ::setenv(name_, old_->c_str(), 1) : ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A TCP server on loopback that misbehaves as a registry can: each connection's request is read
// (up to its blank line), then `behave` gets the socket and a flag that says the test is over.
class RawServer {
 public:
  using Behaviour =
      std::function<void(int fd, const std::string& head, const std::atomic<bool>& over)>;
  explicit RawServer(Behaviour behave) : behave_(std::move(behave)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listener_, 16) != 0 ||
        ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      throw std::runtime_error("cannot listen on loopback");
    }
    port_ = ntohs(a.sin_port);
    accepter_ = std::thread([this] { accept_loop(); });
  }
  RawServer(const RawServer&) = delete;
  RawServer& operator=(const RawServer&) = delete;
  ~RawServer() {
    over_ = true;
    ::shutdown(listener_, SHUT_RDWR);
    accepter_.join();
    for (auto& t : connections_) t.join();
    ::close(listener_);
  }
  std::string host() const { return "127.0.0.1:" + std::to_string(port_); }
  int accepted() const { return accepted_; }

 private:
  void accept_loop() {
    while (!over_) {
      int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      ++accepted_;
      connections_.emplace_back([this, fd] {
        std::string head;
        char ch = 0;
        while (head.find("\r\n\r\n") == std::string::npos && ::read(fd, &ch, 1) == 1) head += ch;
        behave_(fd, head, over_);
        ::close(fd);
      });
    }
  }

  Behaviour behave_;
  int listener_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> over_{false};
  std::atomic<int> accepted_{0};
  std::thread accepter_;
  std::vector<std::thread> connections_;  // joined at the end
};

// Sleeps `d` unless the test ends first.
void nap(std::chrono::milliseconds d, const std::atomic<bool>& over) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (!over && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Small bounds, so that a stall is seen in half a second: 16 bytes in 0.5 s, 2 s and 1 MiB/s.
RegistryOptions tight_bounds() {
  RegistryOptions o;
  o.plain_http = true;
  o.retries = 5;
  o.backoff = std::chrono::milliseconds(10);
  o.stall_window = std::chrono::milliseconds(500);
  o.stall_bytes = 16;
  o.deadline_base = std::chrono::milliseconds(2000);
  o.min_rate = 1 << 20;
  o.stall_retries = 1;
  return o;
}

// Fetches a 1 MiB blob from `server` with tight_bounds(); expects exit 11 naming the server
// and `why`, with two attempts (the stall retried once), within `bound`.
void expect_timeout(const RawServer& server, const std::string& why,
                    std::chrono::milliseconds bound) {
  Registry r(OciRef::parse("oci://" + server.host() + "/r/stalls:1"), tight_bounds());
  const auto start = std::chrono::steady_clock::now();
  const std::string message =
      expect_error([&] { r.fetch_blob(store::sha256_digest("x"), 1 << 20); }, ErrorKind::kTimeout,
                   "registry " + server.host() + ": cannot fetch blob sha256:");
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_NE(message.find(why), std::string::npos) << message;
  EXPECT_NE(message.find("2 times"), std::string::npos) << message;
  EXPECT_LT(took, bound) << message;
  EXPECT_EQ(server.accepted(), 2) << message;
}

TEST(RegistryBounds, ASilentRegistryFailsWithExit11WithinTheWindow) {
  RawServer silent([](int, const std::string&, const std::atomic<bool>& over) {
    nap(std::chrono::seconds(60), over);  // accepts, reads the request, never answers
  });
  // Two attempts, each cut after one or two windows of 0.5 s.
  expect_timeout(silent, "moved 0 bytes in 0.5 s", std::chrono::milliseconds(3000));
}

TEST(RegistryBounds, ATricklingRegistryFailsWithExit11WithinTheWindow) {
  RawServer trickle([](int fd, const std::string&, const std::atomic<bool>& over) {
    // The headers at once, then the body a byte at a time, 4 bytes a second.
    const std::string head = "HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n";
    if (::send(fd, head.data(), head.size(), MSG_NOSIGNAL) < 0) return;
    while (!over && ::send(fd, "x", 1, MSG_NOSIGNAL) == 1)
      nap(std::chrono::milliseconds(250), over);
  });
  expect_timeout(trickle, "bytes in 0.5 s (the least is 16)", std::chrono::milliseconds(3000));
}

TEST(RegistryBounds, ASlowRegistryFailsAtTheDeadlineOfItsBody) {
  RawServer slow([](int fd, const std::string&, const std::atomic<bool>& over) {
    // 4 KiB a second: above the stall's 16 bytes in 0.5 s, far below the deadline's 1 MiB/s
    // (2 s + 1 s for 1 MiB).
    const std::string head = "HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n";
    if (::send(fd, head.data(), head.size(), MSG_NOSIGNAL) < 0) return;
    const std::string piece(400, 'x');
    while (!over && ::send(fd, piece.data(), piece.size(), MSG_NOSIGNAL) > 0) {
      nap(std::chrono::milliseconds(100), over);
    }
  });
  expect_timeout(slow, "did not finish within its deadline", std::chrono::milliseconds(8000));
}

// Copies bytes both ways between two sockets until either side closes or the test ends.
void pipe_both_ways(int a, int b, const std::atomic<bool>& over) {
  char buf[65536];
  while (!over) {
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    if (::poll(fds, 2, 100) < 0) return;
    for (int i = 0; i < 2; ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n <= 0) return;
      if (::send(fds[1 - i].fd, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) return;
    }
  }
}

int connect_to(const std::string& host_port) {
  const auto colon = host_port.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1))));
  ::inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &a.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A forward proxy: CONNECT HOST:PORT tunnels (https), an absolute-form request is passed on
// to its host (http). Records each connection's first request line.
class TestProxy {
 public:
  TestProxy()
      : server_([this](int fd, const std::string& head, const std::atomic<bool>& over) {
          const std::string line = head.substr(0, head.find("\r\n"));
          {
            std::lock_guard lock(mu_);
            lines_.push_back(line);
          }
          std::string target;
          if (line.starts_with("CONNECT ")) {
            target = line.substr(8, line.find(' ', 8) - 8);
          } else if (auto at = line.find(" http://"); at != std::string::npos) {
            target = line.substr(at + 8, line.find('/', at + 8) - at - 8);
          }
          const int up = target.empty() ? -1 : connect_to(target);
          if (up < 0) {
            const std::string no = "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n";
            (void)::send(fd, no.data(), no.size(), MSG_NOSIGNAL);
            return;
          }
          const std::string ok = "HTTP/1.1 200 Connection established\r\n\r\n";
          if (line.starts_with("CONNECT ")) {
            (void)::send(fd, ok.data(), ok.size(), MSG_NOSIGNAL);
          } else {
            (void)::send(up, head.data(), head.size(), MSG_NOSIGNAL);
          }
          pipe_both_ways(fd, up, over);
          ::close(up);
        }) {}
  std::string url() const { return "http://" + server_.host(); }
  std::vector<std::string> lines() const {
    std::lock_guard lock(mu_);
    return lines_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> lines_;
  RawServer server_;  // last: it stops (joining its threads) before the rest goes
};

TEST_F(RegistryTransport, ProxiesFromTheEnvironmentAndNoProxy) {
  LocalRegistry plain(dir_, {});
  LocalRegistry::Options o;
  o.tls = true;
  LocalRegistry tls(dir_, o);
  TestProxy proxy;
  ScopedEnv a("http_proxy", nullptr), b("https_proxy", nullptr), c("no_proxy", nullptr);
  ScopedEnv d("HTTP_PROXY", proxy.url().c_str()), e("HTTPS_PROXY", proxy.url().c_str());
  ScopedEnv f("NO_PROXY", "example.com, .internal");
  const std::string data = blob_of(3);
  const std::string digest = store::sha256_digest(data);

  RegistryOptions po;
  po.plain_http = true;
  Registry over_http(OciRef::parse(plain.ref("t/proxied:1")), po);
  over_http.upload_blob(digest, data);
  EXPECT_EQ(over_http.fetch_blob(digest, data.size()), data);
  auto lines = proxy.lines();
  ASSERT_FALSE(lines.empty());
  EXPECT_TRUE(lines[0].starts_with("POST http://" + plain.host() + "/v2/t/proxied/blobs/uploads/"))
      << lines[0];

  RegistryOptions to;
  to.ca_file = tls.ca_file().string();
  Registry over_tls(OciRef::parse(tls.ref("t/proxied:1")), to);
  over_tls.upload_blob(digest, data);
  EXPECT_EQ(over_tls.fetch_blob(digest, data.size()), data);
  lines = proxy.lines();
  EXPECT_NE(std::find(lines.begin(), lines.end(), "CONNECT " + tls.host() + " HTTP/1.1"),
            lines.end());

  // NO_PROXY naming the registry's address (with and without its port): straight to it.
  const size_t before = proxy.lines().size();
  for (const std::string& no : std::vector<std::string>{"127.0.0.1", "localhost, " + tls.host(),
                                                        "*", "10.0.0.0/8, 127.0.0.0/8"}) {
    ScopedEnv g("NO_PROXY", no.c_str());
    Registry direct(OciRef::parse(tls.ref("t/proxied:1")), to);
    EXPECT_EQ(direct.fetch_blob(digest, data.size()), data) << no;
  }
  EXPECT_EQ(proxy.lines().size(), before);
  // A range the registry's address is not in leaves it behind the proxy.
  {
    ScopedEnv g("NO_PROXY", "10.0.0.0/8, 127.0.0.0/33, ::1/128");
    Registry proxied(OciRef::parse(tls.ref("t/proxied:1")), to);
    EXPECT_EQ(proxied.fetch_blob(digest, data.size()), data);
  }
  EXPECT_GT(proxy.lines().size(), before);

  ScopedEnv h("HTTPS_PROXY", "socks5://127.0.0.1:1080");
  Registry socks(OciRef::parse(tls.ref("t/proxied:1")), to);
  expect_error([&] { socks.blob_exists(digest); }, ErrorKind::kUsage,
               "HTTPS_PROXY=socks5://127.0.0.1:1080: gpusnap speaks to proxies in http:// only");
}

TEST_F(RegistryTransport, CertsDirectoriesAndCaFileAddToTheSystemsTrust) {
  LocalRegistry::Options o;
  o.tls = true;
  LocalRegistry first(dir_, o);
  LocalRegistry second(dir_, o);  // another CA
  const std::string data = blob_of(4);
  const std::string digest = store::sha256_digest(data);

  RegistryOptions ro;
  ro.retries = 0;
  ro.certs_dirs = {(dir_ / "containers-certs.d").string(), (dir_ / "docker-certs.d").string()};
  Registry untrusted(OciRef::parse(first.ref("t/trust:1")), ro);
  expect_error([&] { untrusted.blob_exists(digest); }, ErrorKind::kEnvironment, "TLS failed");

  // docker's convention (the second root): HOST:PORT/ca.crt.
  sfs::create_directories(dir_ / "docker-certs.d" / first.host());
  sfs::copy_file(first.ca_file(), dir_ / "docker-certs.d" / first.host() / "ca.crt");
  Registry trusted(OciRef::parse(first.ref("t/trust:1")), ro);
  trusted.upload_blob(digest, data);
  EXPECT_TRUE(trusted.blob_exists(digest));

  // The system's CAs (here SSL_CERT_FILE, which OpenSSL's default paths read) stay trusted
  // with --ca-file: the file adds the second registry's CA to them.
  ScopedEnv cert_file("SSL_CERT_FILE", first.ca_file().c_str());
  RegistryOptions both = ro;
  both.certs_dirs = {};
  both.ca_file = second.ca_file().string();
  Registry to_first(OciRef::parse(first.ref("t/trust:1")), both);
  EXPECT_TRUE(to_first.blob_exists(digest));
  Registry to_second(OciRef::parse(second.ref("t/trust:1")), both);
  to_second.upload_blob(digest, data);
  EXPECT_TRUE(to_second.blob_exists(digest));

  // A client certificate without its key is named.
  fs::write_file(dir_ / "docker-certs.d" / first.host() / "client.cert", "x");
  expect_error([&] { Registry(OciRef::parse(first.ref("t/trust:1")), ro).blob_exists(digest); },
               ErrorKind::kEnvironment, "client.cert has no key beside it");
}

TEST_F(RegistryTransport, TheUserAgentNamesGpusnapAndItsVersion) {
  RecordingServer server([](const httplib::Request&, httplib::Response& res) { res.status = 404; });
  RegistryOptions ro;
  ro.plain_http = true;
  Registry r(OciRef::parse("oci://" + server.host() + "/t/agent:1"), ro);
  EXPECT_FALSE(r.blob_exists(store::sha256_digest("x")));
  ASSERT_EQ(server.seen().size(), 1u);
  EXPECT_EQ(server.seen()[0].user_agent, std::string("gpusnap/") + GPUSNAP_VERSION);
}

// base64url without padding, as JWTs write their parts.
std::string b64url(const std::string& in) {
  std::string s = httplib::detail::base64_encode(in);
  for (auto& ch : s) ch = ch == '+' ? '-' : ch == '/' ? '_' : ch;
  while (!s.empty() && s.back() == '=') s.pop_back();
  return s;
}

// A token service as hosted registries run one (the distribution token flow): GET
// /token?service=S&scope=repository:NAME:ACTIONS, with Basic credentials or none, answers a
// JWT signed with a key whose certificate docker-registry trusts (rootcertbundle). Anonymous
// callers get pull only; the right password gets what the scope asks; a wrong one 401.
class TokenService {
 public:
  TokenService(const sfs::path& dir, std::string user, std::string password, int expires_in)
      : user_(std::move(user)),
        password_(std::move(password)),
        expires_in_(expires_in),
        server_([this](const httplib::Request& req, httplib::Response& res) { issue(req, res); }) {
    key_ = dir / "token.key";
    cert_ = dir / "token.pem";
    const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=token "
                            "-keyout " +
                            key_.string() + " -out " + cert_.string() + " >/dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error("openssl req failed");
  }
  // The registry's `auth: token` configuration.
  std::string config() const {
    return "auth:\n  token:\n    realm: http://" + server_.host() +
           "/token\n    service: gpusnap-registry\n    issuer: gpusnap-token-issuer\n"
           "    rootcertbundle: " +
           cert_.string() + "\n";
  }
  std::vector<Seen> seen() const { return server_.seen(); }

 private:
  void issue(const httplib::Request& req, httplib::Response& res) {
    const std::string auth = req.get_header_value("Authorization");
    bool known = auth == "Basic " + httplib::detail::base64_encode(user_ + ":" + password_);
    if (!auth.empty() && !known) {
      res.status = 401;
      return;
    }
    // OAuth2's refresh grant (an identity token): a form, the token in it, no Authorization.
    if (req.method == "POST") {
      if (req.get_param_value("grant_type") != "refresh_token" ||
          req.get_param_value("refresh_token") != "refresh-" + password_) {
        res.status = 401;
        return;
      }
      known = true;
    }
    // scope=repository:NAME:pull,push
    const std::string scope = req.get_param_value("scope");
    const auto first = scope.find(':');
    const auto last = scope.rfind(':');
    nlohmann::json actions = nlohmann::json::array();
    if (first != last) {
      std::string wanted = scope.substr(last + 1);
      for (const char* a : {"pull", "push"}) {
        if (wanted.find(a) != std::string::npos && (known || std::string(a) == "pull")) {
          actions.push_back(a);
        }
      }
    }
    const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    nlohmann::json claims = {
        {"iss", "gpusnap-token-issuer"},
        {"sub", known ? user_ : ""},
        {"aud", req.get_param_value("service")},
        {"exp", now + expires_in_},
        {"nbf", now - 10},
        {"iat", now},
        {"jti", fs::random_id()},
        {"access", first == last ? nlohmann::json::array()
                                 : nlohmann::json::array(
                                       {{{"type", scope.substr(0, first)},
                                         {"name", scope.substr(first + 1, last - first - 1)},
                                         {"actions", actions}}})}};
    res.set_content(
        nlohmann::json{{"token", sign(claims.dump())}, {"expires_in", expires_in_}}.dump(),
        "application/json");
  }

  // RS256 over header.claims, the header naming the signing certificate (x5c).
  std::string sign(const std::string& claims) const {
    std::string pem;
    fs::try_read_file(cert_, &pem);
    BIO* cb = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
    X509* cert = PEM_read_bio_X509(cb, nullptr, nullptr, nullptr);
    BIO_free(cb);
    unsigned char* der = nullptr;
    const int der_len = i2d_X509(cert, &der);
    X509_free(cert);
    const std::string x5c = httplib::detail::base64_encode(
        std::string(reinterpret_cast<char*>(der), static_cast<size_t>(der_len)));
    OPENSSL_free(der);
    const std::string input =
        b64url(nlohmann::json{{"typ", "JWT"}, {"alg", "RS256"}, {"x5c", {x5c}}}.dump()) + "." +
        b64url(claims);
    std::string key_pem;
    fs::try_read_file(key_, &key_pem);
    BIO* kb = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
    EVP_PKEY* key = PEM_read_bio_PrivateKey(kb, nullptr, nullptr, nullptr);
    BIO_free(kb);
    EVP_MD_CTX* ctx = EVP_MD_CTX_new();
    size_t len = 0;
    EVP_DigestSignInit(ctx, nullptr, EVP_sha256(), nullptr, key);
    EVP_DigestSign(ctx, nullptr, &len, reinterpret_cast<const unsigned char*>(input.data()),
                   input.size());
    std::string sig(len, '\0');
    EVP_DigestSign(ctx, reinterpret_cast<unsigned char*>(sig.data()), &len,
                   reinterpret_cast<const unsigned char*>(input.data()), input.size());
    sig.resize(len);
    EVP_MD_CTX_free(ctx);
    EVP_PKEY_free(key);
    return input + "." + b64url(sig);
  }

  std::string user_;
  std::string password_;
  int expires_in_;
  sfs::path key_;
  sfs::path cert_;
  RecordingServer server_;  // last: it stops before the rest goes
};

TEST_F(RegistryTransport, BearerTokensAreFetchedReusedAndRefreshed) {
  TokenService tokens(dir_.path(), "gpusnap", "t0ken-pass", 10);
  LocalRegistry::Options o;
  o.extra_config = tokens.config();
  LocalRegistry registry(dir_, o);
  RegistryOptions ro;
  ro.plain_http = true;
  ro.retries = 0;
  ro.auth_file = auth_json(dir_ / "auth.json", registry.host(), "gpusnap", "t0ken-pass");
  Registry r(OciRef::parse(registry.ref("team/app:1")), ro);
  for (int i = 0; i < 6; ++i) {
    const std::string data = blob_of(i);
    r.upload_blob(store::sha256_digest(data), data);
    EXPECT_EQ(r.fetch_blob(store::sha256_digest(data), data.size()), data);
  }
  // One token for push and pull, fetched with the credentials, reused for every request.
  auto seen = tokens.seen();
  ASSERT_EQ(seen.size(), 1u);
  // The scope is the registry's challenge, whose actions docker-registry lists in either order.
  EXPECT_TRUE(seen[0].path.find("scope=repository%3Ateam%2Fapp%3Apull%2Cpush") !=
                  std::string::npos ||
              seen[0].path.find("scope=repository%3Ateam%2Fapp%3Apush%2Cpull") != std::string::npos)
      << seen[0].path;
  EXPECT_TRUE(seen[0].authorization.starts_with("Basic ")) << seen[0].authorization;

  // Anonymous: a pull token, enough to fetch, not to push.
  RegistryOptions anonymous = ro;
  anonymous.auth_file = auth_json(dir_ / "none.json", "elsewhere:1", "a", "b");
  Registry reader(OciRef::parse(registry.ref("team/app:1")), anonymous);
  const std::string data = blob_of(0);
  EXPECT_EQ(reader.fetch_blob(store::sha256_digest(data), data.size()), data);
  EXPECT_EQ(tokens.seen().back().authorization, "");
  expect_error([&] { reader.upload_blob(store::sha256_digest("new"), "new"); },
               ErrorKind::kEnvironment, "refused to upload blob");

  // A wrong password is refused by the token service, and said so.
  RegistryOptions wrong = ro;
  wrong.auth_file = auth_json(dir_ / "wrong.json", registry.host(), "gpusnap", "nope");
  Registry intruder(OciRef::parse(registry.ref("team/app:1")), wrong);
  expect_error([&] { intruder.blob_exists(store::sha256_digest(data)); }, ErrorKind::kEnvironment,
               "refused the credentials from");

  // An identity token (docker login through an identity provider): exchanged at the realm by
  // OAuth2's refresh grant, in a POSTed form; the registry never sees it.
  {
    const auto file = dir_ / "identity.json";
    fs::write_file(file, R"({"auths":{")" + registry.host() +
                             R"(":{"auth":"","identitytoken":"refresh-t0ken-pass"}}})");
    RegistryOptions io = ro;
    io.auth_file = file.string();
    Registry by_identity(OciRef::parse(registry.ref("team/app:1")), io);
    const std::string fresh = blob_of(7);
    by_identity.upload_blob(store::sha256_digest(fresh), fresh);
    EXPECT_EQ(by_identity.fetch_blob(store::sha256_digest(fresh), fresh.size()), fresh);
    const Seen last = tokens.seen().back();
    EXPECT_EQ(last.method, "POST");
    EXPECT_EQ(last.authorization, "");
    EXPECT_EQ(last.path.find("refresh"), std::string::npos) << last.path;
    EXPECT_EQ(registry.log().find("refresh-t0ken-pass"), std::string::npos);
    fs::write_file(file,
                   R"({"auths":{")" + registry.host() + R"(":{"identitytoken":"refresh-stale"}}})");
    Registry stale(OciRef::parse(registry.ref("team/app:1")), io);
    expect_error([&] { stale.blob_exists(store::sha256_digest(fresh)); }, ErrorKind::kEnvironment,
                 "refused the credentials from");
  }

  // The token expires (10 s, used up to 5 s before): the next request fetches another.
  const size_t before = tokens.seen().size();
  std::this_thread::sleep_for(std::chrono::milliseconds(5200));
  EXPECT_TRUE(r.blob_exists(store::sha256_digest(data)));
  EXPECT_EQ(tokens.seen().size(), before + 1);
}

// docker-credential-NAME on PATH answering `get` for one host, as docker's helpers do.
sfs::path credential_helper(const sfs::path& dir, const std::string& name,
                            const std::string& host) {
  sfs::create_directories(dir / "bin");
  const sfs::path script = dir / "bin" / ("docker-credential-" + name);
  fs::write_file(script, "#!/bin/sh\n[ \"$1\" = get ] || exit 3\nread -r host\n"
                         "if [ \"$host\" = \"" +
                             host +
                             "\" ]; then\n"
                             "  echo '{\"ServerURL\":\"" +
                             host + "\",\"Username\":\"helped\",\"Secret\":\"from-" + name +
                             "\"}'\n"
                             "else echo 'credentials not found in native keychain'; exit 1; fi\n");
  sfs::permissions(script, sfs::perms::owner_all);
  return dir / "bin";
}

TEST(RegistryCredentials, FoundWhereSkopeoFindsThemHelpersAndRepositoryKeysIncluded) {
  TempDir dir;
  const sfs::path bin = credential_helper(dir.path(), "gpusnaptest", "reg.example:5000");
  const std::string path = bin.string() + ":" + std::getenv("PATH");
  ScopedEnv p("PATH", path.c_str());
  ScopedEnv a("REGISTRY_AUTH_FILE", nullptr), x("XDG_RUNTIME_DIR", nullptr);
  ScopedEnv d("DOCKER_CONFIG", nullptr), h("HOME", dir.path().c_str());

  // ~/.config/containers/auth.json, with per-repository keys: the longest prefix wins.
  sfs::create_directories(dir / ".config/containers");
  const std::string user_a = httplib::detail::base64_encode("host:wide");
  const std::string user_b = httplib::detail::base64_encode("team:only");
  fs::write_file(dir / ".config/containers/auth.json",
                 R"({"auths":{"reg.example:5000":{"auth":")" + user_a +
                     R"("},"reg.example:5000/team":{"auth":")" + user_b + R"("}}})");
  EXPECT_EQ(store::find_credentials("reg.example:5000", "team/app", "").username, "team");
  EXPECT_EQ(store::find_credentials("reg.example:5000", "teammate/app", "").username, "host");
  EXPECT_EQ(store::find_credentials("reg.example:5000", "other", "").password, "wide");

  // credHelpers for the host first; credsStore for the rest.
  fs::write_file(dir / "helpers.json",
                 R"({"credHelpers":{"reg.example:5000":"gpusnaptest"},"auths":{}})");
  auto c = store::find_credentials("reg.example:5000", "team/app", (dir / "helpers.json").string());
  EXPECT_EQ(c.username, "helped");
  EXPECT_EQ(c.password, "from-gpusnaptest");
  fs::write_file(dir / "store.json", R"({"credsStore":"gpusnaptest"})");
  EXPECT_EQ(
      store::find_credentials("reg.example:5000", "x", (dir / "store.json").string()).password,
      "from-gpusnaptest");
  EXPECT_EQ(store::find_credentials("other:1", "x", (dir / "store.json").string()).username, "");

  // A helper that is missing or hangs is an Error naming it, within its 10 s.
  fs::write_file(dir / "missing.json", R"({"credsStore":"nosuchhelper"})");
  expect_error([&] { store::find_credentials("h", "x", (dir / "missing.json").string()); },
               ErrorKind::kEnvironment, "docker-credential-nosuchhelper");
}

}  // namespace
}  // namespace gpusnap::testing
