#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "common/fs.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"

namespace gpusnap {

using nlohmann::json;

HostFacts HostFacts::probe(const std::string& criu_version) {
  HostFacts h;
  struct utsname u{};
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
      {"checksum", {{"algorithm", checksum_algorithm}, {"chunk_bytes", chunk_bytes}}},
      {"files", files_json},
      {"checkpoint_phases", phases_json},
  };
}

Manifest Manifest::from_json(const json& doc) {
  Manifest m;
  std::string field;
  // Every access goes through get(): a missing or mistyped field names itself in the error.
  auto get = [&](const json& obj, const char* key) -> const json& {
    field = key;
    if (!obj.is_object() || !obj.contains(key)) {
      throw Error(ErrorKind::kBadArtifact, std::string("manifest lacks the field '") + key + "'",
                  "the artifact is damaged or was not written by gpusnap; take a new checkpoint");
    }
    return obj.at(key);
  };
  try {
    m.format = get(doc, "format").get<std::string>();
    if (m.format != kArtifactFormat) {
      throw Error(ErrorKind::kBadArtifact,
                  "not a gpusnap artifact (format '" + m.format + "')",
                  "point gpusnap at a directory written by `gpusnap checkpoint`");
    }
    m.format_version = get(doc, "format_version").get<int>();
    if (m.format_version != kArtifactFormatVersion) {
      throw Error(ErrorKind::kBadArtifact,
                  "artifact format version " + std::to_string(m.format_version) +
                      " is not supported (this gpusnap reads version " +
                      std::to_string(kArtifactFormatVersion) + ")",
                  "use the gpusnap version that wrote it, or take a new checkpoint");
    }
    m.id = get(doc, "id").get<std::string>();
    m.created = get(doc, "created").get<std::string>();
    m.gpusnap_version = get(doc, "gpusnap_version").get<std::string>();
    const auto& source = get(doc, "source");
    m.source_pid = get(source, "pid").get<pid_t>();
    m.source_cmdline = get(source, "cmdline").get<std::vector<std::string>>();
    const auto& host = get(doc, "host");
    m.host.hostname = get(host, "hostname").get<std::string>();
    m.host.kernel = get(host, "kernel").get<std::string>();
    m.host.arch = get(host, "arch").get<std::string>();
    m.host.cpu_model = get(host, "cpu_model").get<std::string>();
    m.host.cpu_flags = get(host, "cpu_flags").get<std::vector<std::string>>();
    m.host.criu_version = get(host, "criu_version").get<std::string>();
    m.host.page_size = get(host, "page_size").get<long>();
    m.shell_job = get(get(doc, "criu"), "shell_job").get<bool>();
    for (const auto& p : get(doc, "processes")) {
      ProcessRecord rec;
      rec.pid = get(p, "pid").get<pid_t>();
      rec.ppid = get(p, "ppid").get<pid_t>();
      rec.comm = get(p, "comm").get<std::string>();
      rec.cmdline = get(p, "cmdline").get<std::vector<std::string>>();
      rec.threads = get(p, "threads").get<int>();
      rec.rss_bytes = get(p, "rss_bytes").get<uint64_t>();
      rec.gpu_bytes = get(p, "gpu_bytes").get<uint64_t>();
      for (const auto& s : get(p, "stdio")) {
        rec.stdio.push_back({get(s, "fd").get<int>(), get(s, "target").get<std::string>()});
      }
      m.processes.push_back(std::move(rec));
    }
    m.gpu = get(doc, "gpu");
    const auto& checksum = get(doc, "checksum");
    m.checksum_algorithm = get(checksum, "algorithm").get<std::string>();
    if (m.checksum_algorithm != "xxh3-128") {
      throw Error(ErrorKind::kBadArtifact,
                  "unknown checksum algorithm '" + m.checksum_algorithm + "' in the manifest",
                  "take a new checkpoint with this gpusnap");
    }
    m.chunk_bytes = get(checksum, "chunk_bytes").get<uint64_t>();
    if (m.chunk_bytes == 0) {
      throw Error(ErrorKind::kBadArtifact, "manifest has a checksum chunk size of 0",
                  "the artifact is damaged; take a new checkpoint");
    }
    for (const auto& f : get(doc, "files")) {
      FileRecord rec;
      rec.path = get(f, "path").get<std::string>();
      rec.size = get(f, "size").get<uint64_t>();
      rec.chunks = get(f, "chunks").get<std::vector<std::string>>();
      m.files.push_back(std::move(rec));
    }
    for (const auto& p : get(doc, "checkpoint_phases")) {
      m.checkpoint_phases.push_back({get(p, "name").get<std::string>(),
                                     get(p, "seconds").get<double>()});
    }
  } catch (const json::exception& e) {
    throw Error(ErrorKind::kBadArtifact,
                "manifest field '" + field + "' has the wrong type: " + e.what(),
                "the artifact is damaged or was not written by gpusnap; take a new checkpoint");
  }
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
  if (!fs::try_read_file(root / kManifestName, &text)) {
    throw Error(ErrorKind::kBadArtifact, root.string() + " has no " + kManifestName,
                "it is not a complete gpusnap artifact; take a new checkpoint");
  }
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    throw Error(ErrorKind::kBadArtifact,
                std::string(kManifestName) + " in " + root.string() + " is not valid JSON",
                "the artifact is damaged; take a new checkpoint");
  }
  a.manifest_ = Manifest::from_json(doc);
  // The cheap structural check that --no-verify keeps: every file there, at its size.
  for (const auto& f : a.manifest_.files) {
    if (f.path.empty() || f.path.front() == '/' || f.path.find("..") != std::string::npos) {
      throw Error(ErrorKind::kBadArtifact, "manifest lists an unsafe path '" + f.path + "'",
                  "the artifact is damaged or forged; take a new checkpoint");
    }
    auto size = std::filesystem::file_size(root / f.path, ec);
    if (ec) {
      throw Error(ErrorKind::kBadArtifact, "artifact file " + f.path + " is missing",
                  "the artifact is incomplete; copy it again or take a new checkpoint");
    }
    if (size != f.size) {
      throw Error(ErrorKind::kBadArtifact,
                  "artifact file " + f.path + " has " + std::to_string(size) +
                      " bytes, the manifest says " + std::to_string(f.size) + " (truncated?)",
                  "the artifact is damaged; copy it again or take a new checkpoint");
    }
  }
  return a;
}

std::vector<VerifyProblem> Artifact::verify(const VerifyOptions& options) const {
  std::vector<VerifyProblem> problems;
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
        problems.push_back({got.path, "checksum mismatch in bytes " + std::to_string(begin) +
                                          "-" + std::to_string(end)});
      }
    }
  }
  for (const auto& [path, rec] : expected) problems.push_back({path, "missing"});
  return problems;
}

}  // namespace gpusnap
