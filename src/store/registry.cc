// cpp-httplib's client, one connection per thread in flight (a Client is not thread-safe), kept
// in a pool so that chunks reuse their connections (keep-alive): a TLS handshake per 8 MiB
// chunk would cost more than the chunk.
#include "store/registry.h"

// httplib reads a response 4 KiB at a time by default: a read() and an append per 4 KiB of an
// 8 MiB chunk. This is the only file of gpusnap that includes it.
#define CPPHTTPLIB_RECV_BUFSIZ size_t(256u << 10)
#include <httplib.h>
#include <openssl/evp.h>

#include <cstdlib>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/url.h"
#include "gpusnap/error.h"
#include "store/digest.h"

namespace gpusnap::store {

namespace {

using nlohmann::json;

constexpr uint64_t kMaxManifestBytes = 4ull << 20;  // the limit of docker-registry itself
constexpr uint64_t kMaxAuthFileBytes = 1ull << 20;

// A failure worth another attempt: the connection broke, the registry is restarting or busy.
struct Transient {
  std::string what;
};

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

Credentials find_credentials(const std::string& host, const std::string& explicit_file) {
  std::vector<std::string> files;
  if (!explicit_file.empty()) {
    files.push_back(explicit_file);
  } else {
    if (const char* f = env("REGISTRY_AUTH_FILE")) files.emplace_back(f);
    if (const char* d = env("XDG_RUNTIME_DIR"))
      files.push_back(std::string(d) + "/containers/auth.json");
    files.emplace_back("/run/containers/0/auth.json");
    if (const char* d = env("DOCKER_CONFIG")) files.push_back(std::string(d) + "/config.json");
    if (const char* h = env("HOME")) files.push_back(std::string(h) + "/.docker/config.json");
  }
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
    if (!doc.is_object() || !doc.contains("auths") || !doc["auths"].is_object()) continue;
    for (const auto& key : {host, "https://" + host, "http://" + host}) {
      if (!doc["auths"].contains(key)) continue;
      const json& entry = doc["auths"][key];
      Credentials c;
      c.source = file;
      if (entry.contains("auth") && entry["auth"].is_string()) {
        auto plain = base64_decode(entry["auth"].get<std::string>());
        auto colon = plain.find(':');
        if (colon == std::string::npos)
          throw damaged("the entry for " + host + " is not base64 of user:password");
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

// A connection borrowed from the pool for one call, returned to it after.
class Registry::Lease {
 public:
  explicit Lease(Registry& r) : r_(r) {
    std::lock_guard lock(r_.pool_mu_);
    if (!r_.pool_.empty()) {
      client_ = std::move(r_.pool_.back());
      r_.pool_.pop_back();
    }
    if (!client_) client_ = r_.make_client();
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

Registry::Registry(OciRef ref, RegistryOptions options)
    : ref_(std::move(ref)),
      options_(std::move(options)),
      credentials_(find_credentials(ref_.host, options_.auth_file)),
      base_((options_.plain_http ? "http://" : "https://") + ref_.host),
      limiter_(options_.max_rate) {
  if (!options_.ca_file.empty() && !std::filesystem::is_regular_file(options_.ca_file)) {
    throw Error(ErrorKind::kUsage,
                options_.flag_prefix + "ca-file " + options_.ca_file + " is not a file");
  }
  if (options_.plain_http && !options_.ca_file.empty()) {
    throw Error(ErrorKind::kUsage, options_.flag_prefix + "ca-file and " + options_.flag_prefix +
                                       "plain-http exclude each other");
  }
}

Registry::~Registry() = default;

std::unique_ptr<httplib::Client> Registry::make_client() const {
  auto c = std::make_unique<httplib::Client>(base_);
  c->set_connection_timeout(10);
  c->set_read_timeout(120);
  c->set_write_timeout(120);
  c->set_keep_alive(true);
  // Headers and body go out in separate writes: with Nagle's algorithm the body's last
  // segment would wait for the ACK of the headers (40 ms of delayed ACK per request).
  c->set_tcp_nodelay(true);
  c->set_follow_location(true);  // a registry may send blobs from elsewhere (object storage)
  if (!options_.plain_http) {
    c->enable_server_certificate_verification(true);
    if (!options_.ca_file.empty()) c->set_ca_cert_path(options_.ca_file);
  }
  if (!credentials_.username.empty())
    c->set_basic_auth(credentials_.username, credentials_.password);
  return c;
}

std::string Registry::where() const { return "registry " + ref_.host; }

namespace {

// Turns a failed exchange into an Error, or a Transient for the retry loop. `flags`: the
// caller's flag prefix (RegistryOptions::flag_prefix), for the hints.
[[noreturn]] void fail(const httplib::Result& res, const std::string& what,
                       const std::string& where, bool have_credentials, const std::string& flags) {
  if (!res) {
    const auto err = res.error();
    if (err == httplib::Error::SSLServerVerification || err == httplib::Error::SSLConnection) {
      throw Error(ErrorKind::kEnvironment,
                  where + ": TLS failed (" + httplib::to_string(err) + ") while trying to " + what,
                  "give the registry's CA with " + flags + "ca-file, or " + flags +
                      "plain-http for a registry without TLS");
    }
    throw Transient{httplib::to_string(err)};
  }
  const int status = res->status;
  if (status >= 500 || status == 429 || status == 408) {
    throw Transient{"HTTP " + std::to_string(status)};
  }
  std::string body = res->body.substr(0, 300);
  for (auto& ch : body) {
    if (ch == '\n' || ch == '\r') ch = ' ';
  }
  if (status == 401 || status == 403) {
    throw Error(ErrorKind::kEnvironment,
                where + " refused to " + what + " (HTTP " + std::to_string(status) + ")",
                have_credentials ? "check the credentials in the auth file"
                                 : "log in (`skopeo login HOST`) or give " + flags + "auth-file");
  }
  if (status == 404) {
    throw Error(ErrorKind::kNotFound, where + " has no " + what.substr(what.find(' ') + 1),
                "check the reference");
  }
  throw Error(ErrorKind::kInternal,
              where + " answered HTTP " + std::to_string(status) + " to " + what + ": " + body);
}

}  // namespace

template <class Fn>
static auto with_retries(const RegistryOptions& o, const std::string& what,
                         const std::string& where, Fn&& fn) {
  for (int attempt = 0;; ++attempt) {
    try {
      return fn();
    } catch (const Transient& t) {
      if (attempt >= o.retries) {
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
    Lease c(*this);
    auto res = c->Head("/v2/" + ref_.repository + "/blobs/" + digest);
    if (res && res->status == 200) return true;
    if (res && res->status == 404) return false;
    fail(res, what, where(), !credentials_.username.empty(), options_.flag_prefix);
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
    Lease c(*this);
    // With mount=DIGEST&from=this repository the POST is also the existence check: 201 when
    // the repository holds the blob (nothing to send), else 202 and an upload as without it
    // (the answer the distribution spec gives a registry that cannot mount). One request
    // instead of a HEAD and a POST: a registry spends milliseconds of CPU on each request,
    // as much as on megabytes of data (docs/benchmarks.md).
    std::string start_path = "/v2/" + ref_.repository + "/blobs/uploads/";
    if (mount) {
      start_path +=
          "?mount=" + common::url_encode(digest) + "&from=" + common::url_encode(ref_.repository);
    }
    auto start = c->Post(start_path, httplib::Headers{}, "", 0, "application/octet-stream");
    if (mount && start && start->status == 201) return false;
    if (!start || start->status != 202)
      fail(start, what, where(), !credentials_.username.empty(), options_.flag_prefix);
    std::string location = start->get_header_value("Location");
    if (location.empty()) throw Transient{"no Location in the upload's answer"};
    limiter_.consume(data.size());
    auto put = c->Put(upload_target(location, digest), httplib::Headers{}, data.data(), data.size(),
                      "application/octet-stream");
    if (!put || put->status != 201)
      fail(put, what, where(), !credentials_.username.empty(), options_.flag_prefix);
    return true;
  });
}

std::string Registry::fetch_blob(const std::string& digest, uint64_t size) {
  const std::string what = "fetch blob " + digest;
  return with_retries(options_, what, where(), [&] {
    Lease c(*this);
    std::string data;
    data.reserve(size);
    Sha256 hash;
    bool too_long = false;
    int status = 0;
    auto res = c->Get(
        "/v2/" + ref_.repository + "/blobs/" + digest, httplib::Headers{},
        [&](const httplib::Response& r) {
          status = r.status;
          return true;
        },
        [&](const char* p, size_t n) {
          if (status != 200) return data.size() + n < 4096 ? (data.append(p, n), true) : false;
          if (data.size() + n > size) {
            too_long = true;
            return false;
          }
          limiter_.consume(n);
          hash.update(p, n);
          data.append(p, n);
          return true;
        });
    if (too_long) {
      throw Error(ErrorKind::kBadArtifact,
                  "blob " + digest + " from " + where() + " is larger than its " +
                      std::to_string(size) + " bytes",
                  "the registry's copy is damaged: push the artifact again");
    }
    if (!res || res->status != 200)
      fail(res, what, where(), !credentials_.username.empty(), options_.flag_prefix);
    const std::string got = hash.finish();
    if (data.size() != size || got != digest) {
      throw Error(ErrorKind::kBadArtifact,
                  "blob " + digest + " from " + where() + " does not match its digest (" +
                      std::to_string(data.size()) + " bytes, " + got + ")",
                  "the registry's copy is damaged: push the artifact again");
    }
    return data;
  });
}

std::string Registry::put_manifest(const std::string& body, const std::string& media_type) {
  const std::string what = "store manifest " + ref_.repository + ":" + ref_.tag;
  with_retries(options_, what, where(), [&] {
    Lease c(*this);
    auto res = c->Put("/v2/" + ref_.repository + "/manifests/" + ref_.tag, httplib::Headers{},
                      body.data(), body.size(), media_type);
    if (!res || res->status != 201)
      fail(res, what, where(), !credentials_.username.empty(), options_.flag_prefix);
    return 0;
  });
  return sha256_digest(body);
}

std::pair<std::string, std::string> Registry::fetch_manifest() {
  const std::string what = "fetch manifest " + ref_.repository + ":" + ref_.reference();
  auto body = with_retries(options_, what, where(), [&] {
    Lease c(*this);
    std::string data;
    bool too_long = false;
    auto res = c->Get("/v2/" + ref_.repository + "/manifests/" + ref_.reference(),
                      httplib::Headers{{"Accept", "application/vnd.oci.image.manifest.v1+json"}},
                      [&](const char* p, size_t n) {
                        if (data.size() + n > kMaxManifestBytes) {
                          too_long = true;
                          return false;
                        }
                        data.append(p, n);
                        return true;
                      });
    if (too_long) {
      throw Error(ErrorKind::kBadArtifact, "manifest " + ref_.str() + " is larger than 4 MiB");
    }
    if (!res || res->status != 200) {
      if (res && res->status != 200) res->body = data;
      fail(res, what, where(), !credentials_.username.empty(), options_.flag_prefix);
    }
    return data;
  });
  const std::string digest = sha256_digest(body);
  if (!ref_.digest.empty() && digest != ref_.digest) {
    throw Error(ErrorKind::kBadArtifact,
                "manifest " + ref_.str() + " from " + where() + " does not match its digest (" +
                    digest + ")",
                "the registry's copy is damaged: push the artifact again");
  }
  return {body, digest};
}

}  // namespace gpusnap::store
