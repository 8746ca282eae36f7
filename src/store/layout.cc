#include "store/layout.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "common/json.h"
#include "gpusnap/error.h"
#include "store/digest.h"

namespace gpusnap::store {

namespace {

using nlohmann::json;

// Bounds on what a layout read from a registry may claim, so that a hostile or broken one
// cannot make gpusnap allocate or write without limit.
constexpr size_t kMaxFiles = 100000;
constexpr size_t kMaxExtents = 4u << 20;
constexpr uint64_t kMaxFileBytes = 1ull << 44;  // 16 TiB

Error bad(const std::string& what) {
  return Error(ErrorKind::kBadArtifact, "bad snapshot layout: " + what,
               "push the artifact again with this gpusnap version");
}

const char* encoding_name(Encoding e) {
  switch (e) {
    case Encoding::kZstd: return "zstd";
    case Encoding::kZstdSplit2: return "zstd-split2";
    case Encoding::kRaw: break;
  }
  return "raw";
}

template <class T>
T field(const json& obj, const char* key, const std::string& where) {
  if (!obj.is_object() || !obj.contains(key)) throw bad(where + ": missing '" + key + "'");
  try {
    return obj.at(key).get<T>();
  } catch (const json::exception&) {
    throw bad(where + ": '" + key + "' has the wrong type");
  }
}

}  // namespace

uint64_t Layout::apparent_bytes() const {
  uint64_t n = 0;
  for (const auto& f : files) n += f.size;
  return n;
}

uint64_t Layout::data_bytes() const {
  uint64_t n = 0;
  for (const auto& f : files) {
    for (const auto& e : f.extents) n += e.length;
  }
  return n;
}

std::vector<BlobInfo> Layout::blobs() const {
  std::vector<BlobInfo> out;
  std::set<std::string> seen;
  for (const auto& f : files) {
    for (const auto& e : f.extents) {
      if (seen.insert(e.digest).second) out.push_back({e.digest, e.stored, e.encoding});
    }
  }
  return out;
}

uint64_t Layout::stored_bytes() const {
  uint64_t n = 0;
  for (const auto& b : blobs()) n += b.size;
  return n;
}

json Layout::to_json() const {
  json fs = json::array();
  for (const auto& f : files) {
    json ex = json::array();
    for (const auto& e : f.extents) {
      ex.push_back({e.offset, e.length, e.digest, encoding_name(e.encoding), e.stored});
    }
    fs.push_back({{"path", f.path}, {"size", f.size}, {"extents", ex}});
  }
  return {{"format", kLayoutFormat},
          {"version", kLayoutVersion},
          {"manifest", manifest},
          {"files", fs}};
}

Layout Layout::from_json(const json& doc) {
  if (field<std::string>(doc, "format", "layout") != kLayoutFormat) {
    throw bad("format is not '" + std::string(kLayoutFormat) + "'");
  }
  if (field<int>(doc, "version", "layout") != kLayoutVersion) {
    throw bad("version " + json_text::brief(doc.at("version")) + " is not " +
              std::to_string(kLayoutVersion));
  }
  Layout l;
  l.manifest = field<json>(doc, "manifest", "layout");
  const Manifest m = Manifest::from_json(l.manifest);  // throws kBadArtifact naming the field
  const json& files = doc.contains("files") ? doc.at("files") : json();
  if (!files.is_array() || files.size() > kMaxFiles) throw bad("'files' is not a list of files");
  size_t extents = 0;
  for (const auto& fj : files) {
    FileLayout f;
    f.path = field<std::string>(fj, "path", "file");
    const std::string where = "file '" + f.path.substr(0, 200) + "'";
    // The path names a file to write: nothing outside the artifact, not the manifest itself.
    const std::filesystem::path p(f.path);
    if (f.path.empty() || f.path.size() > 4096 || p.is_absolute() || f.path == kManifestName ||
        std::any_of(p.begin(), p.end(),
                    [](const auto& part) { return part == ".." || part == "." || part.empty(); })) {
      throw bad(where + ": not a plain relative path inside the artifact");
    }
    f.size = field<uint64_t>(fj, "size", where);
    if (f.size > kMaxFileBytes) throw bad(where + ": size " + std::to_string(f.size));
    const json& ex = fj.contains("extents") ? fj.at("extents") : json();
    if (!ex.is_array()) throw bad(where + ": 'extents' is not a list");
    extents += ex.size();
    if (extents > kMaxExtents) throw bad("more than " + std::to_string(kMaxExtents) + " extents");
    uint64_t end = 0;
    for (const auto& ej : ex) {
      if (!ej.is_array() || ej.size() != 5 || !ej[0].is_number_unsigned() ||
          !ej[1].is_number_unsigned() || !ej[2].is_string() || !ej[3].is_string() ||
          !ej[4].is_number_unsigned()) {
        throw bad(where + ": an extent is not [offset, length, digest, encoding, stored]");
      }
      Extent e{ej[0].get<uint64_t>(), ej[1].get<uint64_t>(), ej[2].get<std::string>(),
               Encoding::kRaw, ej[4].get<uint64_t>()};
      const auto enc = ej[3].get<std::string>();
      if (enc == "zstd") {
        e.encoding = Encoding::kZstd;
      } else if (enc == "zstd-split2") {
        e.encoding = Encoding::kZstdSplit2;
      } else if (enc != "raw") {
        throw bad(where + ": unknown encoding '" + enc.substr(0, 40) + "'");
      }
      const std::string at = where + " at offset " + std::to_string(e.offset);
      if (!valid_digest(e.digest)) throw bad(at + ": not a sha256 digest");
      if (e.length == 0 || e.length > kMaxChunkBytes || e.stored == 0 ||
          e.stored > kMaxChunkBytes || (e.encoding == Encoding::kRaw && e.stored != e.length)) {
        throw bad(at + ": chunk sizes out of bounds");
      }
      if (e.offset < end || e.offset > f.size || e.length > f.size - e.offset) {
        throw bad(at + ": extent overlaps another or ends past the file");
      }
      end = e.offset + e.length;
      f.extents.push_back(std::move(e));
    }
    l.files.push_back(std::move(f));
  }
  // The materialised artifact must open: exactly the manifest's files, at its sizes.
  std::map<std::string, uint64_t> listed;
  for (const auto& f : m.files) listed[f.path] = f.size;
  std::map<std::string, uint64_t> have;
  for (const auto& f : l.files) {
    if (!have.emplace(f.path, f.size).second) throw bad("file '" + f.path + "' listed twice");
  }
  if (listed != have) throw bad("its files are not those its manifest lists");
  return l;
}

}  // namespace gpusnap::store
