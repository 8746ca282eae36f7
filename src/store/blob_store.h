// The node's store: chunks by sha256, each held once however many snapshots use it, and the
// snapshots (their layouts) that use them. It is the cache of pulled snapshots: what a node
// holds for them (their chunks, each counted once, and the copy materialised for restore under
// RUN_DIR/pulled/HEX) is kept within a byte budget, the least recently used snapshot leaving
// first with its materialised copy, a chunk leaving with the last snapshot that uses it, a
// snapshot in use (SnapshotUse: being restored) never. Everything in it is root-only
// (directories 0700, files 0600).
//
//   ROOT/blobs/sha256/HEX      a chunk, complete and named by its digest (written to tmp/,
//                              with O_DIRECT where the filesystem takes it, renamed into
//                              place: a half-written chunk is never seen)
//   ROOT/snapshots/KEY.json    {"reference", "layout", "materialised"}; its mtime is the last use
//   ROOT/uses/KEY              flock: shared while the snapshot is in use, exclusive to evict it
//   ROOT/tmp/                  chunks being written
//   ROOT/lock                  flock: shared while a snapshot is added or read, exclusive to
//                              evict, so that eviction never removes a chunk in use
//
// An uncompressed chunk pulled into a node copy is not written to blobs/ as well: the copy holds
// it, verbatim at its extent, and chunks_in_copies() finds it there for the next pull that
// needs it (checked against its digest as a blob is). It leaves with the copy.
//
// Why a restore holds the snapshot only while it runs: a copy maps its host images from the
// materialised files during its restore, and the driver's restore unmaps them (docs/gpu-memory.md,
// "Host images"); a running copy holds none of the snapshot's files after that.
//
// Thread-safe: put/get/has may be called from many threads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
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
  // Where it is materialised for restore (RUN_DIR/pulled/HEX; empty: nowhere the cache keeps),
  // and the bytes its files occupy there (blocks allocated: holes are free).
  std::filesystem::path materialised;
  uint64_t materialised_bytes = 0;
};

struct EvictResult {
  std::vector<std::string> evicted;  // keys
  uint64_t blobs_removed = 0;
  uint64_t bytes_removed = 0;
  uint64_t bytes_kept = 0;          // chunks and materialised copies that stay
  std::vector<std::string> in_use;  // keys over the budget kept because they are in use
};

// Where a chunk's bytes lie verbatim in a file: an uncompressed chunk in a node copy (the copy
// is then where the cache holds it: it is written once, there) or in a killed pull's staging.
struct ChunkLocation {
  std::filesystem::path file;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// The uncompressed chunks of `layout` at their places in the artifact at `root`, by digest.
std::multimap<std::string, ChunkLocation> chunk_locations(const Layout& layout,
                                                          const std::filesystem::path& root);

// The chunk's bytes read from `where`, when they match `digest` (a range never written, or
// written in part, does not: nullopt).
std::optional<std::string> read_located(const ChunkLocation& where, std::string_view digest);

// A snapshot in use: while one lives, evict() leaves the snapshot, its chunks and its
// materialised copy where they are. Movable; releasing is closing the lock file.
class SnapshotUse {
 public:
  SnapshotUse() = default;
  explicit SnapshotUse(common::UniqueFd fd) : fd_(std::move(fd)) {}
  bool held() const { return static_cast<bool>(fd_); }

 private:
  common::UniqueFd fd_;
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

  // Records a snapshot (its layout) as held. `materialised`: where it is materialised for
  // restore, to be counted and removed with it (an absolute path named KEY); empty keeps what
  // an earlier record said.
  void record_snapshot(const std::string& key, const std::string& reference, const Layout& layout,
                       const std::filesystem::path& materialised = {});
  bool recorded(const std::string& key) const;
  std::optional<Layout> snapshot(const std::string& key) const;
  // Marks the snapshot in use until the result is destroyed (a shared flock on uses/KEY). Waits
  // while an eviction removes it; the caller then finds it gone and pulls it again.
  SnapshotUse use(const std::string& key) const;
  // Whether some process holds the snapshot in use now.
  bool in_use(const std::string& key) const;
  // The uncompressed chunks of every node copy there is, where they lie in it.
  std::multimap<std::string, ChunkLocation> chunks_in_copies() const;
  // Marks a snapshot as just used (its place in the eviction order).
  void touch(const std::string& key) const;
  std::vector<CachedSnapshot> list() const;

  // Leaves the least recently used snapshots, each with its materialised copy, until what those
  // that stay hold (their blobs, each counted once, and their materialised copies) fits in
  // `budget` bytes, then removes every blob no snapshot uses. Never `keep` nor a snapshot in
  // use: those are counted first, and kept even when they alone exceed the budget. Waits for
  // the exclusive lock (no pull may be reading or writing meanwhile, in this process or
  // another).
  EvictResult evict(uint64_t budget, const std::string& keep = {});

 private:
  std::filesystem::path blob_path(std::string_view digest) const;
  std::filesystem::path use_path(const std::string& key) const;
  // The exclusive lock on uses/KEY when nobody uses the snapshot; an empty fd when someone does.
  common::UniqueFd lock_unused(const std::string& key) const;
  // Removes a snapshot's record, its materialised copy and its use lock (held by `lock`).
  void remove_snapshot(const CachedSnapshot& s, common::UniqueFd lock) const;
  std::filesystem::path root_;
  common::UniqueFd lock_;
};

}  // namespace gpusnap::store
