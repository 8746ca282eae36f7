#include "store/snapshot_manifest.h"

#include <map>
#include <optional>
#include <set>

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
  return s;
}

void check_snapshot_layers(const SnapshotManifest& manifest, const Layout& layout,
                           const std::string& name) {
  const json& m = manifest.doc;
  if (!m.contains("layers")) return;
  const json& layers = m.at("layers");
  if (!layers.is_array()) throw not_ours(name, "its layers are not a list");
  std::map<std::string, uint64_t> chunks;
  for (const auto& b : layout.blobs()) chunks.emplace(b.digest, b.size);
  // Version 2 holds the layout as layer 0; version 1 as the config.
  const size_t first = text_of(m.at("config"), "mediaType") == kConfigMediaType ? 0 : 1;
  if (layers.size() > chunks.size() + first) {
    throw not_ours(name, "its manifest lists " + std::to_string(layers.size()) +
                             " layers for a layout of " + std::to_string(chunks.size()) +
                             " chunks");
  }
  std::set<std::string> seen;
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

Layout read_snapshot_layout(std::string_view body, const std::string& name) {
  std::string why;
  std::optional<json> doc = json_text::parse(body, &why);
  if (!doc) throw not_ours(name, "its layout is not JSON: " + why);
  return Layout::from_json(*doc);  // Error(kBadArtifact) naming the field
}

}  // namespace gpusnap::store
