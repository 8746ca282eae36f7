// Moving snapshots between a node and an OCI registry.
//
// A snapshot on a registry is an OCI image manifest (version 2):
//   artifactType application/vnd.gpusnap.snapshot.v1
//   config       application/vnd.oci.image.config.v1+json        an image config (architecture,
//                os, created, the annotations as Labels) that nothing reads back: plain
//                `skopeo inspect` refuses any other config media type as "an artifact"
//   layers[0]    application/vnd.gpusnap.snapshot.config.v1+json  the layout (store/layout.h),
//                which holds the artifact's manifest.json
//   layers[1..]  application/vnd.gpusnap.chunk.v1[+zstd]          every distinct chunk, once
//   annotations                                                    GPU model, driver, sizes, id
// so `skopeo inspect` shows what it is (`--raw` the whole manifest), and a registry's garbage
// collection keeps every chunk a snapshot uses. Version 1, pushed before, had the layout as
// its config (media type application/vnd.gpusnap.snapshot.config.v1+json); pull reads both.
//
// push: open -> upload (chunk; per distinct chunk one POST that mounts it when the repository
//       holds it and else starts its upload, then the PUT) -> manifest
// pull: manifest (OCI manifest and layout; the caller's host check, before any chunk) ->
//       fetch (chunks from the node cache (its blobs, the node copies there are, a dead pull's
//       staging of the same copy), or from the registry checked against their digest as they
//       arrive; files written as chunks come) -> cache (record the snapshot, evict to the
//       budget). Into a node copy each uncompressed chunk is written once, into the copy, which
//       then holds it for the cache; compressed ones (and every chunk of a pull into a caller's
//       directory) are kept in the cache's blobs too.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "gpusnap/artifact.h"
#include "gpusnap/phases.h"
#include "store/blob_store.h"
#include "store/chunker.h"
#include "store/encryption.h"
#include "store/layout.h"
#include "store/materialise.h"
#include "store/registry.h"
#include "store/signature.h"
#include "store/snapshot_manifest.h"

