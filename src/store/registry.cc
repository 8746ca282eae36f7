// cpp-httplib's client, one connection per thread in flight (a Client is not thread-safe), kept
// in a pool so that chunks reuse their connections (keep-alive): a TLS handshake per 8 MiB
// chunk would cost more than the chunk.
#include "store/registry.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/x509_vfy.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>

// The build sets httplib's read size for every file that includes it (CMakeLists.txt): at its
// default, a chunk arrives in 4 KiB reads, each after a poll, and a pull spends its CPU there.
static_assert(CPPHTTPLIB_RECV_BUFSIZ >= (256u << 10), "httplib's read size is set by the build");

#include "common/fd.h"
#include "common/fs.h"
#include "common/subprocess.h"
#include "common/url.h"
#include "gpusnap/error.h"
#include "store/digest.h"
#include "store/snapshot_manifest.h"

namespace gpusnap::store {

namespace {

using nlohmann::json;

constexpr uint64_t kMaxAuthFileBytes = 1ull << 20;

// A failure worth another attempt: the connection broke, the registry is restarting or busy.
struct Transient {
  std::string what;
  bool stalled = false;  // cut by the watchdog: past its deadline, or too slow
};

using Clock = std::chrono::steady_clock;

double seconds(std::chrono::milliseconds d) { return static_cast<double>(d.count()) / 1000.0; }

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

std::string base64_decode(const std::string& in) {
  if (in.empty() || in.size() % 4 != 0) return {};
  std::string out(in.size() / 4 * 3, '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(in.data()),
                          static_cast<int>(in.size()));
  if (n < 0) return {};
  size_t pad = 0;
  for (size_t i = in.size(); i > 0 && in[i - 1] == '='; --i) ++pad;
  out.resize(static_cast<size_t>(n) - pad);
  return out;
}

// A text from the network, made fit for one line of a message: control characters as \xHH,
// at most `limit` bytes.
std::string printable(std::string_view text, size_t limit = 200) {
  std::string out;
  for (unsigned char ch : text.substr(0, limit)) {
    if (ch < 0x20 || ch == 0x7f) {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[ch >> 4];
      out += kHex[ch & 15];
    } else {
      out += static_cast<char>(ch);
    }
  }
  if (text.size() > limit) out += "...";
  return out;
}

const char* env(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read before threads start
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

OciRef OciRef::parse(std::string_view text) {
  auto bad = [&](const std::string& why) {
    return Error(
        ErrorKind::kUsage, "bad reference '" + std::string(text.substr(0, 200)) + "': " + why,
        "write oci://HOST[:PORT]/REPOSITORY[:TAG] or oci://HOST[:PORT]/REPOSITORY@sha256:HEX");
  };
  if (!is_oci(text)) throw bad("it does not start with oci://");
  std::string rest(text.substr(std::string_view(kOciScheme).size()));
  OciRef r;
  if (auto at = rest.find('@'); at != std::string::npos) {
    r.digest = rest.substr(at + 1);
    rest.resize(at);
    if (!valid_digest(r.digest))
      throw bad("the digest is not sha256: and 64 lower-case hex digits");
  }
  auto slash = rest.find('/');
  if (slash == std::string::npos || slash == 0) throw bad("no repository after the host");
  r.host = rest.substr(0, slash);
  std::string path = rest.substr(slash + 1);
  if (auto colon = path.rfind(':'); colon != std::string::npos) {
    r.tag = path.substr(colon + 1);
    path.resize(colon);
    static const std::regex kTag("[A-Za-z0-9_][A-Za-z0-9._-]{0,127}");
    if (!std::regex_match(r.tag, kTag)) throw bad("the tag is not a valid OCI tag");
  }
  r.repository = path;
  static const std::regex kHost(R"([A-Za-z0-9]([A-Za-z0-9.-]{0,252})(:[0-9]{1,5})?)");
  static const std::regex kRepo(
      "[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*)*");
  if (!std::regex_match(r.host, kHost)) throw bad("the host is not HOST or HOST:PORT");
  if (r.repository.size() > 255 || !std::regex_match(r.repository, kRepo)) {
    throw bad("the repository is not lower-case letters, digits and . _ - / as OCI allows");
  }
  if (r.tag.empty() && r.digest.empty()) r.tag = "latest";
  return r;
}

std::string OciRef::str() const {
  std::string s = std::string(kOciScheme) + host + "/" + repository;
  if (!tag.empty()) s += ":" + tag;
  if (!digest.empty()) s += "@" + digest;
  return s;
}

std::string OciRef::by_digest(const std::string& d) const {
  return std::string(kOciScheme) + host + "/" + repository + "@" + d;
}

namespace {

constexpr size_t kMaxHelperAnswer = 64u << 10;

// Asks docker-credential-NAME for the host's credentials (the docker-credential protocol:
// `get`, the server on stdin, JSON on stdout). Empty username: it has none.
Credentials from_helper(const std::string& name, const std::string& host) {
  static const std::regex kName("[A-Za-z0-9_.-]{1,64}");
  const std::string program = "docker-credential-" + name;
  auto failed = [&](const std::string& why) {
    return Error(ErrorKind::kEnvironment, "credential helper " + program + " " + why,
                 "check the helper (`echo " + host + " | " + program + " get`)");
  };
  if (!std::regex_match(name, kName)) throw failed("has a name that is not one");
  int in[2];
  int out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) throw sys_error("pipe", errno);
  common::UniqueFd in_r(in[0]), in_w(in[1]);
  if (::pipe2(out, O_CLOEXEC) != 0) throw sys_error("pipe", errno);
  common::UniqueFd out_r(out[0]), out_w(out[1]);
  common::SpawnOptions o;
  o.argv = {program, "get"};
  o.stdin_fd = in_r.get();
  o.stdout_fd = out_w.get();
  std::optional<common::Subprocess> child;
  try {
    child.emplace(o);
  } catch (const std::exception& e) {
    throw failed(std::string("cannot run: ") + e.what());
  }
  in_r.reset();
  out_w.reset();
  if (::write(in_w.get(), host.data(), host.size()) < 0) throw failed("did not read the host");
  in_w.reset();
  std::string answer;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{out_r.get(), POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
      child->kill(SIGKILL);
      throw failed("did not answer within 10 s");
    }
    char buf[4096];
    const ssize_t n = ::read(out_r.get(), buf, sizeof buf);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
    if (answer.size() > kMaxHelperAnswer) {
      child->kill(SIGKILL);
      throw failed("answered more than 64 KiB");
    }
  }
  auto status = child->wait(std::chrono::seconds(10));
  if (!status) {
    child->kill(SIGKILL);
    throw failed("did not exit within 10 s");
  }
  if (!status->ok()) {
    // The protocol's "credentials not found in native keychain": none, not a failure.
    if (answer.find("credentials not found") != std::string::npos) return {};
    throw failed("failed (" + status->describe() + "): " + printable(answer));
  }
  json doc = json::parse(answer, nullptr, false);
  if (!doc.is_object() || !doc.contains("Username") || !doc["Username"].is_string() ||
      !doc.contains("Secret") || !doc["Secret"].is_string()) {
    throw failed("answered something other than {\"Username\":...,\"Secret\":...}");
  }
  Credentials c;
  c.username = doc["Username"].get<std::string>();
  c.password = doc["Secret"].get<std::string>();
  c.source = program;
  // The protocol's identity token: an OAuth2 refresh token for the token realm.
  if (c.username == "<token>") c.identity_token = c.password;
  return c;
}

}  // namespace

Credentials find_credentials(const std::string& host, const std::string& repository,
                             const std::string& explicit_file) {
  std::vector<std::string> files;
  if (!explicit_file.empty()) {
    files.push_back(explicit_file);
  } else {
    if (const char* f = env("REGISTRY_AUTH_FILE")) files.emplace_back(f);
    if (const char* d = env("XDG_RUNTIME_DIR"))
      files.push_back(std::string(d) + "/containers/auth.json");
    files.emplace_back("/run/containers/0/auth.json");
    if (const char* h = env("HOME"))
      files.push_back(std::string(h) + "/.config/containers/auth.json");
    if (const char* d = env("DOCKER_CONFIG")) files.push_back(std::string(d) + "/config.json");
    if (const char* h = env("HOME")) files.push_back(std::string(h) + "/.docker/config.json");
  }
  // The keys an "auths" entry may have, most specific first: HOST/A/B, HOST/A, HOST.
  std::vector<std::string> keys;
  for (std::string r = repository; !r.empty();) {
    keys.push_back(host + "/" + r);
    const auto slash = r.rfind('/');
    r.resize(slash == std::string::npos ? 0 : slash);
  }
  for (const auto& k : {host, "https://" + host, "http://" + host}) keys.push_back(k);
  for (const auto& file : files) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(file, ec);
    if (ec) {
      if (!explicit_file.empty()) {
        throw Error(ErrorKind::kUsage, "cannot read --auth-file " + file + ": " + ec.message());
      }
      continue;
    }
    auto damaged = [&](const std::string& why) {
      // NOLINTNEXTLINE(performance-inefficient-string-concatenation): an error, built once
      return Error(ErrorKind::kUsage, "credentials file " + file + " is damaged: " + why,
                   "fix it or log in again (`skopeo login`)");
    };
    if (size > kMaxAuthFileBytes) throw damaged("larger than 1 MiB");
    json doc;
    try {
      doc = json::parse(fs::read_file(file));
    } catch (const json::exception&) {
      throw damaged("not JSON");
    }
    if (!doc.is_object()) continue;
    if (doc.contains("credHelpers") && doc["credHelpers"].is_object() &&
        doc["credHelpers"].contains(host) && doc["credHelpers"][host].is_string()) {
      Credentials c = from_helper(doc["credHelpers"][host].get<std::string>(), host);
      if (!c.username.empty()) return c;
    }
    if (doc.contains("auths") && doc["auths"].is_object()) {
      for (const auto& key : keys) {
        if (!doc["auths"].contains(key)) continue;
        const json& entry = doc["auths"][key];
        Credentials c;
        c.source = file;
        if (entry.contains("identitytoken") && entry["identitytoken"].is_string() &&
            !entry["identitytoken"].get<std::string>().empty()) {
          c.username = "<token>";
          c.identity_token = entry["identitytoken"].get<std::string>();
        } else if (entry.contains("auth") && entry["auth"].is_string()) {
          auto plain = base64_decode(entry["auth"].get<std::string>());
          auto colon = plain.find(':');
          if (colon == std::string::npos)
            throw damaged("the entry for " + key + " is not base64 of user:password");
          c.username = plain.substr(0, colon);
          c.password = plain.substr(colon + 1);
        } else if (entry.contains("username") && entry.contains("password") &&
                   entry["username"].is_string() && entry["password"].is_string()) {
          c.username = entry["username"].get<std::string>();
          c.password = entry["password"].get<std::string>();
        } else {
          continue;
        }
        return c;
      }
    }
    if (doc.contains("credsStore") && doc["credsStore"].is_string()) {
      Credentials c = from_helper(doc["credsStore"].get<std::string>(), host);
      if (!c.username.empty()) return c;
    }
  }
  return {};
}

