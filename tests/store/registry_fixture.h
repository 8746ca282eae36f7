// A real OCI registry for the tests: Debian's docker-registry (the CNCF distribution), started
// on loopback (or on another address of the host) with its own configuration and storage in a
// temporary directory. Plain HTTP, or TLS with a CA made by openssl and htpasswd (bcrypt) basic
// authentication.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/subprocess.h"
#include "testing/node_network.h"
#include "testing/unit.h"

namespace gpusnap::testing {

// Runs `openssl ARGS...` (keys and certificates for the tests); throws std::runtime_error with
// its output when it fails.
void openssl(const std::vector<std::string>& args);

class LocalRegistry {
 public:
  struct Options {
    bool tls = false;
    std::string username;  // non-empty: basic authentication (with tls)
    std::string password;
    // The host address it listens on, and its certificate names: another than loopback for
    // clients in other network namespaces (testing/node_network.h).
    std::string address = "127.0.0.1";
    // Non-empty: a pull-through cache of the registry at this URL (docker-registry's
    // `proxy: remoteurl:`), as a cluster-local mirror runs.
    std::string proxy_remote = {};
    // More of the registry's configuration (YAML, top level): a storage middleware, token
    // authentication.
    std::string extra_config = {};
    // Non-null: it runs inside this node's network namespace (entered by nsenter), listening
    // on the node's address; `address` is not used.
    const Node* node = nullptr;
  };

  // Why the registry cannot run here (docker-registry, openssl or htpasswd missing).
  static std::optional<std::string> blocker();

  // Starts it and waits until it answers; throws std::runtime_error when it does not.
  LocalRegistry(const TempDir& dir, const Options& options);
  LocalRegistry(const LocalRegistry&) = delete;
  LocalRegistry& operator=(const LocalRegistry&) = delete;
  ~LocalRegistry();  // stops it (SIGKILL through Subprocess)

  // ADDRESS:PORT
  std::string host() const { return address_ + ":" + std::to_string(port_); }
  // oci://ADDRESS:PORT/REPO
  std::string ref(const std::string& repo_and_tag) const {
    return "oci://" + host() + "/" + repo_and_tag;
  }
  const std::filesystem::path& storage() const { return storage_; }
  const std::filesystem::path& ca_file() const { return ca_; }
  // Where the registry's blob with this digest ("sha256:HEX") keeps its bytes.
  std::filesystem::path blob_data(const std::string& digest) const;
  // The registry's own log (one line per request).
  std::string log() const;

 private:
  std::string address_;
  uint16_t port_ = 0;
  std::filesystem::path storage_;
  std::filesystem::path ca_;
  std::filesystem::path log_;
  std::optional<common::Subprocess> process_;
};

}  // namespace gpusnap::testing
