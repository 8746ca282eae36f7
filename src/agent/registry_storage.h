// The agent's registry storage (--registry): snapshots travel between nodes through an OCI
// registry. After a capture the artifact is pushed and known by its digest; a restore of a
// snapshot this node does not hold pulls it through the node cache while it restores, a
// prefetch ahead of a restore (both as store/reach.h reaches a snapshot). Only the store's public
// calls (store/transfer.h) move the bytes.
//
// A pulled snapshot is materialised once per node, at PULLED/HEX (HEX: its OCI manifest's
// digest), the directory `gpusnap restore oci://...` uses too; it appears only complete. It and
// its chunks stay in the node cache (within its budget, the copy counted with the chunks and
// removed with them when the snapshot leaves), so that a snapshot pulled again, or one that
// shares chunks with it, fetches only what the cache lacks. A restore holds the snapshot in use
// (store::SnapshotSource) until it is done: no eviction removes it meanwhile.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"
#include "store/blob_store.h"
#include "store/encryption.h"
#include "store/reach.h"
#include "store/registry.h"
#include "store/signature.h"
#include "store/transfer.h"

namespace gpusnap::agent {

struct RegistryStorageSettings {
  std::string repository;            // oci://HOST[:PORT]/REPO, no tag, no digest
  store::RegistryOptions registry;   // plain HTTP, CA file, credentials file
  int jobs = store::default_jobs();  // chunks in flight
  std::filesystem::path cache = "/var/lib/gpusnap/cache";
  uint64_t cache_budget = 64ull << 30;
  std::filesystem::path pulled;  // where pulled snapshots are materialised (RUN_DIR/pulled)
  // Which snapshots a restore or prefetch may pull (--signature-policy, store/signature.h),
  // read when the agent starts; null: every snapshot accepted.
  std::shared_ptr<const store::SignaturePolicy> policy;
  // The node's keys for encrypted snapshots (--decryption-key); null: none.
  std::shared_ptr<const store::DecryptionKeys> decryption;
  // Pushes of captures encrypted for these public keys (--encrypt); empty: not encrypted.
  std::vector<std::filesystem::path> recipients;
  std::filesystem::path dedup_secret = store::kDefaultDedupSecret;
  // Where its pushes and pulls count the chunks they move (the agent's metrics); null: nowhere.
  std::shared_ptr<store::TransferCounters> counters;
};

// The store's phases (push: open, upload, manifest; pull: manifest, fetch, cache) as an
// operation shows them: "push-upload", "pull-fetch", apart from the engine's own phases of the
// same operation. Forwards from any thread as `to` does.
class PrefixReporter final : public Reporter {
 public:
  PrefixReporter(Reporter& to, std::string prefix) : to_(to), prefix_(std::move(prefix)) {}
  void phase_started(std::string_view name) override { to_.phase_started(named(name)); }
  void phase_finished(std::string_view name, double seconds) override {
    to_.phase_finished(named(name), seconds);
  }
  void progress(std::string_view name, uint64_t done, uint64_t total) override {
    to_.progress(named(name), done, total);
  }
  void note(std::string_view text) override { to_.note(text); }

 private:
  std::string named(std::string_view name) const { return prefix_ + std::string(name); }
  Reporter& to_;
  std::string prefix_;
};

class RegistryStorage {
 public:
  // Checks the settings: the repository a reference without a tag or digest, the files
  // readable. Creates the cache and the pulled directory (0700). Throws Error(kUsage) naming
  // the setting.
  explicit RegistryStorage(RegistryStorageSettings settings);

  const RegistryStorageSettings& settings() const { return settings_; }
  // Where a capture named `name` is pushed: REPO:NAME. Throws Error(kUsage) for a name that is
  // not an OCI tag.
  store::OciRef tag_of(const std::string& name) const;
  // Parses a caller's reference and refuses (Error kUsage) one outside the agent's repository:
  // the agent's credentials are for its registry, and it pulls nothing else.
  store::OciRef check_reference(const std::string& text) const;

  // Pushes a committed artifact as REPO:NAME; returns its reference by digest and what moved.
  nlohmann::json push(const std::filesystem::path& artifact, const std::string& name,
                      Reporter& reporter) const;
  // How this node reaches the registry's snapshots (store/reach.h): the registry, the node
  // cache, the pulled directory. The host check's settings are the caller's to add.
  store::ReachOptions reach_options() const;

 private:
  RegistryStorageSettings settings_;
  store::OciRef repository_;
};

}  // namespace gpusnap::agent