void RateLimiter::consume(uint64_t bytes) {
  if (rate_ == 0) return;
  std::chrono::steady_clock::time_point until;
  {
    std::lock_guard lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (next_ < now) next_ = now;
    until = next_;
    next_ += std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / static_cast<double>(rate_)));
  }
  std::this_thread::sleep_until(until);
}

// Cuts attempts that run past their deadline or move fewer than stall_bytes in a stall_window
// (RegistryOptions): httplib's timeouts are per read, so a registry that trickles a byte a
// second, or answers headers and never a body, held a pull for ever. One thread per Registry
// looks at every attempt in flight a few times a window and cuts one by Client::stop(), which
// shuts its socket down (the one thing httplib allows from another thread); the attempt then
// fails, and send() reads why from its watch. stop() waits while the attempt connects (httplib
// connects under the lock stop() takes): the connection and read timeouts, set to twice the
// window, bound that wait.
class Registry::Watchdog {
 public:
  struct Watch {
    httplib::Client* client = nullptr;
    Clock::time_point deadline;
    std::atomic<uint64_t> bytes{0};  // moved either way, counted by the attempt's thread
    Clock::time_point mark;          // the start of the window being watched
    uint64_t bytes_at_mark = 0;
    std::string cut;  // why it was cut; empty while it was not
  };

