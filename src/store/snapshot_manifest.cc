#include "store/snapshot_manifest.h"

#include <map>
#include <optional>
#include <set>

#include "common/json.h"
#include "gpusnap/error.h"
#include "store/digest.h"

namespace gpusnap::store {

namespace {

std::string chunk_media_type(Encoding e) {
  switch (e) {
    case Encoding::kZstd: return kChunkZstdMediaType;
    case Encoding::kZstdSplit2: return kChunkSplit2ZstdMediaType;
    case Encoding::kRaw: break;
  }
  return kChunkMediaType;
}

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
      (text_of(m.at("layers").at(0), "mediaType") != kConfigMediaType &&
       text_of(m.at("layers").at(0), "mediaType") != kEncryptedConfigMediaType)) {
    why = "an image whose first layer is not a gpusnap layout";
    return nullptr;
  }
  return &m.at("layers").at(0);
}

}  // namespace

namespace {

// Counts a JSON text's values without building them, and stops past `limit`.
class ValueCounter : public json::json_sax_t {
 public:
  explicit ValueCounter(size_t limit) : limit_(limit) {}
  size_t count = 0;
  bool null() override { return more(); }
  bool boolean(bool) override { return more(); }
  bool number_integer(number_integer_t) override { return more(); }
  bool number_unsigned(number_unsigned_t) override { return more(); }
  bool number_float(number_float_t, const string_t&) override { return more(); }
  bool string(string_t&) override { return more(); }
  bool binary(binary_t&) override { return more(); }
  bool start_object(std::size_t) override { return more(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return more(); }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;  // the parse that follows says what is wrong
  }

 private:
  bool more() { return ++count <= limit_; }
  size_t limit_;
};

}  // namespace

SnapshotManifest read_snapshot_manifest(std::string_view body, const std::string& name) {
  ValueCounter counter(kMaxManifestValues);
  json::sax_parse(body, &counter, json::input_format_t::json, false);
  if (counter.count > kMaxManifestValues) {
    throw not_ours(name, "its manifest holds more than " + std::to_string(kMaxManifestValues) +
                             " JSON values");
  }
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
  s.encrypted = text_of(d, "mediaType") == kEncryptedConfigMediaType;
  if (m.contains("annotations"))
    s.part = text_of(m.at("annotations"), kPartAnnotation).substr(0, 32);
  return s;
}

void check_snapshot_layers(const SnapshotManifest& manifest, const Layout& layout,
                           const std::string& name, std::set<std::string>& seen,
                           const SealedChunks* sealed) {
  const json& m = manifest.doc;
  if (!m.contains("layers")) return;
  const json& layers = m.at("layers");
  if (!layers.is_array()) throw not_ours(name, "its layers are not a list");
  std::map<std::string, uint64_t> chunks;
  for (const auto& b : layout.blobs()) {
    if (sealed == nullptr) {
      chunks.emplace(b.digest, b.size);
    } else if (auto it = sealed->find(b.digest); it != sealed->end()) {
      chunks.emplace(it->second.digest, it->second.size);
    }
  }
  // Version 2 holds the layout as layer 0; version 1 as the config.
  const size_t first = text_of(m.at("config"), "mediaType") == kConfigMediaType ? 0 : 1;
  if (layers.size() > chunks.size() + first) {
    throw not_ours(name, "its manifest lists " + std::to_string(layers.size()) +
                             " layers for a layout of " + std::to_string(chunks.size()) +
                             " chunks");
  }
  for (size_t i = first; i < layers.size(); ++i) {
    const json& d = layers.at(i);
    const std::string digest = text_of(d, "digest");
    const std::string at = "layer " + std::to_string(i);
    if (!valid_digest(digest) || !d.contains("size") || !d.at("size").is_number_unsigned()) {
      throw not_ours(name, at + " is not a descriptor with a sha256 digest and a size");
    }
    auto it = chunks.find(digest);
    if (it == chunks.end())
      throw not_ours(name, at + " (" + digest + ") is no chunk of its layout");
    if (it->second != d.at("size").get<uint64_t>()) {
      throw not_ours(name, at + " says size " + std::to_string(d.at("size").get<uint64_t>()) +
                               " where the layout's chunk " + digest + " has " +
                               std::to_string(it->second) + " bytes");
    }
    if (!seen.insert(digest).second) throw not_ours(name, at + " repeats chunk " + digest);
  }
}

