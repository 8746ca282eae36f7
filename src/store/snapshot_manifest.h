// What a registry serves for a snapshot, read: its OCI manifest and its layout blob. A registry
// is outside gpusnap's trust, so both are read here, from bytes, bounded (size by the caller's
// fetch, depth by common/json.h) and checked field by field before anything else sees them;
// tests/fuzz/fuzz_store runs these readers on arbitrary bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "store/layout.h"

namespace gpusnap::store {

inline constexpr const char* kConfigMediaType = "application/vnd.gpusnap.snapshot.config.v1+json";
inline constexpr const char* kChunkMediaType = "application/vnd.gpusnap.chunk.v1";
inline constexpr const char* kChunkZstdMediaType = "application/vnd.gpusnap.chunk.v1+zstd";
inline constexpr const char* kArtifactType = "application/vnd.gpusnap.snapshot.v1";
inline constexpr const char* kOciManifestMediaType = "application/vnd.oci.image.manifest.v1+json";
inline constexpr const char* kOciImageConfigMediaType = "application/vnd.oci.image.config.v1+json";

// The largest layout blob a pull fetches (a layout lists every chunk of every file).
inline constexpr uint64_t kMaxLayoutBytes = 256ull << 20;

// The implicit move reaches nlohmann::json's assert_invariant(), which is not declared
// noexcept but throws nothing (as for store::Layout).
// NOLINTNEXTLINE(bugprone-exception-escape)
struct SnapshotManifest {
  nlohmann::json doc;         // the OCI manifest, parsed
  std::string layout_digest;  // "sha256:..." of the layout blob
  uint64_t layout_size = 0;   // at most kMaxLayoutBytes
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
// digest and a size) of chunks the layout names at those sizes, each once, at most one per
// chunk besides the layout's own. Throws Error(kBadArtifact) naming the layer.
void check_snapshot_layers(const SnapshotManifest& manifest, const Layout& layout,
                           const std::string& name);

}  // namespace gpusnap::store