  Watchdog(std::chrono::milliseconds window, uint64_t stall_bytes)
      : window_(window),
        stall_bytes_(stall_bytes),
        tick_(std::clamp<std::chrono::milliseconds>(window / 4, std::chrono::milliseconds(10),
                                                    std::chrono::milliseconds(500))),
        thread_([this] { run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Watches `w` from now until the Guard goes.
  class Guard {
   public:
    Guard(Watchdog& dog, Watch& w) : dog_(dog), w_(w) {
      std::lock_guard lock(dog_.mu_);
      w_.mark = Clock::now();
      dog_.watches_.push_back(&w_);
    }
    ~Guard() { release(); }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;
    // Stops watching; why the attempt was cut, or empty.
    std::string release() {
      std::lock_guard lock(dog_.mu_);
      std::erase(dog_.watches_, &w_);
      return w_.cut;
    }

   private:
    Watchdog& dog_;
    Watch& w_;
  };

 private:
  void run() {
    std::unique_lock lock(mu_);
    while (!stopping_) {
      cv_.wait_for(lock, tick_);
      const auto now = Clock::now();
      for (Watch* w : watches_) {
        if (!w->cut.empty()) continue;
        const uint64_t bytes = w->bytes.load(std::memory_order_relaxed);
        if (now >= w->deadline) {
          w->cut = "did not finish within its deadline";
        } else if (now - w->mark >= window_) {
          if (bytes - w->bytes_at_mark < stall_bytes_) {
            w->cut = "moved " + std::to_string(bytes - w->bytes_at_mark) + " bytes in " +
                     seconds_text(seconds(window_)) + " (the least is " +
                     std::to_string(stall_bytes_) + ")";
          }
          w->mark = now;
          w->bytes_at_mark = bytes;
        }
        if (!w->cut.empty()) w->client->stop();
      }
    }
  }

  const std::chrono::milliseconds window_;
  const uint64_t stall_bytes_;
  const std::chrono::milliseconds tick_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<Watch*> watches_;
  std::thread thread_;  // last: it starts when the rest is ready
};

// A connection borrowed from the pool for one call, returned to it after.
class Registry::Lease {
 public:
  explicit Lease(Registry& r) : r_(r) {
    std::lock_guard lock(r_.pool_mu_);
    if (!r_.pool_.empty()) {
      client_ = std::move(r_.pool_.back());
      r_.pool_.pop_back();
    }
    if (!client_) client_ = r_.make_client(r_.origin_);
  }
  ~Lease() {
    std::lock_guard lock(r_.pool_mu_);
    r_.pool_.push_back(std::move(client_));
  }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  httplib::Client& operator*() { return *client_; }
  httplib::Client* operator->() { return client_.get(); }

 private:
  Registry& r_;
  std::unique_ptr<httplib::Client> client_;
};

namespace {

// "HOST" or "HOST:PORT" (a port of 1..65535 in decimal) into its host and port; -1 when the
// port is not one. The default port when none is written.
int parse_port(const std::string& authority, std::string& host, int default_port) {
  auto colon = authority.rfind(':');
  if (colon == std::string::npos || authority.find(']', colon) != std::string::npos) {
    host = authority;
    return default_port;
  }
  host = authority.substr(0, colon);
  const std::string digits = authority.substr(colon + 1);
  if (digits.empty() || digits.size() > 5) return -1;
  int port = 0;
  for (char ch : digits) {
    if (ch < '0' || ch > '9') return -1;
    port = port * 10 + (ch - '0');
  }
  return port >= 1 && port <= 65535 ? port : -1;
}

Origin origin_of(const std::string& scheme, const std::string& authority) {
  Origin o;
  o.scheme = scheme;
  o.authority = authority;
  o.port = parse_port(authority, o.host, scheme == "https" ? 443 : 80);
  return o;
}

bool is_redirect(int status) {
  return status == 301 || status == 302 || status == 303 || status == 307 || status == 308;
}

}  // namespace

Target resolve_location(const std::string& location, const Origin& from) {
  auto bad = [&](const std::string& why) {
    return Error(ErrorKind::kEnvironment,
                 from.authority + " redirected to '" + printable(location) + "': " + why,
                 "the registry's redirect (its storage's base URL) is misconfigured: fix it "
                 "there");
  };
  Target t;
  if (location.empty()) throw bad("an empty Location");
  if (location.starts_with("/") && !location.starts_with("//")) {
    t.origin = from;
    t.path = location;
    return t;
  }
  auto sep = location.find("://");
  if (sep == std::string::npos) throw bad("neither an absolute path nor an http(s) URL");
  std::string scheme = location.substr(0, sep);
  for (auto& ch : scheme) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (scheme != "http" && scheme != "https") throw bad("not http or https");
  const auto path_at = location.find_first_of("/?#", sep + 3);
  std::string authority = location.substr(
      sep + 3, path_at == std::string::npos ? std::string::npos : path_at - sep - 3);
  if (authority.find('@') != std::string::npos) throw bad("credentials in the URL");
  t.origin = origin_of(scheme, authority);
  if (t.origin.port < 0) throw bad("the port is not a number of 1 to 65535");
  static const std::regex kHostName(R"([A-Za-z0-9]([A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+\])");
  if (!std::regex_match(t.origin.host, kHostName)) throw bad("the host is not a host name");
  t.path = path_at == std::string::npos ? "/" : location.substr(path_at);
  if (t.path.starts_with("?")) t.path = "/" + t.path;
  if (auto hash = t.path.find('#'); hash != std::string::npos) t.path.resize(hash);
  if (t.path.empty()) t.path = "/";
  return t;
}

namespace {

std::string lower(std::string s) {
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// %XX escapes of a URL's user and password.
std::string percent_decode(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// Whether `host`, an IPv4 or IPv6 address (IPv6 with or without its brackets), lies in
// `cidr`, an ADDRESS/BITS entry of NO_PROXY (10.0.0.0/8, fd00::/8). A name is in no range.
bool in_cidr(const std::string& cidr, std::string host) {
  const size_t slash = cidr.find('/');
  const std::string net = cidr.substr(0, slash);
  int bits = -1;
  const std::string len = cidr.substr(slash + 1);
  const auto [end, ec] = std::from_chars(len.data(), len.data() + len.size(), bits);
  if (len.empty() || ec != std::errc() || end != len.data() + len.size()) return false;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  unsigned char a[16] = {}, b[16] = {};
  size_t size = 4;
  if (::inet_pton(AF_INET, net.c_str(), a) == 1) {
    if (::inet_pton(AF_INET, host.c_str(), b) != 1) return false;
  } else if (::inet_pton(AF_INET6, net.c_str(), a) == 1) {
    if (::inet_pton(AF_INET6, host.c_str(), b) != 1) return false;
    size = 16;
  } else {
    return false;
  }
  if (bits < 0 || static_cast<size_t>(bits) > size * 8) return false;
  for (size_t i = 0; i < size && bits > 0; ++i, bits -= 8) {
    const unsigned mask = bits >= 8 ? 0xffu : (0xffu << (8 - bits)) & 0xffu;
    if ((a[i] & mask) != (b[i] & mask)) return false;
  }
  return true;
}

bool no_proxy_covers(const std::string& list, const std::string& host, int port) {
  const std::string h = lower(host);
  size_t at = 0;
  while (at <= list.size()) {
    size_t comma = list.find(',', at);
    if (comma == std::string::npos) comma = list.size();
    std::string entry = list.substr(at, comma - at);
    at = comma + 1;
    entry.erase(0, entry.find_first_not_of(" \t"));
    entry.erase(entry.find_last_not_of(" \t") + 1);
    if (entry.empty()) continue;
    if (entry == "*") return true;
    if (entry.find('/') != std::string::npos) {  // an address range: the host's address in it
      if (in_cidr(entry, h)) return true;
      continue;
    }
    std::string name;
    const int p = parse_port(entry, name, 0);
    if (p < 0 || (p != 0 && p != port)) continue;
    name = lower(name);
    if (name.starts_with(".")) name.erase(0, 1);
    if (h == name || (h.size() > name.size() && h.ends_with("." + name))) return true;
  }
  return false;
}

}  // namespace

Proxy proxy_for(const std::string& scheme, const std::string& host, int port) {
  const char* names[2] = {"http_proxy", "HTTP_PROXY"};
  if (scheme == "https") names[0] = "https_proxy", names[1] = "HTTPS_PROXY";
  const char* url = env(names[0]);
  const char* name = names[0];
  if (url == nullptr) url = env(name = names[1]);
  if (url == nullptr) return {};
  const char* no = env("no_proxy");
  if (no == nullptr) no = env("NO_PROXY");
  if (no != nullptr && no_proxy_covers(no, host, port)) return {};
  std::string rest = url;
  auto bad = [&](const std::string& why) {
    return Error(ErrorKind::kUsage, std::string(name) + "=" + printable(url) + ": " + why,
                 "write http://[USER:PASSWORD@]HOST[:PORT], or name the registry in NO_PROXY");
  };
  if (auto sep = rest.find("://"); sep != std::string::npos) {
    if (lower(rest.substr(0, sep)) != "http")
      throw bad("gpusnap speaks to proxies in http:// only");
    rest.erase(0, sep + 3);
  }
  if (auto slash = rest.find('/'); slash != std::string::npos) rest.resize(slash);
  Proxy p;
  if (auto at = rest.rfind('@'); at != std::string::npos) {
    const std::string user = rest.substr(0, at);
    const auto colon = user.find(':');
    p.username = percent_decode(user.substr(0, colon));
    if (colon != std::string::npos) p.password = percent_decode(user.substr(colon + 1));
    rest.erase(0, at + 1);
  }
  p.port = parse_port(rest, p.host, 80);
  if (p.port < 0 || p.host.empty()) throw bad("not HOST[:PORT] with a port of 1 to 65535");
  return p;
}

// One request as Registry::exchange sends it.
struct Registry::Call {
  Call(std::string m, std::string p, httplib::Headers h = {})
      : method(std::move(m)), path(std::move(p)), headers(std::move(h)) {}
  std::string method;  // GET, HEAD, POST or PUT
  std::string path;    // on the registry, with its query
  httplib::Headers headers;
  std::string_view body;
  std::string content_type;
  // Receives a 2xx answer's body; to stop it, sets `refusal` and returns false.
  std::function<bool(const char*, size_t)> on_body;
  std::optional<Error> refusal;  // why on_body stopped the answer: thrown as it is
  uint64_t expect_bytes = 0;     // the answer's body at most, for the deadline
};

// What came back: the final answer after redirects, with the body of one that is not 2xx (its
// first 4 KiB, for the message) and who sent it.
struct Registry::Answer {
  int status = 0;
  httplib::Headers headers;
  std::string body;
  std::string host;           // the authority that answered: the registry's, or a redirect's target
  std::string authorization;  // the Authorization header the request carried
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

Registry::Registry(OciRef ref, RegistryOptions options)
    : ref_(std::move(ref)),
      options_(std::move(options)),
      credentials_(find_credentials(ref_.host, ref_.repository, options_.auth_file)),
      origin_(origin_of(options_.plain_http ? "http" : "https", ref_.host)),
      limiter_(options_.max_rate),
      watchdog_(std::make_unique<Watchdog>(options_.stall_window, options_.stall_bytes)) {
  if (!options_.ca_file.empty() && !std::filesystem::is_regular_file(options_.ca_file)) {
    throw Error(ErrorKind::kUsage,
                options_.flag_prefix + "ca-file " + options_.ca_file + " is not a file");
  }
  if (options_.plain_http && !options_.ca_file.empty()) {
    throw Error(ErrorKind::kUsage, options_.flag_prefix + "ca-file and " + options_.flag_prefix +
                                       "plain-http exclude each other");
  }
  if (origin_.port < 0) {
    throw Error(ErrorKind::kUsage,
                "bad reference '" + ref_.str() + "': the port is not 1 to 65535");
  }
}

Registry::~Registry() = default;

namespace {

// The *.crt (CAs) and NAME.cert + NAME.key (client certificates) of the certs.d directories for
// `authority`, as containers/image reads them.
struct CertsD {
  std::vector<std::string> cas;
  std::string cert;
  std::string key;
};

CertsD certs_d(const std::vector<std::string>& roots, const std::string& authority) {
  CertsD out;
  for (const auto& root : roots) {
    const std::filesystem::path dir = std::filesystem::path(root) / authority;
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) continue;
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      if (f.extension() == ".crt") out.cas.push_back(f.string());
      if (f.extension() == ".cert" && out.cert.empty()) {
        auto key = f;
        key.replace_extension(".key");
        if (!std::filesystem::is_regular_file(key, ec)) {
          throw Error(ErrorKind::kEnvironment,
                      "client certificate " + f.string() + " has no key beside it",
                      "put its key in " + key.string() + ", or remove the certificate");
        }
        out.cert = f.string();
        out.key = key.string();
      }
    }
  }
  return out;
}

}  // namespace

std::unique_ptr<X509_STORE, void (*)(X509_STORE*)> Registry::trust_store(
    const Origin& origin) const {
  std::unique_ptr<X509_STORE, void (*)(X509_STORE*)> store(X509_STORE_new(), X509_STORE_free);
  if (!store) throw Error(ErrorKind::kInternal, "out of memory for the TLS trust store");
  // The system's first (OpenSSL's default paths, which SSL_CERT_FILE and SSL_CERT_DIR move),
  // then what --ca-file and certs.d add: a private CA for one registry must not take the
  // public ones away from the CDN its blobs are redirected to.
  X509_STORE_set_default_paths(store.get());
  std::vector<std::string> files = certs_d(options_.certs_dirs, origin.authority).cas;
  if (!options_.ca_file.empty()) files.insert(files.begin(), options_.ca_file);
  for (const auto& f : files) {
    if (X509_STORE_load_locations(store.get(), f.c_str(), nullptr) != 1) {
      ERR_clear_error();
      throw Error(ErrorKind::kUsage, "cannot read CA certificates from " + f,
                  "give a PEM file of CA certificates");
    }
  }
  return store;
}

std::unique_ptr<httplib::Client> Registry::make_client(const Origin& origin) const {
  const std::string url = origin.scheme + "://" + origin.host + ":" + std::to_string(origin.port);
  const CertsD own =
      origin.scheme == "https" ? certs_d(options_.certs_dirs, origin.authority) : CertsD{};
  auto c = own.cert.empty() ? std::make_unique<httplib::Client>(url)
                            : std::make_unique<httplib::Client>(url, own.cert, own.key);
  // Each at twice the watchdog's window: the watchdog cuts stalls first and tells why; these
  // end a connect or TLS handshake that stalls, which it waits for (Watchdog).
  const auto twice =
      std::chrono::duration_cast<std::chrono::microseconds>(options_.stall_window * 2);
  const auto sec = static_cast<time_t>(twice.count() / 1000000);
  const auto usec = static_cast<time_t>(twice.count() % 1000000);
  c->set_connection_timeout(std::min<time_t>(sec, 10), sec >= 10 ? 0 : usec);
  c->set_read_timeout(sec, usec);
  c->set_write_timeout(sec, usec);
  c->set_keep_alive(true);
  // Headers and body go out in separate writes: with Nagle's algorithm the body's last
  // segment would wait for the ACK of the headers (40 ms of delayed ACK per request).
  c->set_tcp_nodelay(true);
  // Redirects are followed by exchange(), not by httplib: httplib sends the Authorization
  // header on to whatever host a redirect names, and from https on to http.
  c->set_follow_location(false);
  c->set_default_headers({{"User-Agent", std::string("gpusnap/") + GPUSNAP_VERSION}});
  const Proxy proxy = proxy_for(origin.scheme, origin.host, origin.port);
  if (!proxy.host.empty()) {
    c->set_proxy(proxy.host, proxy.port);
    if (!proxy.username.empty()) c->set_proxy_basic_auth(proxy.username, proxy.password);
  }
  if (origin.scheme == "https") {
    c->enable_server_certificate_verification(true);
    c->set_ca_cert_store(trust_store(origin).release());  // the client's SSL context owns it
  }
  return c;
}

std::string Registry::where() const { return "registry " + ref_.host; }

std::string Registry::answered_by(const std::string& host) const {
  return host == ref_.host ? where() : host + " (a redirect of " + where() + ")";
}

Registry::Answer Registry::send(httplib::Client& client, const Origin& origin, Call& call,
                                const std::string& path, bool with_authorization,
                                Clock::time_point deadline) {
  Watchdog::Watch watch;
  watch.client = &client;
  watch.deadline = deadline;
  httplib::Request req;
  req.method = call.method;
  req.path = path;
  req.headers = call.headers;
  Answer a;
  if (with_authorization) a.authorization = authorization();
  if (!a.authorization.empty()) req.headers.emplace("Authorization", a.authorization);
  if (call.method == "POST" || call.method == "PUT") {
    req.headers.emplace("Content-Type", call.content_type);
    // Written in pieces, each counted, so that the watchdog sees an upload move.
    req.content_length_ = call.body.size();
    req.content_provider_ = [&](size_t offset, size_t length, httplib::DataSink& sink) {
      const size_t n = std::min<size_t>(length, 256u << 10);
      if (!sink.write(call.body.data() + offset, n)) return false;
      watch.bytes.fetch_add(n, std::memory_order_relaxed);
      return true;
    };
  }
  a.host = origin.authority;
  req.response_handler = [&](const httplib::Response& r) {
    a.status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* p, size_t n, uint64_t, uint64_t) {
    watch.bytes.fetch_add(n, std::memory_order_relaxed);
    if (a.status >= 200 && a.status < 300 && call.on_body) return call.on_body(p, n);
    if (a.body.size() < 4096) a.body.append(p, std::min(n, 4096 - a.body.size()));
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  Watchdog::Guard guard(*watchdog_, watch);
  const bool sent = client.send(req, res, err);
  if (std::string cut = guard.release(); !cut.empty()) {
    throw Transient{origin.authority + " " + cut, true};
  }
  if (!sent) {
    if (err == httplib::Error::SSLServerVerification || err == httplib::Error::SSLConnection) {
      throw Error(ErrorKind::kEnvironment,
                  answered_by(origin.authority) + ": TLS failed (" + httplib::to_string(err) + ")",
                  "give the registry's CA with " + options_.flag_prefix + "ca-file, or " +
                      options_.flag_prefix + "plain-http for a registry without TLS");
    }
    if (err == httplib::Error::Canceled && call.refusal) throw *call.refusal;
    throw Transient{origin.authority + ": " + httplib::to_string(err)};
  }
  a.status = res.status;
  a.headers = std::move(res.headers);
  return a;
}

Registry::Answer Registry::exchange(Call& call) {
  Lease lease(*this);
  httplib::Client* client = &*lease;
  std::unique_ptr<httplib::Client> elsewhere;  // a redirect's target's connection
  Origin origin = origin_;
  std::string path = call.path;
  // The attempt's deadline, for all its hops: the constant, and the body at the least rate.
  uint64_t rate = options_.min_rate;
  if (options_.max_rate != 0) rate = std::min(rate, options_.max_rate);
  const uint64_t bytes = std::max<uint64_t>(call.body.size(), call.expect_bytes);
  const auto deadline = Clock::now() + options_.deadline_base +
                        std::chrono::milliseconds(bytes * 1000 / std::max<uint64_t>(rate, 1));
  bool fetched_token = false;
  for (int hop = 0;; ++hop) {
    Answer a = send(*client, origin, call, path, origin == origin_, deadline);
    if (a.status == 401 && origin == origin_ && !fetched_token) {
      // The token flow: once per request, so that a token the registry refuses ends it.
      fetched_token = true;
      if (fetch_token(a.header("WWW-Authenticate"), a.authorization)) {
        --hop;
        continue;
      }
    }
    if (!is_redirect(a.status)) return a;
    if (hop >= options_.max_redirects) {
      throw Error(ErrorKind::kEnvironment,
                  where() + ": more than " + std::to_string(options_.max_redirects) +
                      " redirects for " + call.path,
                  "the registry's redirect (its storage's base URL) loops: fix it there");
    }
    Target t = resolve_location(a.header("Location"), origin);
    if (origin.scheme == "https" && t.origin.scheme == "http") {
      throw Error(ErrorKind::kEnvironment,
                  origin.authority + " redirected " + call.path + " from https to " +
                      t.origin.str() + ": refused, the transfer would go in clear text",
                  "serve the registry's storage over https");
    }
    if (t.origin == origin_) {
      client = &*lease;
    } else if (!(t.origin == origin)) {
      elsewhere = make_client(t.origin);
      client = elsewhere.get();
    }
    if (a.status == 303) call.method = call.method == "HEAD" ? "HEAD" : "GET";
    origin = t.origin;
    path = t.path;
  }
}

namespace {

// The parameters of a WWW-Authenticate challenge: realm="...",service="...",scope="..."
// (quoted values may hold commas: "pull,push").
std::map<std::string, std::string> challenge_params(const std::string& text) {
  std::map<std::string, std::string> out;
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && (text[i] == ' ' || text[i] == ',')) ++i;
    const size_t eq = text.find('=', i);
    if (eq == std::string::npos) break;
    std::string key = lower(text.substr(i, eq - i));
    std::string value;
    i = eq + 1;
    if (i < text.size() && text[i] == '"') {
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\' && i + 1 < text.size()) ++i;
        value += text[i];
      }
      ++i;
    } else {
      const size_t end = std::min(text.find(',', i), text.size());
      value = text.substr(i, end - i);
      i = end;
    }
    out[key] = value;
  }
  return out;
}

}  // namespace

std::string Registry::authorization() {
  std::lock_guard lock(auth_mu_);
  if (!scope_.empty()) {
    // An expired token is not sent: the registry's 401 then brings a fresh one.
    auto it = tokens_.find(scope_);
    return it != tokens_.end() && it->second.expires > Clock::now() ? "Bearer " + it->second.value
                                                                    : std::string();
  }
  // An identity token is for the token realm alone: the registry's challenge leads there.
  if (credentials_.username.empty() || !credentials_.identity_token.empty()) return {};
  return "Basic " +
         httplib::detail::base64_encode(credentials_.username + ":" + credentials_.password);
}

bool Registry::fetch_token(const std::string& challenge, const std::string& sent) {
  if (!lower(challenge.substr(0, 7)).starts_with("bearer ")) return false;
  auto params = challenge_params(challenge.substr(7));
  const std::string realm = params["realm"];
  const std::string scope = params["scope"];
  std::lock_guard lock(auth_mu_);
  // Another request may have fetched it while this one waited.
  if (auto it = tokens_.find(scope); it != tokens_.end() && "Bearer " + it->second.value != sent &&
                                     it->second.expires > Clock::now()) {
    scope_ = scope;
    return true;
  }
  auto refused = [&](const std::string& why) {
    return Error(ErrorKind::kEnvironment,
                 where() + "'s token realm '" + printable(realm) + "' " + why,
                 "check the registry's token service (auth: token: realm)");
  };
  if (!realm.starts_with("http://") && !realm.starts_with("https://")) {
    throw refused("is not an http(s) URL");
  }
  const Target t = resolve_location(realm, origin_);
  if (origin_.scheme == "https" && t.origin.scheme == "http") {
    throw refused("is plain http for an https registry: the credentials would go in clear text");
  }
  std::string path = t.path;
  // With an identity token, OAuth2's refresh grant: a form POSTed to the realm, the token in
  // the body (never in a URL a proxy or a log would keep).
  const bool refresh = !credentials_.identity_token.empty();
  std::string form;
  for (const char* key : {"service", "scope"}) {
    if (params[key].empty()) continue;
    std::string& to = refresh ? form : path;
    to += refresh ? (to.empty() ? "" : "&") : (to.find('?') == std::string::npos ? "?" : "&");
    to += std::string(key) + "=" + common::url_encode(params[key]);
  }
  if (refresh) {
    form += std::string(form.empty() ? "" : "&") +
            "grant_type=refresh_token&client_id=gpusnap&refresh_token=" +
            common::url_encode(credentials_.identity_token);
  }
  std::string body;
  Call call{refresh ? "POST" : "GET", path};
  if (refresh) {
    call.body = form;
    call.content_type = "application/x-www-form-urlencoded";
  }
  call.on_body = [&](const char* p, size_t n) {
    if (body.size() + n > (64u << 10)) {
      call.refusal = refused("answered more than 64 KiB");
      return false;
    }
    body.append(p, n);
    return true;
  };
  if (!credentials_.username.empty() && !refresh) {
    call.headers.emplace("Authorization",
                         "Basic " + httplib::detail::base64_encode(credentials_.username + ":" +
                                                                   credentials_.password));
  }
  auto client = make_client(t.origin);
  const Answer a =
      send(*client, t.origin, call, path, false, Clock::now() + options_.deadline_base);
  if (a.status == 401 || a.status == 403) {
    throw Error(
        ErrorKind::kEnvironment,
        "token server " + t.origin.authority + " of " + where() + " refused " +
            (credentials_.username.empty() ? "an anonymous token"
                                           : "the credentials from " + credentials_.source) +
            " for " + printable(scope) + " (HTTP " + std::to_string(a.status) + ")",
        credentials_.username.empty() ? "log in (`skopeo login " + ref_.host + "`) or give " +
                                            options_.flag_prefix + "auth-file"
                                      : "check the credentials in " + credentials_.source);
  }
  if (a.status != 200) fail(a, "get a token for " + scope);
  const json doc = json::parse(body, nullptr, false);
  std::string token;
  for (const char* key : {"token", "access_token"}) {
    if (doc.is_object() && doc.contains(key) && doc[key].is_string()) token = doc[key];
    if (!token.empty()) break;
  }
  if (token.empty() || token.size() > (16u << 10) ||
      token.find_first_of("\r\n") != std::string::npos) {
    throw refused("answered no usable token");
  }
  // The distribution spec's default is 60 s; refreshed a little early.
  int64_t expires_in = 60;
  if (doc.contains("expires_in") && doc["expires_in"].is_number_integer()) {
    expires_in = std::clamp<int64_t>(doc["expires_in"].get<int64_t>(), 10, 24 * 3600);
  }
  tokens_[scope] = {token, Clock::now() + std::chrono::seconds(expires_in - 5)};
  scope_ = scope;
  return true;
}

// Turns an answer that is not the one asked for into an Error, or a Transient for the retry
// loop.
void Registry::fail(const Answer& a, const std::string& what) const {
  const int status = a.status;
  if (status >= 500 || status == 429 || status == 408) {
    throw Transient{a.host + ": HTTP " + std::to_string(status)};
  }
  const std::string body = printable(a.body, 300);
  const std::string flags = options_.flag_prefix;
  const std::string who = answered_by(a.host);
  if (status == 401 || status == 403) {
    throw Error(ErrorKind::kEnvironment,
                who + " refused to " + what + " (HTTP " + std::to_string(status) + ")",
                !credentials_.username.empty()
                    ? "check the credentials in " + credentials_.source
                    : "log in (`skopeo login HOST`) or give " + flags + "auth-file");
  }
  if (status == 404) {
    throw Error(ErrorKind::kNotFound, who + " has no " + what.substr(what.find(' ') + 1),
                a.host == ref_.host ? "check the reference"
                                    : "the registry's storage behind the redirect lacks it: "
                                      "check the registry's redirect configuration");
  }
  throw Error(ErrorKind::kEnvironment,
              who + " answered HTTP " + std::to_string(status) + " to " + what + ": " + body,
              "check the registry's log");
}

// Runs `fn` until it returns, retrying a Transient failure after a backoff: at most
// `retries` times, and a stalled attempt at most `stall_retries` times. Gives up with kTimeout
// when the last attempt stalled, else with kEnvironment.
template <class Fn>
static auto with_retries(const RegistryOptions& o, const std::string& what,
                         const std::string& where, Fn&& fn) {
  int stalls = 0;
  for (int attempt = 0;; ++attempt) {
    try {
      return fn();
    } catch (const Transient& t) {
      if (t.stalled) ++stalls;
      if (attempt >= o.retries || (t.stalled && stalls > o.stall_retries)) {
        if (t.stalled) {
          throw Error(ErrorKind::kTimeout,
                      // NOLINTNEXTLINE(performance-inefficient-string-concatenation): thrown once
                      where + ": cannot " + what + ": " + t.what + ", " + std::to_string(stalls) +
                          (stalls == 1 ? " time" : " times"),
                      "check the registry and the network to it (the bounds of a request are in "
                      "`gpusnap push --help`)");
        }
        throw Error(ErrorKind::kEnvironment,
                    // NOLINTNEXTLINE(performance-inefficient-string-concatenation): thrown once
                    where + ": cannot " + what + " after " + std::to_string(attempt + 1) +
                        " attempts: " + t.what,
                    "check that the registry runs and is reachable");
      }
      auto delay = o.backoff * (1 << std::min(attempt, 5));
      std::this_thread::sleep_for(
          std::min<std::chrono::milliseconds>(delay, std::chrono::seconds(5)));
    }
  }
}

bool Registry::blob_exists(const std::string& digest) {
  const std::string what = "look up blob " + digest;
  return with_retries(options_, what, where(), [&] {
    Call call{"HEAD", "/v2/" + ref_.repository + "/blobs/" + digest};
    Answer a = exchange(call);
    if (a.status == 200) return true;
    if (a.status == 404 && a.host == ref_.host) return false;
    fail(a, what);
  });
}

namespace {

// The path (and query) of an upload's Location, to which the blob goes with its digest.
std::string upload_target(std::string location, const std::string& digest) {
  if (auto scheme = location.find("://"); scheme != std::string::npos) {
    auto path = location.find('/', scheme + 3);
    location = path == std::string::npos ? "/" : location.substr(path);
  }
  location += (location.find('?') == std::string::npos ? "?" : "&");
  location += "digest=" + common::url_encode(digest);
  return location;
}

}  // namespace

void Registry::upload_blob(const std::string& digest, std::string_view data) {
  upload(digest, data, false);
}

bool Registry::upload_blob_if_missing(const std::string& digest, std::string_view data) {
  return upload(digest, data, true);
}

bool Registry::upload(const std::string& digest, std::string_view data, bool mount) {
  const std::string what = "upload blob " + digest;
  return with_retries(options_, what, where(), [&] {
    // With mount=DIGEST&from=this repository the POST is also the existence check: 201 when
    // the repository holds the blob (nothing to send), else 202 and an upload as without it
    // (the answer the distribution spec gives a registry that cannot mount). One request
    // instead of a HEAD and a POST: a registry spends milliseconds of CPU on each request,
    // as much as on megabytes of data (docs/benchmarks.md).
    Call start{"POST", "/v2/" + ref_.repository + "/blobs/uploads/"};
    if (mount) {
      start.path +=
          "?mount=" + common::url_encode(digest) + "&from=" + common::url_encode(ref_.repository);
    }
    start.content_type = "application/octet-stream";
    Answer started = exchange(start);
    if (mount && started.status == 201) return false;
    if (started.status != 202) fail(started, what);
    std::string location = started.header("Location");
    if (location.empty()) throw Transient{"no Location in the upload's answer"};
    limiter_.consume(data.size());
    Call put{"PUT", upload_target(location, digest)};
    put.body = data;
    put.content_type = "application/octet-stream";
    Answer stored = exchange(put);
    if (stored.status != 201) fail(stored, what);
    return true;
  });
}

std::string Registry::fetch_blob(const std::string& digest, uint64_t size) {
  const std::string what = "fetch blob " + digest;
  return with_retries(options_, what, where(), [&] {
    std::string data;
    data.reserve(size);
    Sha256 hash;
    Call call{"GET", "/v2/" + ref_.repository + "/blobs/" + digest};
    call.expect_bytes = size;
    call.on_body = [&](const char* p, size_t n) {
      if (data.size() + n > size) {
        call.refusal = Error(ErrorKind::kBadArtifact,
                             "blob " + digest + " from " + where() + " is larger than its " +
                                 std::to_string(size) + " bytes",
                             "the registry's copy is damaged: push the artifact again");
        return false;
      }
      limiter_.consume(n);
      hash.update(p, n);
      data.append(p, n);
      return true;
    };
    Answer a = exchange(call);
    if (a.status != 200) fail(a, what);
    if (data.size() != size) {
      throw Error(ErrorKind::kBadArtifact,
                  "blob " + digest + " from " + answered_by(a.host) + " has " +
                      std::to_string(data.size()) + " bytes where its size is " +
                      std::to_string(size),
                  "the registry's copy is damaged: push the artifact again");
    }
    const std::string got = hash.finish();
    if (got != digest) {
      throw Error(ErrorKind::kBadArtifact,
                  "blob " + digest + " from " + answered_by(a.host) +
                      " does not match its digest (its bytes hash to " + got + ")",
                  "the registry's copy is damaged: push the artifact again");
    }
    return data;
  });
}

std::string Registry::put_manifest(const std::string& body, const std::string& media_type,
                                   bool by_digest) {
  const std::string digest = sha256_digest(body);
  const std::string name = by_digest ? digest : ref_.tag;
  const std::string what = "store manifest " + ref_.repository + (by_digest ? "@" : ":") + name;
  with_retries(options_, what, where(), [&] {
    Call call{"PUT", "/v2/" + ref_.repository + "/manifests/" + name};
    call.body = body;
    call.content_type = media_type;
    Answer a = exchange(call);
    if (a.status != 201) fail(a, what);
    return 0;
  });
  return digest;
}

std::pair<std::string, std::string> Registry::fetch_manifest(uint64_t max_bytes,
                                                             const std::string& digest) {
  const std::string reference = digest.empty() ? ref_.reference() : digest;
  const std::string expected = digest.empty() ? ref_.digest : digest;
  const std::string what = "fetch manifest " + ref_.repository + ":" + reference;
  auto body = with_retries(options_, what, where(), [&] {
    std::string data;
    Call call{"GET", "/v2/" + ref_.repository + "/manifests/" + reference,
              httplib::Headers{
                  {"Accept", std::string(kOciManifestMediaType) + ", " + kOciImageIndexMediaType}}};
    call.expect_bytes = max_bytes;
    call.on_body = [&](const char* p, size_t n) {
      if (data.size() + n > max_bytes) {
        call.refusal =
            Error(ErrorKind::kBadArtifact, "manifest " + ref_.str() + " is larger than " +
                                               std::to_string(max_bytes) + " bytes");
        return false;
      }
      data.append(p, n);
      return true;
    };
    Answer a = exchange(call);
    if (a.status != 200) fail(a, what);
    return data;
  });
  const std::string got = sha256_digest(body);
  if (!expected.empty() && got != expected) {
    throw Error(ErrorKind::kBadArtifact,
                "manifest " + ref_.repository + "@" + expected + " from " + where() +
                    " does not match its digest (" + got + ")",
                "the registry's copy is damaged: push the artifact again");
  }
  return {body, got};
}

}  // namespace gpusnap::store
