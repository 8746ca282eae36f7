// The node's store: chunks by sha256, each held once however many snapshots use it, and the
// snapshots (their layouts) that use them. It is the cache of pulled snapshots: kept within a
// byte budget, the least recently used snapshot leaving first, a chunk leaving with the last
// snapshot that uses it. Everything in it is root-only (directories 0700, files 0600).
//
//   ROOT/blobs/sha256/HEX      a chunk, complete and named by its digest (written to tmp/,
//                              with O_DIRECT where the filesystem takes it, renamed into
//                              place: a half-written chunk is never seen)
//   ROOT/snapshots/KEY.json    {"reference", "layout"}; its mtime is the last use
//   ROOT/tmp/                  chunks being written
//   ROOT/lock                  flock: shared while a snapshot is added or read, exclusive to
//                              evict, so that eviction never removes a chunk in use
//
// Thread-safe: put/get/has may be called from many threads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/fd.h"
#include "store/layout.h"

namespace gpusnap::store {

inline constexpr const char* kDefaultCache = "/var/lib/gpusnap/cache";

struct CachedSnapshot {
  std::string key;        // the snapshot's digest, hex (the OCI manifest's for a pulled one)
  std::string reference;  // where it came from (oci://... or a local path)
  uint64_t apparent_bytes = 0;
  uint64_t stored_bytes = 0;  // its chunks, shared ones included
  int64_t last_used = 0;      // seconds since the epoch
  int64_t last_used_ns = 0;   // the same in nanoseconds: the eviction order
};

struct EvictResult {
  std::vector<std::string> evicted;  // keys
  uint64_t blobs_removed = 0;
  uint64_t bytes_removed = 0;
  uint64_t bytes_kept = 0;
};

class BlobStore {
 public:
  // Creates ROOT and its folders (0700) when missing and takes the shared lock. Throws
  // kEnvironment when it cannot.
  explicit BlobStore(std::filesystem::path root);
  BlobStore(const BlobStore&) = delete;
  BlobStore& operator=(const BlobStore&) = delete;
  ~BlobStore() = default;  // closing the lock file releases the flock

  const std::filesystem::path& root() const { return root_; }
  bool has(std::string_view digest) const;
  // Stores a blob whose digest the caller has checked. Atomic; a blob already present is
  // left as it is.
  void put(std::string_view digest, std::string_view data) const;
  // Reads a blob of at most `max` bytes and checks it against its digest. A blob that does not
  // match (a damaged disk) is removed and reported as Error(kBadArtifact).
  std::string get(std::string_view digest, uint64_t max) const;
  // Bytes of all blobs held.
  uint64_t blob_bytes() const;

  void record_snapshot(const std::string& key, const std::string& reference, const Layout& layout);
  std::optional<Layout> snapshot(const std::string& key) const;
  // Marks a snapshot as just used (its place in the eviction order).
  void touch(const std::string& key) const;
  std::vector<CachedSnapshot> list() const;

  // Leaves the least recently used snapshots (never `keep`) until the blobs of those that stay
  // fit in `budget` bytes, then removes every blob no snapshot uses. Waits for the exclusive
  // lock (no pull may be reading or writing meanwhile, in this process or another).
  EvictResult evict(uint64_t budget, const std::string& keep = {});

 private:
  std::filesystem::path blob_path(std::string_view digest) const;
  std::filesystem::path root_;
  common::UniqueFd lock_;
};

}  // namespace gpusnap::store
