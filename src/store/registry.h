// An OCI distribution registry (docker-registry, the CNCF distribution, Harbor, ...) reached
// over HTTP/1.1: references, credentials, and the blob and manifest calls gpusnap needs.
// Retries with backoff on connection failures, 5xx and 429; never on a blob that arrives and
// does not match its digest. Follows redirects itself (object storage, a CDN): the
// Authorization header stays with the registry's own scheme, host and port, and https never
// goes on to http (docs/store.md "The transport").
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "store/snapshot_manifest.h"  // kMaxManifestBytes

namespace httplib {
class Client;
}
struct x509_store_st;  // OpenSSL's X509_STORE

namespace gpusnap::store {

class Peers;  // store/peers.h

inline constexpr const char* kOciScheme = "oci://";

// oci://HOST[:PORT]/REPO[:TAG][@sha256:HEX]
struct OciRef {
  std::string host;  // with ":PORT" when given
  std::string repository;
  std::string tag;     // empty when only a digest is given
  std::string digest;  // empty when only a tag is given

  static bool is_oci(std::string_view text) { return text.starts_with(kOciScheme); }
  // Throws Error(kUsage) naming what is wrong.
  static OciRef parse(std::string_view text);
  // The manifest's name on the registry: the digest when known, else the tag.
  std::string reference() const { return digest.empty() ? tag : digest; }
  std::string str() const;  // as parsed (tag and digest when both are known)
  std::string by_digest(const std::string& d) const;
};

struct RegistryOptions {
  bool plain_http = false;  // http:// (for a registry on loopback or a trusted network)
  // PEM bundle of CAs the registry's certificate may chain to, besides the system's (OpenSSL's
  // default paths: SSL_CERT_FILE, SSL_CERT_DIR) and those of certs.d.
  std::string ca_file;
  std::string auth_file;  // auth.json / config.json; empty: the usual places
  int retries = 5;        // attempts after the first
  std::chrono::milliseconds backoff{200};
  uint64_t max_rate = 0;  // bytes per second across all transfers; 0: no limit
  // containers-registries.conf to read mirrors from (store/mirrors.h); empty: the usual places.
  std::string registries_conf;
  bool mirrors = true;  // false: the origin alone (a mirror's own Registry)
  // Agents that serve each other chunks (store/peers.h), asked for a pull's blobs before the
  // mirrors; null: none (the default).
  std::shared_ptr<Peers> peers;
  // How the caller spells the settings its errors' hints name (store/flags.h): "--" for the
  // CLI's --ca-file, --plain-http and --auth-file, "--registry-" for the agent's.
  std::string flag_prefix = "--";
  // Redirects followed for one request: docker-registry and object storage need one.
  int max_redirects = 5;
  // The bounds of one attempt at a request (docs/store.md, "Bounds"): it must end within
  // `deadline_base` plus its body's size at `min_rate` bytes a second, and is cut when fewer
  // than `stall_bytes` move in a `stall_window`. A cut attempt counts as a retry, and after
  // `stall_retries` more the request fails with kTimeout: a registry that stopped answering
  // will not answer the next attempt either. Tests shrink them to run in seconds.
  std::chrono::milliseconds deadline_base{60000};
  uint64_t min_rate = 64 << 10;
  std::chrono::milliseconds stall_window{30000};
  uint64_t stall_bytes = 1024;
  int stall_retries = 1;
  // Where the node keeps per-registry trust, as podman and docker do: DIR/HOST[:PORT]/ with
  // *.crt (CAs, added to the system's) and NAME.cert + NAME.key (a client certificate). Every
  // existing one is read, in this order. Tests point them elsewhere.
  std::vector<std::string> certs_dirs = {"/etc/containers/certs.d", "/etc/docker/certs.d"};
};

// The proxy for an origin, from HTTPS_PROXY / HTTP_PROXY (lower-case first, as curl reads them)
// unless NO_PROXY names the host: "*", a host or domain (".example.com" and "example.com" both
// cover its subdomains), an IP address, each optionally with ":PORT". Only http:// proxies
// (CONNECT for https). Empty host: no proxy. Throws Error(kUsage) for a proxy URL that is not
// one.
struct Proxy {
  std::string host;
  int port = 0;
  std::string username;
  std::string password;
};
Proxy proxy_for(const std::string& scheme, const std::string& host, int port);

struct Credentials {
  std::string username;  // "<token>" with an identity token
  std::string password;
  std::string source;  // the file they came from
  // An OAuth2 refresh token ("identitytoken", as `docker login` stores it for registries that
  // log in through an identity provider): exchanged at the token realm for access tokens
  // (grant_type=refresh_token), never sent to the registry itself.
  std::string identity_token;
};

// Looks up credentials for `host` and `repository` where skopeo and podman look: in
// `explicit_file`, else $REGISTRY_AUTH_FILE, $XDG_RUNTIME_DIR/containers/auth.json,
// /run/containers/0/auth.json, $HOME/.config/containers/auth.json, $DOCKER_CONFIG/config.json,
// $HOME/.docker/config.json. In each file: a "credHelpers" entry for the host, then "auths"
// under HOST/REPOSITORY's prefixes longest first and HOST ("auth": base64 of user:password),
// then "credsStore". A helper is docker-credential-NAME on PATH, asked `get` with the host on
// stdin (10 s, 64 KiB of answer at most). Empty username: none found. Throws kUsage for a
// damaged file, kEnvironment for a helper that fails.
Credentials find_credentials(const std::string& host, const std::string& repository,
                             const std::string& explicit_file);

// Shares a byte rate between threads (--max-rate).
class RateLimiter {
 public:
  explicit RateLimiter(uint64_t bytes_per_second) : rate_(bytes_per_second) {}
  void consume(uint64_t bytes);

