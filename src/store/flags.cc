#include "store/flags.h"

#include "gpusnap/error.h"
#include "store/blob_store.h"
#include "store/peers.h"
#include "store/transfer.h"

namespace gpusnap::store {

std::vector<args::FlagSpec> registry_flags(const std::string& prefix) {
  return {{prefix + "plain-http", "", "", "reach the registry over plain HTTP (no TLS)"},
          {prefix + "ca-file", "", "PEM",
           "CA certificates to trust besides the system's and certs.d's"},
          {prefix + "auth-file", "", "FILE",
           "the registry's credentials (auth.json / docker config.json, e.g. a mounted Secret; "
           "default: where skopeo and podman look, credential helpers included)"},
          // Spelled as skopeo spells it, in both programs: it is the node's file, not the
          // registry's.
          {"--registries-conf", "", "FILE",
           "registry mirrors, as containers-registries.conf(5) writes them, tried before the "
           "origin for pulls (default: $CONTAINERS_REGISTRIES_CONF, else "
           "/etc/containers/registries.conf and registries.conf.d/)"},
          // Bare in both programs too: the peers are the node's agents, not the registry's.
          {"--peers", "", "ADDR:PORT,...",
           "agents that serve each other chunks (gpusnap-agent --serve-peers): each chunk is "
           "asked of the one that owns it before the mirrors and the origin, and checked against "
           "its digest (default: none)"},
          {"--peers-file", "", "FILE", "more peers, one ADDR:PORT a line"},
          {"--peers-dns", "", "NAME:PORT",
           "more peers: every address NAME resolves to (a headless Service of the agents), "
           "looked up again every 30 s"},
          {"--peer-token-file", "", "FILE", "the bearer token of the peers' TCP API (one line)"}};
}

void read_registry_flags(const args::Args& args, const std::string& prefix,
                         RegistryOptions& options) {
  options.plain_http = args.has(prefix + "plain-http");
  options.ca_file = args.get(prefix + "ca-file");
  options.auth_file = args.get(prefix + "auth-file");
  options.registries_conf = args.get("--registries-conf");
  options.peers = read_peers(args.get("--peers"), args.get("--peers-file"), args.get("--peers-dns"),
                             args.get("--peer-token-file"));
  options.flag_prefix = prefix;  // the registry's hints name the flags as this program spells them
}

std::vector<args::FlagSpec> cache_flags() {
  return {{"--cache", "", "DIR",
           "the node cache of pulled snapshots (default " + std::string(kDefaultCache) + ")"},
          {"--cache-budget-mib", "", "MIB",
           "keep what the node holds for pulled snapshots (chunks and the copies under "
           "RUN_DIR/pulled) within MIB, least recently used leaving first, never one being "
           "restored (default 65536)"}};
}

std::string cache_flag(const args::Args& args) { return args.get("--cache", kDefaultCache); }

uint64_t cache_budget_flag(const args::Args& args) {
  return static_cast<uint64_t>(args.get_int("--cache-budget-mib", 64 << 10, 0, 1L << 30)) << 20;
}

args::FlagSpec signature_policy_flag() {
  return {"--signature-policy", "", "FILE",
          "which snapshots may be pulled or restored, per registry or repository: unsigned, or "
          "signed by which keys (JSON; default " +
              std::string(kDefaultPolicyFile) +
              " when it exists, else every snapshot is accepted; docs/security.md)"};
}

std::shared_ptr<const SignaturePolicy> signature_policy(const args::Args& args) {
  return SignaturePolicy::for_node(args.get("--signature-policy"));
}

args::FlagSpec decryption_key_flag() {
  args::FlagSpec f{"--decryption-key", "", "FILE|DIR",
                   "the node's private key (PEM: X25519, X448 or EC) for snapshots pushed with "
                   "--encrypt; a directory: each file in it (a mounted Secret). Repeatable. A key "
                   "file its group or others may read is refused (exit 12)"};
  f.repeatable = true;
  return f;
}

std::shared_ptr<const DecryptionKeys> decryption_keys(const args::Args& args) {
  const auto paths = args.all("--decryption-key");
  if (paths.empty()) return nullptr;
  return DecryptionKeys::load(paths);
}

std::vector<args::FlagSpec> encrypt_flags() {
  args::FlagSpec encrypt{
      "--encrypt", "", "RECIPIENT",
      "encrypt every chunk and the layout (AES-256-GCM) for RECIPIENT, a PEM public key "
      "(X25519, X448 or EC): pull and restore then need its private key (--decryption-key). "
      "Repeatable: any one recipient's key opens the snapshot"};
  encrypt.repeatable = true;
  return {encrypt,
          {"--dedup-secret", "", "FILE",
           "the node's secret that makes chunks pushed for the same recipients encrypt alike, so "
           "a registry holds them once (default " +
               std::string(kDefaultDedupSecret) +
               ", made when missing; share it between nodes whose pushes should dedup)"}};
}

void read_encrypt_flags(const args::Args& args, TransferOptions& options) {
  for (const auto& r : args.all("--encrypt")) options.recipients.emplace_back(r);
  if (args.has("--dedup-secret")) {
    if (options.recipients.empty()) {
      throw Error(ErrorKind::kUsage, "--dedup-secret needs --encrypt",
                  "give --encrypt RECIPIENT, or leave --dedup-secret out");
    }
    options.dedup_secret = args.get("--dedup-secret");
  }
}

}  // namespace gpusnap::store