namespace gpusnap::store {

// What a snapshot holds, in bytes and chunks (from its layout).
struct SnapshotSizes {
  uint64_t apparent_bytes = 0;
  uint64_t data_bytes = 0;    // not zeros
  uint64_t stored_bytes = 0;  // distinct chunks, as stored (compressed)
  uint64_t chunks = 0;        // distinct chunks
  static SnapshotSizes of(const Layout& layout);
};

// Chunks in flight by default: twice the cores, 8 to 32. A pull from a registry on the same
// host is bound by the CPU of both sides (hashing, the registry's per-request work): on the
// H200 machine's 16 cores 32 jobs moved 3.05 GB/s against 2.10 with 8 (64: 2.95); on 2 busy
// cores 8 does best (docs/benchmarks.md, "Pull against the registry's ceiling").
int default_jobs();

// Chunks and bytes that crossed the network to or from a registry, counted as each chunk does
// rather than when its push or pull ends: one that fails part way has moved them too (the
// agent's registry metrics). Shared by every transfer given the same counters.
struct TransferCounters {
  std::atomic<uint64_t> chunks_uploaded{0};
  std::atomic<uint64_t> bytes_uploaded{0};
  std::atomic<uint64_t> chunks_fetched{0};
  std::atomic<uint64_t> bytes_fetched{0};
};

struct TransferOptions {
  RegistryOptions registry;
  int jobs = default_jobs();  // chunks in flight
  ChunkingOptions chunking;
  // Checked by read_remote and pull once the manifest's digest is known, before the layout or
  // any chunk is fetched (store/signature.h); null: every snapshot accepted.
  std::shared_ptr<const SignaturePolicy> policy;
  // push: sign the manifest with this PEM private key (store/signature.h); empty: unsigned.
  std::filesystem::path sign_key;
  // push: encrypt every chunk and the layout for these public keys (store/encryption.h);
  // empty: not encrypted. `dedup_secret`: the node's convergence secret (made when missing).
  std::vector<std::filesystem::path> recipients;
  std::filesystem::path dedup_secret = kDefaultDedupSecret;
  // read_remote and pull: the node's private keys, for an encrypted snapshot's layout (read
  // after the signature check, before any chunk); null: none.
  std::shared_ptr<const DecryptionKeys> decryption;
  // Where the chunks this push or pull moves are counted as they move; null: not counted.
  std::shared_ptr<TransferCounters> counters;
};

struct PushResult {
  std::string reference;  // oci://HOST/REPO@sha256:...
  std::string digest;     // of the OCI manifest
  std::string signature;  // oci://HOST/REPO:sha256-HEX.sig when signed
  SnapshotSizes sizes;
  uint64_t chunks_uploaded = 0;
  uint64_t bytes_uploaded = 0;
  std::vector<PhaseTiming> phases;
};

PushResult push(const std::filesystem::path& path, const OciRef& ref,
                const TransferOptions& options, Reporter& reporter);

// A snapshot as its registry describes it, before any chunk is fetched.
struct RemoteSnapshot {
  OciRef ref;
  std::string digest;           // of the OCI manifest
  nlohmann::json oci_manifest;  // annotations included
  Layout layout;                // of an encrypted snapshot: opened
  // Of an encrypted snapshot: where each chunk's sealed blob lies and its key; null otherwise.
  std::shared_ptr<const SealedChunks> sealed;
};

// Reads and checks the OCI manifest and the config (Error kBadArtifact when it is not a gpusnap
// snapshot or does not match its digests, or when options.policy refuses it: checked before the
// layout is fetched). An encrypted snapshot's layout is opened with options.decryption (Error
// kKey when none of those keys is one of its recipients).
RemoteSnapshot read_remote(const OciRef& ref, const TransferOptions& options);

struct PullOptions {
  TransferOptions transfer;
  std::filesystem::path output;  // must not exist
  // The output is the node's copy for restore (RUN_DIR/pulled/HEX, named by the manifest's
  // digest; node_copy() below): recorded with the snapshot, counted in the cache's budget and
  // removed when the snapshot leaves the cache. Its uncompressed chunks are written there only
  // (not to the cache's blobs as well); a pull that fails or is killed leaves its staging
  // directory, hidden, and the next pull of the same copy reads the chunks it holds (each
  // checked against its digest) instead of fetching them, then removes it. False for a
  // directory of the caller's (`pull -o`): every chunk is kept in the cache's blobs.
  bool output_in_cache = false;
  std::filesystem::path cache = "/var/lib/gpusnap/cache";
  uint64_t cache_budget = 64ull << 30;
  // Called with the snapshot's manifest before any chunk is fetched; throws to refuse (a host
  // with another GPU model or driver).
  std::function<void(const Manifest&)> check;
  // For a restore that starts before the pull ends (store/stream.h).
  ArrivalHooks arrival;
  // The snapshot as the caller read it (read_remote, by digest), to check it before the pull:
  // not read from the registry a second time.
  std::optional<RemoteSnapshot> snapshot;
  // gpusnap's state directory, where a pull into a directory of the caller's records its
  // staging directory for `gpusnap recover` (ArtifactWriter's WriterOptions::run_dir); empty:
  // not recorded. A node copy's staging is found in its own folder instead (remove_dead_pulls).
  std::filesystem::path run_dir;
};

struct PullResult {
  std::string reference;  // by digest
  std::string digest;
  std::filesystem::path output;
  SnapshotSizes sizes;
  uint64_t chunks_fetched = 0;
  uint64_t bytes_fetched = 0;
  uint64_t chunks_from_cache = 0;  // the cache's blobs, the copies there are, earlier stagings
  uint64_t bytes_from_cache = 0;
  TransferCpu cpu;  // the fetch's threads (store/materialise.h)
  std::vector<std::string> evicted;
  std::vector<std::string> kept_in_use;  // over the budget, but in use: kept
  std::vector<PhaseTiming> phases;
};

// Before any chunk is fetched it refuses (Error kEnvironment, exit 10, with the numbers) when
// the bytes it will write exceed the free space of the output's filesystem (and the cache's, when
// it is another): the snapshot's files less what a resumed staging directory holds, and the
// chunks the cache lacks that it keeps. A write that finds no space removes what it staged.
PullResult pull(const OciRef& ref, const PullOptions& options, Reporter& reporter);

// Serialises the pulls and restores of one snapshot on a node: an exclusive flock on
// RUN_DIR/locks/pull-HEX (COPIES is RUN_DIR/pulled, HEX the manifest's digest), released when
// the descriptor closes or its process dies. Taken before the copy is looked for, so that the
// second of two waits, then finds the first one's copy complete. Waits as long as the holder
// pulls, saying so once through `reporter`.
common::UniqueFd lock_node_copy(const std::filesystem::path& copies, const std::string& key,
                                Reporter& reporter);

// Moves a node copy that failed its check (a byte flipped on disk) out of the way, under the
// lock of lock_node_copy: it becomes a staging directory of the copy, which the next pull of
// the snapshot resumes from, keeping every chunk still intact there (each checked against its
// digest) and fetching the others from the cache or the registry.
void set_aside_node_copy(const std::filesystem::path& copy);

// Removes the staging directories that pulls which did not finish left under COPIES
// (RUN_DIR/pulled), those no live pull holds: what `gpusnap recover` frees. Returns one line
// for each. Never throws.
std::vector<std::string> remove_dead_pulls(const std::filesystem::path& copies) noexcept;

// The node's copy of the snapshot whose manifest has `digest`: COPIES/HEX (COPIES is
// RUN_DIR/pulled), held in use from before it is looked for, so that no eviction removes it
// while the caller uses it. `found`: complete there (touched as just used; recorded, with
// `layout()`, when an older gpusnap left it uncounted). Otherwise the caller pulls into `path`
// with PullOptions::output_in_cache. Creates COPIES (0700).
struct NodeCopy {
  std::filesystem::path path;
  SnapshotUse use;
  bool found = false;
};
NodeCopy node_copy(const std::filesystem::path& cache, const std::filesystem::path& copies,
                   const OciRef& by_digest, const std::function<Layout()>& layout);

// Adds a local artifact to the node's store (its chunks, each once). Returns the bytes it
// added: what a second capture of the same workload costs the store.
struct ImportResult {
  std::string key;
  SnapshotSizes sizes;
  uint64_t new_bytes = 0;  // of its stored bytes, those the store did not hold
  uint64_t new_chunks = 0;
  std::vector<PhaseTiming> phases;
};
ImportResult import_artifact(const std::filesystem::path& path, const std::filesystem::path& cache,
                             const ChunkingOptions& options, Reporter& reporter);

}  // namespace gpusnap::store
