// What a registry serves for a snapshot, read: its OCI manifest and its layout blob. A registry
// is outside gpusnap's trust, so both are read here, from bytes, bounded (size by the caller's
// fetch, depth by common/json.h) and checked field by field before anything else sees them;
// tests/fuzz/fuzz_store runs these readers on arbitrary bytes.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "store/encryption.h"
#include "store/layout.h"

namespace gpusnap::store {

inline constexpr const char* kConfigMediaType = "application/vnd.gpusnap.snapshot.config.v1+json";
inline constexpr const char* kChunkMediaType = "application/vnd.gpusnap.chunk.v1";
inline constexpr const char* kChunkZstdMediaType = "application/vnd.gpusnap.chunk.v1+zstd";
// zstd of the chunk's byte split (store/byte_split.h).
inline constexpr const char* kChunkSplit2ZstdMediaType =
    "application/vnd.gpusnap.chunk.split2.v1+zstd";
inline constexpr const char* kArtifactType = "application/vnd.gpusnap.snapshot.v1";
inline constexpr const char* kOciManifestMediaType = "application/vnd.oci.image.manifest.v1+json";
inline constexpr const char* kOciImageConfigMediaType = "application/vnd.oci.image.config.v1+json";
inline constexpr const char* kOciImageIndexMediaType = "application/vnd.oci.image.index.v1+json";
// On each manifest of a snapshot split across an image index: "I/N", its place among the parts.
inline constexpr const char* kPartAnnotation = "org.gpusnap.snapshot.part";
inline constexpr const char* kTitleAnnotation = "org.opencontainers.image.title";

// The largest manifest (or index) docker-registry stores, and so the largest gpusnap writes
// or fetches.
inline constexpr uint64_t kMaxManifestBytes = 4ull << 20;
// The most parts an index of a snapshot lists: an index of them stays far under
// kMaxManifestBytes, and they hold more chunks than a layout of kMaxLayoutBytes names.
inline constexpr size_t kMaxManifestParts = 4096;

// The largest layout blob a pull fetches (a layout lists every chunk of every file).
inline constexpr uint64_t kMaxLayoutBytes = 256ull << 20;

// The implicit move reaches nlohmann::json's assert_invariant(), which is not declared
// noexcept but throws nothing (as for store::Layout).
// NOLINTNEXTLINE(bugprone-exception-escape)
struct SnapshotManifest {
  nlohmann::json doc;         // the OCI manifest, parsed
  std::string layout_digest;  // "sha256:..." of the layout blob
  uint64_t layout_size = 0;   // at most kMaxLayoutBytes
  std::string part;           // "I/N" on a part of a split snapshot (version 3), else empty
  bool encrypted = false;     // the layout is kEncryptedConfigMediaType (store/encryption.h)
};

// Reads the OCI manifest of `name` (a reference, for messages), version 1 or 2 (store/transfer.h).
// Throws Error(kBadArtifact) "NAME is not a gpusnap snapshot: WHY" when it is not JSON gpusnap
// reads or not a snapshot's manifest.
SnapshotManifest read_snapshot_manifest(std::string_view body, const std::string& name);

// Reads the layout blob of `name`: Layout::from_json's checks on bounded JSON. Throws like
// read_snapshot_manifest.
Layout read_snapshot_layout(std::string_view body, const std::string& name);

// The most JSON values a snapshot's manifest may hold: a manifest of docker-registry's 4 MiB
// lists about 28,000 chunks of 6 values each. Counted before the manifest is built in memory,
// so that 4 MiB of `{}` (1.3 million layers, 169 MB of JSON objects) is refused unread.
inline constexpr size_t kMaxManifestValues = 300000;

// Checks that the manifest's layers are what gpusnap writes for `layout`: descriptors (a
// digest and a size) of chunks the layout names at those sizes, each once (across the parts
// of a split snapshot too: `seen` holds the chunks earlier parts listed). Throws
// Error(kBadArtifact) naming the layer. Of an encrypted snapshot the layers are the sealed
// blobs `sealed` names for the layout's chunks.
void check_snapshot_layers(const SnapshotManifest& manifest, const Layout& layout,
                           const std::string& name, std::set<std::string>& seen,
                           const SealedChunks* sealed = nullptr);

// Whether `body` looks like an image index as gpusnap writes it (version 3: a snapshot too
// large for one manifest), without parsing it; read_snapshot_index then checks it.
bool is_snapshot_index(std::string_view body);

// The digests of the image manifests a snapshot's index lists, in order (at most
// kMaxManifestParts, each at most kMaxManifestBytes). Throws like read_snapshot_manifest.
// The index, parsed, goes to `doc` (its annotations are the snapshot's).
std::vector<std::string> read_snapshot_index(std::string_view body, const std::string& name,
                                             nlohmann::json& doc);

// What push stores for a snapshot: its manifests, each under kMaxManifestBytes, and the
// index that lists them when there is more than one.
//   version 2: one image manifest: an OCI image config (for `skopeo inspect`), the layout as
//              layer 0, then one layer per chunk;
//   version 3: as many such manifests as the chunks need, each with the layout as layer 0 and
//              its share of the chunks, annotated kPartAnnotation, listed by an image index
//              (which the tag names). Registries keep blobs a stored manifest lists, and an
//              index's manifests, so every chunk stays referenced.
struct SnapshotManifests {
  std::vector<std::string> parts;  // bodies; one for version 2
  std::string index;               // empty for version 2
};
struct Descriptor {
  std::string digest;
  uint64_t size = 0;
};
// `layout` the layout blob's descriptor, `config` the image config's, `annotations` the
// manifests' and index's, `arch` the OCI architecture; `sealed` the sealed blobs of an
// encrypted snapshot's chunks (null: not encrypted), listed instead of the chunks, their media
// types and the layout's with kEncryptedSuffix. Throws Error(kUsage) when the index itself
// would exceed kMaxManifestBytes.
SnapshotManifests snapshot_manifests(const Layout& layout, const Descriptor& layout_blob,
                                     const Descriptor& config, const nlohmann::json& annotations,
                                     const std::string& arch, const SealedChunks* sealed = nullptr);

}  // namespace gpusnap::store
