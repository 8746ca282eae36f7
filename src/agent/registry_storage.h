// The agent's registry storage (--registry): snapshots travel between nodes through an OCI
// registry. After a capture the artifact is pushed and known by its digest; a restore of a
// snapshot this node does not hold pulls it first, through the node cache; a prefetch pulls
// ahead of a restore. Only the store's public calls (store/transfer.h) move the bytes.
//
// A pulled snapshot is materialised once per node, at PULLED/HEX (HEX: its OCI manifest's
// digest), the directory `gpusnap restore oci://...` uses too; it appears only complete. It and
// its chunks stay in the node cache (within its budget, the copy counted with the chunks and
// removed with them when the snapshot leaves), so that a snapshot pulled again, or one that
// shares chunks with it, fetches only what the cache lacks. A restore holds the snapshot in use
// (Fetched::use) until it is done: no eviction removes it meanwhile.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"
#include "store/blob_store.h"
#include "store/registry.h"

namespace gpusnap::agent {

struct RegistryStorageSettings {
  std::string repository;           // oci://HOST[:PORT]/REPO, no tag, no digest
  store::RegistryOptions registry;  // plain HTTP, CA file, credentials file
  int jobs = 8;                     // chunks in flight
  std::filesystem::path cache = "/var/lib/gpusnap/cache";
  uint64_t cache_budget = 64ull << 30;
  std::filesystem::path pulled;  // where pulled snapshots are materialised (RUN_DIR/pulled)
};

// What a pull for a restore or a prefetch did.
struct Fetched {
  std::filesystem::path artifact;  // the materialised snapshot
  std::string reference;           // oci://HOST/REPO@sha256:...
  bool pulled = false;             // false: it was already here
  uint64_t chunks_fetched = 0, bytes_fetched = 0;
  uint64_t chunks_from_cache = 0, bytes_from_cache = 0;
  // Held until the restore that uses the artifact is done: the node cache's eviction leaves it.
  store::SnapshotUse use;
  nlohmann::json to_json() const;
};

// Checks, from a snapshot's manifest alone, that this node could restore it; throws the
// engine's Error (kIncompatible, ...) when not.
using RestorableCheck = std::function<void(const Manifest&)>;

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
  // The snapshot `ref` names, materialised on this node: found at PULLED/HEX, or pulled there
  // (`check` runs on its manifest before any chunk is fetched).
  Fetched fetch(const store::OciRef& ref, const RestorableCheck& check, Reporter& reporter) const;

 private:
  RegistryStorageSettings settings_;
  store::OciRef repository_;
};

}  // namespace gpusnap::agent
