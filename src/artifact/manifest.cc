#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "artifact/validate.h"
#include "common/fs.h"
#include "common/json.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"

namespace gpusnap {

using nlohmann::json;

HostFacts HostFacts::probe(const std::string& criu_version) {
  HostFacts h;
  struct utsname u {};
  ::uname(&u);
  h.kernel = u.release;
  h.arch = u.machine;
  h.hostname = u.nodename;
  h.page_size = ::sysconf(_SC_PAGESIZE);
  h.criu_version = criu_version;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    auto key = line.substr(0, line.find_last_not_of(" \t", colon - 1) + 1);
    auto value = colon + 2 <= line.size() ? line.substr(colon + 2) : "";
    if (key == "model name" && h.cpu_model.empty()) h.cpu_model = value;
    if (key == "flags" && h.cpu_flags.empty()) {
      std::istringstream in(value);
      for (std::string f; in >> f;) h.cpu_flags.push_back(f);
      // cpu_flags are kept sorted (cpuinfo's order is not): manifests compare stably, and
      // lookups may binary_search (check_host_compatible still sorts its own copy).
      std::sort(h.cpu_flags.begin(), h.cpu_flags.end());
    }
  }
  return h;
}

uint64_t Manifest::total_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files) total += f.size;
  return total;
}

json Manifest::to_json() const {
  json processes_json = json::array();
  for (const auto& p : processes) {
    json stdio = json::array();
    for (const auto& s : p.stdio) stdio.push_back({{"fd", s.fd}, {"target", s.target}});
    processes_json.push_back({{"pid", p.pid},
                              {"ppid", p.ppid},
                              {"comm", p.comm},
                              {"cmdline", p.cmdline},
                              {"threads", p.threads},
                              {"rss_bytes", p.rss_bytes},
                              {"gpu_bytes", p.gpu_bytes},
                              {"stdio", stdio}});
  }
  json files_json = json::array();
  for (const auto& f : files) {
    files_json.push_back({{"path", f.path}, {"size", f.size}, {"chunks", f.chunks}});
  }
  json images_json = json::array();
  for (const auto& i : host_images) {
    images_json.push_back({{"pid", i.pid},
                           {"start", i.start},
                           {"end", i.end},
                           {"file", i.file},
                           {"file_offset", i.file_offset},
                           {"criu_key", i.criu_key},
                           {"stored_bytes", i.stored_bytes}});
  }
  json phases_json = json::array();
  for (const auto& p : checkpoint_phases) {
    phases_json.push_back({{"name", p.name}, {"seconds", p.seconds}});
  }
  return {
      {"format", format},
      {"format_version", format_version},
      {"id", id},
      {"created", created},
      {"gpusnap_version", gpusnap_version},
      {"source", {{"pid", source_pid}, {"cmdline", source_cmdline}}},
      {"host",
       {{"hostname", host.hostname},
        {"kernel", host.kernel},
        {"arch", host.arch},
        {"cpu_model", host.cpu_model},
        {"cpu_flags", host.cpu_flags},
        {"criu_version", host.criu_version},
        {"page_size", host.page_size}}},
      {"criu", {{"shell_job", shell_job}}},
      {"processes", processes_json},
      {"gpu", gpu},
      {"handshake", control_dir.empty() ? json(nullptr) : json{{"control_dir", control_dir}}},
      {"container", container},
      {"checksum", {{"algorithm", checksum_algorithm}, {"chunk_bytes", chunk_bytes}}},
      {"files", files_json},
      {"host_images", images_json},
      {"checkpoint_phases", phases_json},
  };
}

