// The one way a node reaches a snapshot to restore it, the same for gpusnap (restore, pull) and
// gpusnap-agent (restore, prefetch): a local artifact directory, or an oci:// reference whose
// snapshot lands on this node as its copy RUN_DIR/pulled/HEX (store/transfer.h, node_copy).
//
//   trust    an oci:// snapshot: the node's signature policy (TransferOptions::policy,
//            store/signature.h) for the manifest's digest, before anything else of it is
//            read or a node copy of it used
//   check    the host check (engine/compat.h), once, from the snapshot's manifest alone: the
//            local artifact's, the node copy's when it is already here, else the registry's,
//            before any chunk is fetched
//   copy     an oci:// snapshot: its node copy, found complete, or pulled there through the
//            node cache; either before the constructor returns (Arrival::kBeforeReturning),
//            or while the restore runs (Arrival::kWhileRestoring: an ArrivingArtifact, so
//            that CRIU's restore starts on CRIU's images while the GPU memory still arrives).
//            Pulls and restores of one snapshot on one node take turns (lock_node_copy): the
//            second waits while the first pulls, then finds its copy. A copy found here is
//            verified (every byte against its manifest) before it is used; one that fails is
//            set aside and pulled again, resuming from what is intact in it, with a note.
//
// The restore is then told the check was made (RestoreOptions::host_checked) and does not probe
// the host again.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpusnap/phases.h"
#include "gpusnap/restore.h"
#include "store/blob_store.h"
#include "store/registry.h"
#include "store/stream.h"
#include "store/transfer.h"

namespace gpusnap::gpu {
class Driver;
}

namespace gpusnap::store {

// The node's settings for reaching snapshots, and the restore's that its host check needs.
struct ReachOptions {
  // Where the node copies of pulled snapshots live (RUN_DIR/pulled); created 0700.
  std::filesystem::path pulled = "/run/gpusnap/pulled";
  TransferOptions transfer;  // the registry's settings, chunks in flight
  std::filesystem::path cache = kDefaultCache;
  uint64_t cache_budget = 64ull << 30;
  // No host check: `pull --any-host`, which fetches what this host could not restore.
  bool any_host = false;
  std::string criu_path;          // empty: locate CRIU
  gpu::Driver* driver = nullptr;  // nullptr: the real NVIDIA driver, if any
  std::vector<std::string> gpu_map;
  int replicas = 1;
  // Verify a node copy found here before it is used (a restore then need not: prepare() says
  // so); false for `restore --no-verify`.
  bool verify_copy = true;
};

// The host check of engine/compat.h with the restore's CRIU, driver, GPU map and copies; for a
// caller that reaches the snapshot its own way (`pull -o DIR`). Throws its Error.
void check_host(const Manifest& manifest, const ReachOptions& options);

enum class Arrival {
  kWhileRestoring,   // the pull goes on while the restore starts (arriving())
  kBeforeReturning,  // the pull ends before the constructor returns (pull, prefetch)
};

class SnapshotSource {
 public:
  // Reaches WHERE (a local artifact directory, or oci://HOST/REPO[:TAG|@DIGEST]) and checks the
  // host. `reporter` receives the pull's phases and progress (from the pull's own thread with
  // kWhileRestoring) and must outlive this object. Throws Error: kIncompatible and the check's
  // other kinds before any chunk is fetched, the registry's, the pull's (kBeforeReturning).
  SnapshotSource(const std::string& where, const ReachOptions& options, Arrival arrival,
                 Reporter& reporter);
  SnapshotSource(const SnapshotSource&) = delete;
  SnapshotSource& operator=(const SnapshotSource&) = delete;
  // A pull still running is stopped and waited for (store/stream.h): a restore that failed
  // leaves nothing at the node copy's path, only the chunks in the node cache. The snapshot is
  // held in use until here, so that no eviction removes the copy while a restore reads it.
  ~SnapshotSource();

  // What a restore of this snapshot needs: its artifact, still arriving or not, checked.
  void prepare(RestoreOptions& options);

  // The artifact's final path: WHERE itself, or the node copy.
  const std::filesystem::path& artifact() const { return artifact_; }
  // The pull still arriving (kWhileRestoring); null when the artifact is complete here.
  ArrivingArtifact* arriving() const { return stream_.get(); }
  bool remote() const { return !reference_.empty(); }
  // oci://HOST/REPO@sha256:HEX and its sha256:HEX; empty for a local artifact.
  const std::string& reference() const { return reference_; }
  const std::string& digest() const { return digest_; }
  // Whether this object pulled (or pulls) the snapshot; false: local, or the node copy was here.
  bool pulls() const { return pulls_; }
  // Whether the node copy found here was verified (ReachOptions::verify_copy).
  bool verified() const { return verified_; }
  // The pull's result once it ended (kBeforeReturning; kWhileRestoring once the restore
  // completed the artifact); null before, or when nothing was pulled.
  const PullResult* pulled() const;
  // A line for the restore's notes: where the artifact came from, and what the pull fetched.
  std::string summary() const;

 private:
  void reach_local(const std::string& where, const ReachOptions& options);
  void reach_remote(const std::string& where, const ReachOptions& options, Arrival arrival,
                    Reporter& reporter);
  // Whether the node copy found at artifact_ is intact; one that is not is set aside, noted.
  bool copy_intact(Reporter& reporter);

  std::filesystem::path artifact_;
  std::string reference_;
  std::string digest_;
  bool checked_ = false;
  bool pulls_ = false;
  bool verified_ = false;
  SnapshotUse use_;  // the node copy, in use until the pull and the restore are done
  // The NVIDIA driver the host check opened (ReachOptions::driver null), lent to the restore by
  // prepare(): this object outlives the restore it prepares.
  std::unique_ptr<gpu::Driver> driver_;
  std::optional<PullResult> result_;
  std::unique_ptr<StreamingPull> stream_;  // last: stopped before anything above goes
};

}  // namespace gpusnap::store
