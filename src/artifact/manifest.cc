#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

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

namespace {

json gpu_json(const GpuFacts& g) {
  json gpus = json::array();
  for (const auto& d : g.gpus) {
    gpus.push_back({{"index", d.index},
                    {"used", d.used},
                    {"uuid", d.uuid},
                    {"name", d.name},
                    {"bus_id", d.bus_id},
                    {"compute_capability", d.compute_capability},
                    {"memory_total", d.memory_total}});
  }
  json processes = json::array();
  for (const auto& p : g.processes) {
    json usage = json::array();
    for (const auto& u : p.gpus) usage.push_back({{"uuid", u.uuid}, {"bytes", u.bytes}});
    processes.push_back({{"pid", p.pid}, {"bytes", p.bytes}, {"gpus", usage}});
  }
  return {{"driver_version", g.driver_version},
          {"cuda_driver_version", g.cuda_driver_version},
          {"gpus", gpus},
          {"processes", processes}};
}

json container_json(const ContainerRecord& c) {
  json files = json::array();
  for (const auto& f : c.rootfs_files) {
    // A file is identified by one of the two: its ELF build-id where it has one, else its
    // content's XXH3 (validate.cc refuses both or neither).
    json file = {{"path", f.path}, {"size", f.size}};
    if (!f.xxh3.empty()) file["xxh3"] = f.xxh3;
    if (!f.build_id.empty()) file["build_id"] = f.build_id;
    files.push_back(std::move(file));
  }
  return {
      {"runtime", c.runtime}, {"runtime_root", c.runtime_root}, {"id", c.id}, {"bundle", c.bundle},
      {"rootfs", c.rootfs},   {"rootfs_files", files},
  };
}

}  // namespace

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
      {"gpu", gpu ? gpu_json(*gpu) : json(nullptr)},
      {"handshake", control_dir.empty() ? json(nullptr) : json{{"control_dir", control_dir}}},
      {"container", container ? container_json(*container) : json(nullptr)},
      {"checksum", {{"algorithm", checksum_algorithm}, {"chunk_bytes", chunk_bytes}}},
      {"files", files_json},
      {"host_images", images_json},
      {"checkpoint_phases", phases_json},
  };
}

namespace {

constexpr const char* kDamagedHint =
    "the artifact is damaged or was not written by gpusnap; take a new checkpoint";

// Reads a manifest document field by field. Every access checks the field's presence and type
// and names the field in its error: a malformed manifest is a bad artifact (exit 4), never a
// JSON library exception. `obj` is the document itself or a value that object()/objects()
// already checked, so a non-object there ("host": "x86_64") is reported against its own field,
// not as a missing inner field.
class ManifestReader {
 public:
  Manifest read(const json& doc) {
    try {
      Manifest m;
      read_header(doc, m);
      read_host(object(doc, "host"), m.host);
      m.shell_job = boolean(object(doc, "criu"), "shell_job");
      for (const auto& p : objects(doc, "processes")) m.processes.push_back(process(p));
      m.gpu = gpu(doc);
      if (const auto& hs = get(doc, "handshake"); !hs.is_null()) {
        m.control_dir = text(hs, "control_dir");
      }
      m.container = container(doc);
      read_checksum(object(doc, "checksum"), m);
      for (const auto& f : objects(doc, "files")) {
        m.files.push_back({text(f, "path"), size(f, "size"), texts(f, "chunks")});
      }
      for (const auto& i : objects(doc, "host_images")) m.host_images.push_back(host_image(i));
      for (const auto& p : objects(doc, "checkpoint_phases")) {
        m.checkpoint_phases.push_back({text(p, "name"), number(p, "seconds")});
      }
      return m;
    } catch (const json::exception& e) {
      // The checks above leave nothing for the library to refuse; kept so that one missed
      // still names its field rather than escaping as an internal error.
      throw Error(ErrorKind::kBadArtifact,
                  "manifest field '" + field_ + "' has the wrong type: " + e.what(), kDamagedHint);
    }
  }

 private:
  void read_header(const json& doc, Manifest& m) {
    m.format = text(doc, "format");
    if (m.format != kArtifactFormat) {
      throw Error(ErrorKind::kBadArtifact, "not a gpusnap artifact (format '" + m.format + "')",
                  "point gpusnap at a directory written by `gpusnap checkpoint`");
    }
    m.format_version = integer(doc, "format_version").get<int>();
    if (m.format_version != kArtifactFormatVersion) {
      throw Error(ErrorKind::kBadArtifact,
                  "artifact format version " + std::to_string(m.format_version) +
                      " is not supported (this gpusnap reads version " +
                      std::to_string(kArtifactFormatVersion) + ")",
                  "use the gpusnap version that wrote it, or take a new checkpoint");
    }
    m.id = text(doc, "id");
    m.created = text(doc, "created");
    m.gpusnap_version = text(doc, "gpusnap_version");
    const auto& source = object(doc, "source");
    m.source_pid = integer(source, "pid").get<pid_t>();
    m.source_cmdline = texts(source, "cmdline");
  }