bool is_snapshot_index(std::string_view body) {
  // As gpusnap writes it (registries serve a manifest's bytes unchanged, copies keep them):
  // an image manifest names no index media type, and a body that is not a snapshot's index
  // is refused by read_snapshot_index for what it is.
  return body.find(std::string("\"mediaType\":\"") + kOciImageIndexMediaType + "\"") !=
         std::string_view::npos;
}

std::vector<std::string> read_snapshot_index(std::string_view body, const std::string& name,
                                             json& doc) {
  // An index of kMaxManifestParts entries holds about 20 values each.
  constexpr size_t kMaxIndexValues = kMaxManifestParts * 20 + 100;
  ValueCounter counter(kMaxIndexValues);
  json::sax_parse(body, &counter, json::input_format_t::json, false);
  if (counter.count > kMaxIndexValues) {
    throw not_ours(name,
                   "its index holds more than " + std::to_string(kMaxIndexValues) + " JSON values");
  }
  std::string why;
  std::optional<json> parsed = json_text::parse(body, &why);
  if (!parsed) throw not_ours(name, "its index is not JSON: " + why);
  doc = std::move(*parsed);
  if (!doc.is_object() || text_of(doc, "mediaType") != kOciImageIndexMediaType ||
      text_of(doc, "artifactType") != kArtifactType || !doc.contains("manifests") ||
      !doc.at("manifests").is_array() || doc.at("manifests").empty()) {
    throw not_ours(name, "its index lists no snapshot manifests");
  }
  const json& list = doc.at("manifests");
  if (list.size() > kMaxManifestParts) {
    throw not_ours(name, "its index lists " + std::to_string(list.size()) +
                             " manifests, more than the " + std::to_string(kMaxManifestParts) +
                             " of a snapshot");
  }
  std::vector<std::string> parts;
  std::set<std::string> seen;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& d = list.at(i);
    const std::string digest = text_of(d, "digest");
    if (text_of(d, "mediaType") != kOciManifestMediaType || !valid_digest(digest) ||
        !d.contains("size") || !d.at("size").is_number_unsigned() ||
        d.at("size").get<uint64_t>() > kMaxManifestBytes || !seen.insert(digest).second) {
      throw not_ours(name, "its index's manifest " + std::to_string(i) +
                               " is not a descriptor of an image manifest of at most 4 MiB "
                               "listed once");
    }
    parts.push_back(digest);
  }
  return parts;
}

namespace {

// The title of a layer: what it stores, as OCI tools show a layer's file name. A chunk's
// is the first file and offset it fills ("PATH@OFFSET"), cut short at a character.
std::string title(const std::string& path, uint64_t offset) {
  std::string t = path.size() > 200 ? path.substr(0, 200) : path;
  while (t.size() < path.size() && !t.empty() &&
         (static_cast<unsigned char>(path[t.size()]) & 0xC0) == 0x80) {
    t.pop_back();
  }
  return t + "@" + std::to_string(offset);
}

json manifest_of(const Descriptor& config, const json& layout_layer, json layers,
                 json annotations) {
  layers.insert(layers.begin(), layout_layer);
  return {
      {"schemaVersion", 2},
      {"mediaType", kOciManifestMediaType},
      {"artifactType", kArtifactType},
      {"config",
       {{"mediaType", kOciImageConfigMediaType}, {"digest", config.digest}, {"size", config.size}}},
      {"layers", std::move(layers)},
      {"annotations", std::move(annotations)}};
}

}  // namespace