Manifest Manifest::from_json(const json& doc) {
  Manifest m;
  std::string field;
  const char* kHint =
      "the artifact is damaged or was not written by gpusnap; take a new checkpoint";
  auto wrong_type = [&](const char* key, const std::string& expected, const json& got) {
    return Error(ErrorKind::kBadArtifact,
                 std::string("manifest field '") + key + "' has the wrong type: expected " +
                     expected + ", found " + got.type_name(),
                 kHint);
  };
  // Every access goes through get(): a missing or mistyped field names itself in the error.
  // `obj` is the document itself or a value that object()/objects() already checked, so a
  // non-object there ("host": "x86_64") is reported against its own field, not as a missing
  // inner field.
  auto get = [&](const json& obj, const char* key) -> const json& {
    field = key;
    if (!obj.is_object() || !obj.contains(key)) {
      throw Error(ErrorKind::kBadArtifact, std::string("manifest lacks the field '") + key + "'",
                  kHint);
    }
    return obj.at(key);
  };
  auto object = [&](const json& obj, const char* key) -> const json& {
    const json& v = get(obj, key);
    if (!v.is_object()) throw wrong_type(key, "an object", v);
    return v;
  };
  auto objects = [&](const json& obj, const char* key) -> const json& {
    const json& v = get(obj, key);
    if (!v.is_array()) throw wrong_type(key, "an array", v);
    for (const auto& item : v) {
      if (!item.is_object()) throw wrong_type(key, "an array of objects", item);
    }
    return v;
  };
  // get<int>() / get<uint64_t>() would quietly truncate 1.9 and wrap -1: refuse both.
  auto integer = [&](const json& obj, const char* key) -> const json& {
    const json& v = get(obj, key);
    if (!v.is_number_integer()) throw wrong_type(key, "an integer", v);
    return v;
  };
  auto size = [&](const json& obj, const char* key) -> uint64_t {
    const json& v = integer(obj, key);
    if (!v.is_number_unsigned() && v.get<int64_t>() < 0) {
      throw wrong_type(key, "an unsigned integer", v);
    }
    return v.get<uint64_t>();
  };
  try {
    m.format = get(doc, "format").get<std::string>();
    if (m.format != kArtifactFormat) {
      throw Error(ErrorKind::kBadArtifact, "not a gpusnap artifact (format '" + m.format + "')",
                  "point gpusnap at a directory written by `gpusnap checkpoint`");
    }
    m.format_version = integer(doc, "format_version").get<int>();
    if (m.format_version < 1 || m.format_version > kArtifactFormatVersion) {
      throw Error(ErrorKind::kBadArtifact,
                  "artifact format version " + std::to_string(m.format_version) +
                      " is not supported (this gpusnap reads versions 1 to " +
                      std::to_string(kArtifactFormatVersion) + ")",
                  "use the gpusnap version that wrote it, or take a new checkpoint");
    }
    m.id = get(doc, "id").get<std::string>();
    m.created = get(doc, "created").get<std::string>();
    m.gpusnap_version = get(doc, "gpusnap_version").get<std::string>();
    const auto& source = object(doc, "source");
    m.source_pid = integer(source, "pid").get<pid_t>();
    m.source_cmdline = get(source, "cmdline").get<std::vector<std::string>>();
    const auto& host = object(doc, "host");
    m.host.hostname = get(host, "hostname").get<std::string>();
    m.host.kernel = get(host, "kernel").get<std::string>();
    m.host.arch = get(host, "arch").get<std::string>();
    m.host.cpu_model = get(host, "cpu_model").get<std::string>();
    m.host.cpu_flags = get(host, "cpu_flags").get<std::vector<std::string>>();
    m.host.criu_version = get(host, "criu_version").get<std::string>();
    m.host.page_size = integer(host, "page_size").get<long>();
    m.shell_job = get(object(doc, "criu"), "shell_job").get<bool>();
    for (const auto& p : objects(doc, "processes")) {
      ProcessRecord rec;
      rec.pid = integer(p, "pid").get<pid_t>();
      rec.ppid = integer(p, "ppid").get<pid_t>();
      rec.comm = get(p, "comm").get<std::string>();
      rec.cmdline = get(p, "cmdline").get<std::vector<std::string>>();
      rec.threads = integer(p, "threads").get<int>();
      rec.rss_bytes = size(p, "rss_bytes");
      rec.gpu_bytes = size(p, "gpu_bytes");
      for (const auto& s : objects(p, "stdio")) {
        rec.stdio.push_back({integer(s, "fd").get<int>(), get(s, "target").get<std::string>()});
      }
      m.processes.push_back(std::move(rec));
    }
    m.gpu = get(doc, "gpu");
    if (const auto& hs = get(doc, "handshake"); !hs.is_null()) {
      m.control_dir = get(hs, "control_dir").get<std::string>();
    }
    // Absent from manifests written before container captures existed.
    if (doc.contains("container")) m.container = doc.at("container");
    const auto& checksum = object(doc, "checksum");
    m.checksum_algorithm = get(checksum, "algorithm").get<std::string>();
    if (m.checksum_algorithm != "xxh3-128") {
      throw Error(ErrorKind::kBadArtifact,
                  "unknown checksum algorithm '" + m.checksum_algorithm + "' in the manifest",
                  "take a new checkpoint with this gpusnap");
    }
    m.chunk_bytes = size(checksum, "chunk_bytes");
    if (m.chunk_bytes == 0) {
      throw Error(ErrorKind::kBadArtifact, "manifest has a checksum chunk size of 0",
                  "the artifact is damaged; take a new checkpoint");
    }
    for (const auto& f : objects(doc, "files")) {
      FileRecord rec;
      rec.path = get(f, "path").get<std::string>();
      rec.size = size(f, "size");
      rec.chunks = get(f, "chunks").get<std::vector<std::string>>();
      m.files.push_back(std::move(rec));
    }
    if (m.format_version >= 2) {
      for (const auto& i : objects(doc, "host_images")) {
        HostImageRecord rec;
        rec.pid = integer(i, "pid").get<pid_t>();
        rec.start = size(i, "start");
        rec.end = size(i, "end");
        rec.file = get(i, "file").get<std::string>();
        // Absent in artifacts written before host images were aligned to 2 MiB pages.
        if (i.contains("file_offset")) rec.file_offset = size(i, "file_offset");
        rec.criu_key = get(i, "criu_key").get<std::string>();
        rec.stored_bytes = size(i, "stored_bytes");
        if (rec.end <= rec.start) {
          throw Error(ErrorKind::kBadArtifact, "manifest has an empty host image range", kHint);
        }
        m.host_images.push_back(std::move(rec));
      }
    }
    for (const auto& p : objects(doc, "checkpoint_phases")) {
      m.checkpoint_phases.push_back(
          {get(p, "name").get<std::string>(), get(p, "seconds").get<double>()});
    }
  } catch (const json::exception& e) {
    throw Error(ErrorKind::kBadArtifact,
                "manifest field '" + field + "' has the wrong type: " + e.what(), kHint);
  }
  artifact::validate_manifest(m);
  return m;
}