  void read_host(const json& host, HostFacts& h) {
    h.hostname = text(host, "hostname");
    h.kernel = text(host, "kernel");
    h.arch = text(host, "arch");
    h.cpu_model = text(host, "cpu_model");
    h.cpu_flags = texts(host, "cpu_flags");
    h.criu_version = text(host, "criu_version");
    h.page_size = integer(host, "page_size").get<long>();
  }

  ProcessRecord process(const json& p) {
    ProcessRecord rec;
    rec.pid = integer(p, "pid").get<pid_t>();
    rec.ppid = integer(p, "ppid").get<pid_t>();
    rec.comm = text(p, "comm");
    rec.cmdline = texts(p, "cmdline");
    rec.threads = integer(p, "threads").get<int>();
    rec.rss_bytes = size(p, "rss_bytes");
    rec.gpu_bytes = size(p, "gpu_bytes");
    for (const auto& s : objects(p, "stdio")) {
      rec.stdio.push_back({integer(s, "fd").get<int>(), text(s, "target")});
    }
    return rec;
  }

  std::optional<GpuFacts> gpu(const json& doc) {
    const json& g = object_or_null(doc, "gpu");
    if (g.is_null()) return std::nullopt;
    GpuFacts facts;
    facts.driver_version = text(g, "driver_version");
    facts.cuda_driver_version = integer(g, "cuda_driver_version").get<int>();
    for (const auto& d : objects(g, "gpus")) {
      GpuRecord rec;
      rec.index = integer(d, "index").get<int>();
      rec.used = boolean(d, "used");
      rec.uuid = text(d, "uuid");
      rec.name = text(d, "name");
      rec.bus_id = text(d, "bus_id");
      rec.compute_capability = text(d, "compute_capability");
      rec.memory_total = size(d, "memory_total");
      facts.gpus.push_back(std::move(rec));
    }
    for (const auto& p : objects(g, "processes")) {
      GpuProcessRecord rec;
      rec.pid = integer(p, "pid").get<pid_t>();
      rec.bytes = size(p, "bytes");
      for (const auto& u : objects(p, "gpus")) {
        rec.gpus.push_back({text(u, "uuid"), size(u, "bytes")});
        // A restore maps each process's GPUs; one the section does not list cannot be mapped.
        if (!std::any_of(facts.gpus.begin(), facts.gpus.end(),
                         [&](const GpuRecord& d) { return d.uuid == rec.gpus.back().uuid; })) {
          throw Error(ErrorKind::kBadArtifact,
                      "manifest field 'gpu' names GPU " + rec.gpus.back().uuid + " for process " +
                          std::to_string(rec.pid) + " but does not list it",
                      kDamagedHint);
        }
      }
      facts.processes.push_back(std::move(rec));
    }
    return facts;
  }

  std::optional<ContainerRecord> container(const json& doc) {
    const json& c = object_or_null(doc, "container");
    if (c.is_null()) return std::nullopt;
    ContainerRecord rec;
    rec.runtime = text(c, "runtime");
    rec.runtime_root = text(c, "runtime_root");
    rec.id = text(c, "id");
    rec.bundle = text(c, "bundle");
    rec.rootfs = text(c, "rootfs");
    for (const auto& f : objects(c, "rootfs_files")) {
      // Each of xxh3 and build_id may be absent (build_id is younger than the format; a file
      // with a build-id has no xxh3): validate.cc wants exactly one.
      rec.rootfs_files.push_back({text(f, "path"), size(f, "size"),
                                  f.contains("xxh3") ? text(f, "xxh3") : std::string(),
                                  f.contains("build_id") ? text(f, "build_id") : std::string()});
    }
    return rec;
  }

  void read_checksum(const json& checksum, Manifest& m) {
    m.checksum_algorithm = text(checksum, "algorithm");
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
  }

  HostImageRecord host_image(const json& i) {
    HostImageRecord rec;
    rec.pid = integer(i, "pid").get<pid_t>();
    rec.start = size(i, "start");
    rec.end = size(i, "end");
    rec.file = text(i, "file");
    rec.file_offset = size(i, "file_offset");
    rec.criu_key = text(i, "criu_key");
    rec.stored_bytes = size(i, "stored_bytes");
    if (rec.end <= rec.start) {
      throw Error(ErrorKind::kBadArtifact, "manifest has an empty host image range", kDamagedHint);
    }
    return rec;
  }

  Error wrong_type(const char* key, const std::string& expected, const json& got) const {
    return Error(ErrorKind::kBadArtifact,
                 std::string("manifest field '") + key + "' has the wrong type: expected " +
                     expected + ", found " + got.type_name(),
                 kDamagedHint);
  }

  const json& get(const json& obj, const char* key) {
    field_ = key;
    if (!obj.is_object() || !obj.contains(key)) {
      throw Error(ErrorKind::kBadArtifact, std::string("manifest lacks the field '") + key + "'",
                  kDamagedHint);
    }
    return obj.at(key);
  }

  const json& object(const json& obj, const char* key) {
    const json& v = get(obj, key);
    if (!v.is_object()) throw wrong_type(key, "an object", v);
    return v;
  }