 private:
  uint64_t rate_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point next_{};
};

// Where an exchange goes: scheme, host and port as a URL names them. `authority` is the host
// and port as written ("HOST" or "HOST:PORT"), the name certs.d directories use.
struct Origin {
  std::string scheme;  // "http" or "https"
  std::string host;
  int port = 0;
  std::string authority;
  bool operator==(const Origin& o) const {
    return scheme == o.scheme && host == o.host && port == o.port;
  }
  std::string str() const { return scheme + "://" + authority; }
};

// Where a redirect's Location points, resolved against the origin that sent it (absolute, or a
// path on the same origin). Throws Error(kEnvironment) naming `from` for a Location that is not
// an http(s) URL or names a port outside 1..65535.
struct Target {
  Origin origin;
  std::string path;  // with its query
};
Target resolve_location(const std::string& location, const Origin& from);

class Registry {
 public:
  Registry(OciRef ref, RegistryOptions options);
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  const OciRef& ref() const { return ref_; }
  // The calls below are thread-safe: each takes a connection of its own from a pool.
  bool blob_exists(const std::string& digest);
  void upload_blob(const std::string& digest, std::string_view data);
  // Uploads a blob unless the repository holds it, asking both in one request (a mount from
  // the repository itself). Returns whether it was uploaded.
  bool upload_blob_if_missing(const std::string& digest, std::string_view data);
  // Fetches a blob of exactly `size` bytes, hashing it as it arrives. Throws
  // Error(kBadArtifact) when it does not match `digest` or has another size.
  std::string fetch_blob(const std::string& digest, uint64_t size);
  // Stores an OCI image manifest (or index) under ref().tag, or under its digest when
  // `by_digest` (a part of a snapshot that only its index names); returns its digest.
  std::string put_manifest(const std::string& body, const std::string& media_type,
                           bool by_digest = false);
  // The manifest or index ref() names (at most `max_bytes`) and its digest (checked against
  // ref().digest when one was given); with `digest`, the manifest of that digest in ref()'s
  // repository instead (a part an index names), checked against it.
  std::pair<std::string, std::string> fetch_manifest(uint64_t max_bytes = kMaxManifestBytes,
                                                     const std::string& digest = {});

 private:
  class Lease;
  class Watchdog;
  struct Call;
  struct Answer;
  bool upload(const std::string& digest, std::string_view data, bool mount);
  std::unique_ptr<httplib::Client> make_client(const Origin& origin) const;
  // The CAs a connection to `origin` trusts: the system's, --ca-file's, certs.d's.
  std::unique_ptr<x509_store_st, void (*)(x509_store_st*)> trust_store(const Origin& origin) const;
  // One request and the redirects it is sent on, on a connection of the pool. Transport
  // failures throw Transient (retried by the caller); a bad redirect throws Error.
  Answer exchange(Call& call);
  Answer send(httplib::Client& client, const Origin& origin, Call& call, const std::string& path,
              bool with_authorization, std::chrono::steady_clock::time_point deadline);
  [[noreturn]] void fail(const Answer& answer, const std::string& what) const;
  // The Authorization header for the registry's own origin: a bearer token once the registry
  // asked for one, else Basic with the credentials, else none.
  std::string authorization();
  // After a 401 with a Bearer challenge: fetches a token for the challenge's scope from its
  // realm (with the credentials, or anonymously), for authorization() to send. False when the
  // challenge is not Bearer or the token was fetched for it already (the credentials do not
  // reach what the request needs).
  bool fetch_token(const std::string& challenge, const std::string& sent);
  std::string where() const;  // "registry HOST" for messages
  // where(), or "HOST (a redirect of registry R)" for the target of a redirect.
  std::string answered_by(const std::string& host) const;

  OciRef ref_;
  RegistryOptions options_;
  Credentials credentials_;
  Origin origin_;  // the registry's own
  RateLimiter limiter_;
  std::mutex pool_mu_;
  std::vector<std::unique_ptr<httplib::Client>> pool_;
  // Bearer tokens by scope, and the scope requests use (the last one the registry asked for).
  struct Token {
    std::string value;
    std::chrono::steady_clock::time_point expires;
  };
  std::mutex auth_mu_;
  std::map<std::string, Token> tokens_;
  std::string scope_;
  std::unique_ptr<Watchdog> watchdog_;  // declared last: its thread stops first
};

}  // namespace gpusnap::store