SnapshotManifests snapshot_manifests(const Layout& layout, const Descriptor& layout_blob,
                                     const Descriptor& config, const json& annotations,
                                     const std::string& arch, const SealedChunks* sealed) {
  const std::string suffix = sealed != nullptr ? kEncryptedSuffix : "";
  std::map<std::string, std::string> titles;
  for (const FileLayout& f : layout.files) {
    for (const Extent& e : f.extents) titles.emplace(e.digest, title(f.path, e.offset));
  }
  const json layout_layer = {{"mediaType", kConfigMediaType + suffix},
                             {"digest", layout_blob.digest},
                             {"size", layout_blob.size},
                             {"annotations", {{kTitleAnnotation, "layout.json"}}}};
  // A part's size is its layers' and the rest's, known before it is built: each layer adds
  // its text and a comma. The rest is measured on an empty part with the longest part
  // annotation ("4096/4096").
  json probe_annotations = annotations;
  probe_annotations[kPartAnnotation] = "0000/0000";
  const size_t empty =
      manifest_of(config, layout_layer, json::array(), probe_annotations).dump().size();
  std::vector<json> groups(1, json::array());
  size_t size = empty;
  for (const BlobInfo& b : layout.blobs()) {
    // An encrypted snapshot lists each chunk's sealed blob, titled as the chunk.
    const SealedChunk* s = sealed != nullptr ? &sealed->at(b.digest) : nullptr;
    json layer = {{"mediaType", chunk_media_type(b.encoding) + suffix},
                  {"digest", s != nullptr ? s->digest : b.digest},
                  {"size", s != nullptr ? s->size : b.size},
                  {"annotations", {{kTitleAnnotation, titles[b.digest]}}}};
    const size_t more = layer.dump().size() + 1;
    if (size + more > kMaxManifestBytes && !groups.back().empty()) {
      groups.emplace_back(json::array());
      size = empty;
    }
    size += more;
    groups.back().push_back(std::move(layer));
  }
  SnapshotManifests out;
  if (groups.size() == 1) {
    out.parts.push_back(
        manifest_of(config, layout_layer, std::move(groups[0]), annotations).dump());
    return out;
  }
  if (groups.size() > kMaxManifestParts) {
    throw Error(ErrorKind::kUsage,
                "the snapshot's " + std::to_string(layout.blobs().size()) + " chunks need " +
                    std::to_string(groups.size()) + " manifests, more than the " +
                    std::to_string(kMaxManifestParts) + " an index of a snapshot lists",
                "push with larger chunks");
  }
  json manifests = json::array();
  for (size_t i = 0; i < groups.size(); ++i) {
    json a = annotations;
    a[kPartAnnotation] = std::to_string(i + 1) + "/" + std::to_string(groups.size());
    std::string body = manifest_of(config, layout_layer, std::move(groups[i]), a).dump();
    manifests.push_back({{"mediaType", kOciManifestMediaType},
                         {"digest", sha256_digest(body)},
                         {"size", body.size()},
                         {"platform", {{"architecture", arch}, {"os", "linux"}}},
                         {"annotations", {{kPartAnnotation, a[kPartAnnotation]}}}});
    out.parts.push_back(std::move(body));
  }
  out.index = json{{"schemaVersion", 2},
                   {"mediaType", kOciImageIndexMediaType},
                   {"artifactType", kArtifactType},
                   {"manifests", std::move(manifests)},
                   {"annotations", annotations}}
                  .dump();
  return out;
}

Layout read_snapshot_layout(std::string_view body, const std::string& name) {
  std::string why;
  std::optional<json> doc = json_text::parse(body, &why);
  if (!doc) throw not_ours(name, "its layout is not JSON: " + why);
  return Layout::from_json(*doc);  // Error(kBadArtifact) naming the field
}

}  // namespace gpusnap::store
