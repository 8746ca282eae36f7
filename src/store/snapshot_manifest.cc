#include "store/snapshot_manifest.h"

#include <optional>

#include "common/json.h"
#include "gpusnap/error.h"
#include "store/digest.h"

namespace gpusnap::store {

namespace {

using nlohmann::json;

std::string text_of(const json& doc, const char* key) {
  return doc.is_object() && doc.contains(key) && doc[key].is_string() ? doc[key].get<std::string>()
                                                                      : std::string();
}

Error not_ours(const std::string& name, const std::string& why) {
  return {ErrorKind::kBadArtifact, name + " is not a gpusnap snapshot: " + why,
          "give a reference that `gpusnap push` wrote"};
}

// The descriptor of a snapshot's layout in its OCI manifest, or why there is none.
//   version 1: the config (application/vnd.gpusnap.snapshot.config.v1+json);
//   version 2: an OCI image config, artifactType gpusnap's, and the layout as layer 0 with the
//              media type version 1 gave the config.
const json* layout_descriptor(const json& m, std::string& why) {
  const json& config = m.at("config");
  const std::string type = text_of(config, "mediaType");
  if (type == kConfigMediaType) return &config;
  if (type != kOciImageConfigMediaType) {
    why = "its config is '" + type.substr(0, 100) + "'";
    return nullptr;
  }
  if (text_of(m, "artifactType") != kArtifactType || !m.contains("layers") ||
      !m.at("layers").is_array() || m.at("layers").empty() ||
      text_of(m.at("layers").at(0), "mediaType") != kConfigMediaType) {
    why = "an image whose first layer is not a gpusnap layout";
    return nullptr;
  }
  return &m.at("layers").at(0);
}

}  // namespace

SnapshotManifest read_snapshot_manifest(std::string_view body, const std::string& name) {
  std::string why;
  std::optional<json> parsed = json_text::parse(body, &why);
  if (!parsed) throw not_ours(name, "its manifest is not JSON: " + why);
  SnapshotManifest s;
  s.doc = std::move(*parsed);
  const json& m = s.doc;
  if (!m.is_object() || !m.contains("config") || !m.at("config").is_object()) {
    throw not_ours(name, "its manifest has no config");
  }
  const json* found = layout_descriptor(m, why);
  if (found == nullptr) throw not_ours(name, why);
  const json& d = *found;
  s.layout_digest = text_of(d, "digest");
  if (!valid_digest(s.layout_digest) || !d.contains("size") || !d.at("size").is_number_unsigned() ||
      d.at("size").get<uint64_t>() > kMaxLayoutBytes) {
    throw not_ours(name, "its layout descriptor is malformed");
  }
  s.layout_size = d.at("size").get<uint64_t>();
  return s;
}

Layout read_snapshot_layout(std::string_view body, const std::string& name) {
  std::string why;
  std::optional<json> doc = json_text::parse(body, &why);
  if (!doc) throw not_ours(name, "its layout is not JSON: " + why);
  return Layout::from_json(*doc);  // Error(kBadArtifact) naming the field
}

}  // namespace gpusnap::store