Artifact Artifact::open(const std::filesystem::path& root) {
  Artifact a;
  a.root_ = root;
  std::error_code ec;
  if (!std::filesystem::exists(root, ec)) {
    throw Error(ErrorKind::kNotFound, "artifact " + root.string() + " does not exist",
                "check the path given to gpusnap");
  }
  if (!std::filesystem::is_directory(root, ec)) {
    throw Error(ErrorKind::kBadArtifact, root.string() + " is not an artifact directory",
                "point gpusnap at a directory written by `gpusnap checkpoint`");
  }
  std::string text;
  if (!fs::try_read_regular_file(root / kManifestName, &text, artifact::kMaxManifestBytes)) {
    if (errno == EFBIG) {
      throw Error(ErrorKind::kBadArtifact,
                  std::string(kManifestName) + " in " + root.string() + " is larger than " +
                      fs::human_bytes(artifact::kMaxManifestBytes),
                  "the artifact is damaged or forged; take a new checkpoint");
    }
    throw Error(ErrorKind::kBadArtifact, root.string() + " has no " + kManifestName,
                "it is not a complete gpusnap artifact; take a new checkpoint");
  }
  auto doc = json_text::parse(text);
  if (!doc) {
    throw Error(ErrorKind::kBadArtifact,
                std::string(kManifestName) + " in " + root.string() + " is not valid JSON",
                "the artifact is damaged; take a new checkpoint");
  }
  a.manifest_ = Manifest::from_json(*doc);
  // The cheap structural check that --no-verify keeps: every file there, at its size.
  artifact::check_listed_files(root, a.manifest_);
  return a;
}

std::vector<VerifyProblem> Artifact::verify(const VerifyOptions& options) const {
  auto problems = artifact::unexpected_entries(root_, manifest_);
  auto actual = checksum_tree(root_, manifest_.chunk_bytes, options);
  std::map<std::string, const FileRecord*> expected;
  for (const auto& f : manifest_.files) expected[f.path] = &f;
  for (const auto& got : actual) {
    if (got.path == kManifestName) continue;
    auto it = expected.find(got.path);
    if (it == expected.end()) {
      problems.push_back({got.path, "not listed in the manifest"});
      continue;
    }
    const FileRecord& want = *it->second;
    expected.erase(it);
    if (got.size != want.size) {
      problems.push_back({got.path, "size " + std::to_string(got.size) + ", expected " +
                                        std::to_string(want.size)});
      continue;
    }
    for (size_t c = 0; c < got.chunks.size(); ++c) {
      if (c >= want.chunks.size() || got.chunks[c] != want.chunks[c]) {
        uint64_t begin = c * manifest_.chunk_bytes;
        uint64_t end = std::min(got.size, begin + manifest_.chunk_bytes);
        problems.push_back({got.path, "checksum mismatch in bytes " + std::to_string(begin) + "-" +
                                          std::to_string(end)});
      }
    }
  }
  for (const auto& [path, rec] : expected) problems.push_back({path, "missing"});
  return problems;
}

}  // namespace gpusnap
