#include "engine/documents.h"

#include <algorithm>

#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

using nlohmann::json;

json phases_json(const std::vector<PhaseTiming>& phases) {
  json out = json::array();
  for (const auto& p : phases) out.push_back({{"name", p.name}, {"seconds", p.seconds}});
  return out;
}

json host_images_json(const Manifest& m) {
  json out = json::array();
  for (const auto& i : m.host_images) {
    out.push_back({{"pid", i.pid}, {"bytes", i.end - i.start}, {"stored_bytes", i.stored_bytes}});
  }
  return out;
}

double sum(const std::vector<PhaseTiming>& phases) {
  double total = 0;
  for (const auto& p : phases) total += p.seconds;
  return total;
}

}  // namespace

json checkpoint_document(const CheckpointResult& r, bool leave_running,
                         const std::vector<std::string>& notes) {
  return {{"artifact", r.artifact.string()},
          {"id", r.manifest.id},
          {"pid", r.manifest.source_pid},
          {"processes", r.manifest.processes.size()},
          {"bytes", r.manifest.total_bytes()},
          {"source_left_running", leave_running},
          {"handshake", r.handshake},
          {"phases", phases_json(r.phases)},
          {"seconds", sum(r.phases)},
          {"host_images", host_images_json(r.manifest)},
          {"notes", notes},
          {"container", r.manifest.container ? json(r.manifest.container->id) : json(nullptr)}};
}

json restore_document(const RestoreResult& r, const std::filesystem::path& artifact,
                      const std::vector<std::string>& notes) {
  json copies = json::array();
  for (const auto& c : r.copies) {
    json ports = json::array();
    for (const auto& p : c.ports) {
      ports.push_back(
          {{"host_address", p.host_address}, {"host_port", p.host_port}, {"port", p.port}});
    }
    copies.push_back({{"index", c.index},
                      {"pid", c.host_pid},
                      {"ns_pid", c.ns_pid},
                      {"init_pid", c.init_pid},
                      {"dir", c.dir.string()},
                      {"ports", ports}});
  }
  return {{"artifact", artifact.string()},
          {"id", r.manifest.id},
          {"copies", copies},
          {"handshake", r.handshake},
          {"phases", phases_json(r.phases)},
          {"seconds", sum(r.phases)},
          {"notes", notes}};
}

json inspect_document(const Artifact& a) {
  json doc = a.manifest().to_json();
  doc["artifact"] = a.root().string();
  doc["total_bytes"] = a.manifest().total_bytes();
  return doc;
}

json list_document(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw Error(ErrorKind::kNotFound, "snapshot directory " + dir.string() + " does not exist",
                "name the directory that holds the artifacts");
  }
  std::vector<std::filesystem::path> entries;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const auto name = e.path().filename().string();
    // Hidden names are staging directories and kept dump logs' neighbours, never artifacts.
    if (name.empty() || name[0] == '.' || !e.is_directory(ec)) continue;
    entries.push_back(e.path());
  }
  if (ec) throw sys_error("list " + dir.string(), ec.value());
  std::sort(entries.begin(), entries.end());
  json list = json::array();
  for (const auto& path : entries) {
    json item{{"name", path.filename().string()}, {"artifact", path.string()}};
    try {
      const auto a = Artifact::open(path);
      const Manifest& m = a.manifest();
      item["id"] = m.id;
      item["created"] = m.created;
      item["source_pid"] = m.source_pid;
      item["source_cmdline"] = m.source_cmdline;
      item["processes"] = m.processes.size();
      item["bytes"] = m.total_bytes();
      item["gpu"] = m.gpu.has_value();
      item["handshake"] = !m.control_dir.empty();
    } catch (const Error& e) {
      item["error"] = e.what();
    }
    list.push_back(std::move(item));
  }
  return {{"directory", dir.string()}, {"snapshots", list}};
}

}  // namespace gpusnap::engine
