// Registry mirrors as the node's container runtimes read them: containers-registries.conf(5)
// (`[[registry]]` entries with `[[registry.mirror]]`s), so that a pull-through cache or a
// cluster-local mirror that CRI-O and Podman already use serves gpusnap's pulls too.
//
// Where the configuration comes from, in this order: an explicit file (--registries-conf, the
// agent's too), else $CONTAINERS_REGISTRIES_CONF (that file alone, as the man page says), else
// /etc/containers/registries.conf and then /etc/containers/registries.conf.d/*.conf in name
// order, a later entry for the same prefix replacing an earlier one. No file: no mirrors.
//
// What gpusnap takes from an entry: `prefix` (or `location` when there is none; `*.DOMAIN`
// wildcards), `location` (where the origin really is), `blocked`, `mirror-by-digest-only`, and
// per mirror `location`, `insecure` (gpusnap reaches an insecure mirror over plain HTTP: a
// cluster-local cache without TLS) and `pull-from-mirror` (`all`, `digest-only`, `tag-only`).
// Mirrors are for pulls: push always goes to the origin. A mirror is never trusted: every chunk
// is checked against the digest the manifest names, and a pull by tag from a mirror is checked
// by digest against nothing, so `mirror-by-digest-only` keeps tags at the origin.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "store/registry.h"

namespace gpusnap::store {

enum class PullFrom { kAll, kDigestOnly, kTagOnly };

struct MirrorEntry {
  std::string location;  // HOST[:PORT][/PATH]
  bool insecure = false;
  PullFrom pull_from = PullFrom::kAll;
};

struct RegistryEntry {
  std::string prefix;    // HOST[:PORT][/PATH], or *.DOMAIN
  std::string location;  // empty: the prefix itself
  bool insecure = false;
  bool blocked = false;
  bool mirror_by_digest_only = false;
  std::vector<MirrorEntry> mirrors;
};

// One place to pull from: the reference rewritten for it, and how to reach it.
struct PullSource {
  OciRef ref;
  bool plain_http = false;
  bool mirror = false;  // false: the origin (always last)
};

class RegistriesConf {
 public:
  // Bounds on what is read: a file of at most 1 MiB, 64 files in the .d folder, 1,024
  // registries and 64 mirrors each.
  static constexpr uint64_t kMaxFileBytes = 1ull << 20;

  // The configuration as the header says; `explicit_file` empty: the usual places. Throws
  // Error(kUsage) naming the file and what is wrong in it.
  static RegistriesConf load(const std::string& explicit_file);
  // One file's text (`name`: for messages). Throws Error(kUsage).
  static RegistriesConf parse(std::string_view text, const std::string& name);

  // The places to pull `ref` from, mirrors first in their order, the origin last (with
  // `origin_plain_http`, unless the entry marks it insecure). Throws Error(kUsage) when the entry
  // blocks the reference.
  std::vector<PullSource> sources_for(const OciRef& ref, bool origin_plain_http) const;

  const std::vector<RegistryEntry>& entries() const { return entries_; }
  const std::vector<std::string>& files() const { return files_; }

 private:
  void merge(RegistriesConf other);
  const RegistryEntry* match(const OciRef& ref) const;

  std::vector<RegistryEntry> entries_;
  std::vector<std::string> files_;  // read, in order
};

// The registries of one pull: the peers (RegistryOptions::peers, store/peers.h) for blobs, then
// the mirrors RegistriesConf names for the reference, then the origin. Fetches try them in that
// order: a peer that lacks a blob, fails or serves a damaged one passes it on to the mirrors; a
// mirror that fails to connect is left out of the rest of the pull; one that lacks a chunk or
// serves a damaged one (it fails its digest) passes that chunk on to the next. The origin's own
// failure is the pull's. Thread-safe as Registry.
class PullRegistries {
 public:
  PullRegistries(const OciRef& ref, const RegistryOptions& options);
  ~PullRegistries();
  PullRegistries(const PullRegistries&) = delete;
  PullRegistries& operator=(const PullRegistries&) = delete;

  const OciRef& ref() const { return ref_; }  // the origin's, as asked
  // The manifest ref() names, or with `digest` that manifest of its repository (an index's
  // part), and its digest: from the first mirror that serves it, else the origin.
  std::pair<std::string, std::string> fetch_manifest(const std::string& digest = {});
  std::string fetch_blob(const std::string& digest, uint64_t size);
  // Lines for the pull's notes: a mirror that failed, and what came from where. Once each.
  std::vector<std::string> take_notes();
  uint64_t bytes_from_mirrors() const { return from_mirrors_; }
  uint64_t bytes_from_peers() const { return from_peers_; }

 private:
  struct Source;
  void note(const std::string& text);

  OciRef ref_;
  std::vector<std::unique_ptr<Source>> sources_;  // mirrors, then the origin
  std::mutex notes_mu_;
  std::vector<std::string> notes_;
  std::atomic<uint64_t> from_mirrors_{0};
  std::shared_ptr<Peers> peers_;
  std::atomic<uint64_t> from_peers_{0};
};

}  // namespace gpusnap::store