  // An optional section: present as an object, or null.
  const json& object_or_null(const json& obj, const char* key) {
    const json& v = get(obj, key);
    if (!v.is_object() && !v.is_null()) throw wrong_type(key, "an object or null", v);
    return v;
  }

  const json& objects(const json& obj, const char* key) {
    const json& v = get(obj, key);
    if (!v.is_array()) throw wrong_type(key, "an array", v);
    for (const auto& item : v) {
      if (!item.is_object()) throw wrong_type(key, "an array of objects", item);
    }
    return v;
  }

  std::string text(const json& obj, const char* key) {
    const json& v = get(obj, key);
    if (!v.is_string()) throw wrong_type(key, "a string", v);
    return v.get<std::string>();
  }

  std::vector<std::string> texts(const json& obj, const char* key) {
    const json& v = get(obj, key);
    if (!v.is_array()) throw wrong_type(key, "an array of strings", v);
    for (const auto& item : v) {
      if (!item.is_string()) throw wrong_type(key, "an array of strings", item);
    }
    return v.get<std::vector<std::string>>();
  }

  bool boolean(const json& obj, const char* key) {
    const json& v = get(obj, key);
    if (!v.is_boolean()) throw wrong_type(key, "true or false", v);
    return v.get<bool>();
  }

  double number(const json& obj, const char* key) {
    const json& v = get(obj, key);
    if (!v.is_number()) throw wrong_type(key, "a number", v);
    return v.get<double>();
  }

  // get<int>() / get<uint64_t>() would quietly truncate 1.9 and wrap -1: refuse both.
  const json& integer(const json& obj, const char* key) {
    const json& v = get(obj, key);
    if (!v.is_number_integer()) throw wrong_type(key, "an integer", v);
    return v;
  }

  uint64_t size(const json& obj, const char* key) {
    const json& v = integer(obj, key);
    if (!v.is_number_unsigned() && v.get<int64_t>() < 0) {
      throw wrong_type(key, "an unsigned integer", v);
    }
    return v.get<uint64_t>();
  }

  std::string field_;  // the field being read, for an error the checks did not foresee
};

}  // namespace

// Read field by field, then every path and bound checked once (artifact/validate.h).
Manifest Manifest::from_json(const json& doc) {
  Manifest m = ManifestReader().read(doc);
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

std::vector<VerifyProblem> Artifact::verify(const VerifyOptions& options,
                                            const VerifyScope& scope) const {
  std::vector<VerifyProblem> problems;
  if (scope.only.empty()) problems = artifact::unexpected_entries(root_, manifest_);
  // A file left out (deferred, or not one of `only`) is given its manifest's checksums, which
  // checksum_tree takes instead of reading it when its size is the manifest's.
  std::vector<FileRecord> left_out;
  for (const auto& f : manifest_.files) {
    if (scope.deferred.count(f.path) != 0 ||
        (!scope.only.empty() && scope.only.count(f.path) == 0)) {
      left_out.push_back(f);
    }
  }
  auto actual = checksum_tree(root_, manifest_.chunk_bytes, options, left_out);
  std::map<std::string, const FileRecord*> listed;
  for (const auto& f : manifest_.files) listed[f.path] = &f;
  for (const auto& got : actual) {
    if (got.path == kManifestName) continue;
    if (!scope.only.empty() && scope.only.count(got.path) == 0) continue;
    const auto want = listed.find(got.path);
    if (want == listed.end()) {
      problems.push_back({got.path, "not listed in the manifest"});
      continue;
    }
    for (auto& p : compare_with(*want->second, got)) problems.push_back(std::move(p));
    listed.erase(want);
  }
  for (const auto& [path, record] : listed) {
    if (scope.only.empty() || scope.only.count(path) != 0) problems.push_back({path, "missing"});
  }
  return problems;
}

std::vector<VerifyProblem> Artifact::compare(const FileRecord& got) const {
  const auto want = std::find_if(manifest_.files.begin(), manifest_.files.end(),
                                 [&](const FileRecord& f) { return f.path == got.path; });
  if (want == manifest_.files.end()) return {{got.path, "not listed in the manifest"}};
  return compare_with(*want, got);
}

std::vector<VerifyProblem> Artifact::compare_with(const FileRecord& want,
                                                  const FileRecord& got) const {
  if (got.size != want.size) {
    return {
        {got.path, "size " + std::to_string(got.size) + ", expected " + std::to_string(want.size)}};
  }
  std::vector<VerifyProblem> problems;
  for (size_t c = 0; c < got.chunks.size(); ++c) {
    if (c >= want.chunks.size() || got.chunks[c] != want.chunks[c]) {
      uint64_t begin = c * manifest_.chunk_bytes;
      uint64_t end = std::min(got.size, begin + manifest_.chunk_bytes);
      problems.push_back({got.path, "checksum mismatch in bytes " + std::to_string(begin) + "-" +
                                        std::to_string(end)});
    }
  }
  if (got.chunks.size() < want.chunks.size()) {
    problems.push_back({got.path, "checksums of " + std::to_string(got.chunks.size()) + " of " +
                                      std::to_string(want.chunks.size()) + " chunks"});
  }
  return problems;
}

}  // namespace gpusnap
