// The store's unit tests make artifacts of plain files (CRIU-like page images, tier files) and
// chunk them: this writes the manifest such an artifact needs, with no processes and no host
// images.
#pragma once

#include <filesystem>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "gpusnap/artifact.h"

namespace gpusnap::testing {

// The manifest of the files under `root`, their checksums included.
inline void write_plain_manifest(const std::filesystem::path& root) {
  Manifest m;
  m.id = fs::random_id();
  m.created = "2026-12-01T00:00:00Z";
  m.gpusnap_version = "test";
  m.host.page_size = 4096;
  m.files = checksum_tree(root, m.chunk_bytes);
  fs::write_file(root / kManifestName, m.to_json().dump(2));
}

}  // namespace gpusnap::testing
