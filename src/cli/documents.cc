#include "cli/documents.h"

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "common/fs.h"
#include "common/proc.h"
#include "gpusnap/error.h"

namespace gpusnap::cli {

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
          {"container",
           r.manifest.container.is_null() ? json(nullptr) : r.manifest.container.at("id")}};
}

void print_checkpoint_human(const json& doc) {
  std::printf("checkpoint %s: %zu process(es), %s, %.2f s; source %s%s\n",
              doc.at("artifact").get<std::string>().c_str(), doc.at("processes").get<size_t>(),
              fs::human_bytes(doc.at("bytes").get<uint64_t>()).c_str(),
              doc.at("seconds").get<double>(),
              doc.at("source_left_running").get<bool>() ? "left running" : "stopped",
              doc.at("handshake").get<bool>() ? " (paused through the handshake)" : "");
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

void print_restore_human(const json& doc, bool quiet) {
  for (const auto& c : doc.at("copies")) {
    std::printf("copy %d: pid %d (pid %d in its namespace)", c.at("index").get<int>(),
                c.at("pid").get<pid_t>(), c.at("ns_pid").get<pid_t>());
    for (const auto& p : c.at("ports")) {
      std::printf(", %s:%u -> port %u", p.at("host_address").get<std::string>().c_str(),
                  p.at("host_port").get<unsigned>(), p.at("port").get<unsigned>());
    }
    std::printf(", logs %s\n", c.at("dir").get<std::string>().c_str());
  }
  if (!quiet) {
    std::printf("restored %zu copy(ies) in %.2f s%s\n", doc.at("copies").size(),
                doc.at("seconds").get<double>(),
                doc.at("handshake").get<bool>() ? ", each resumed and ready to serve" : "");
  }
}

json inspect_document(const Artifact& a) {
  json doc = a.manifest().to_json();
  doc["artifact"] = a.root().string();
  doc["total_bytes"] = a.manifest().total_bytes();
  return doc;
}

void print_inspect_human(const json& doc) {
  // The document is the manifest plus two fields: read it back as one, so that the fields'
  // meaning has a single definition (Manifest::from_json).
  const Manifest m = Manifest::from_json(doc);
  const std::string root = doc.at("artifact").get<std::string>();
  std::printf("artifact   %s\n", root.c_str());
  std::printf("id         %s\n", m.id.c_str());
  std::printf("created    %s by gpusnap %s\n", m.created.c_str(), m.gpusnap_version.c_str());
  std::printf("source     pid %d: %s\n", m.source_pid,
              proc::join_cmdline(m.source_cmdline).c_str());
  std::printf("host       %s, %s, kernel %s, CRIU %s\n", m.host.hostname.c_str(),
              m.host.arch.c_str(), m.host.kernel.c_str(), m.host.criu_version.c_str());
  std::printf("cpu        %s (%zu flags)\n", m.host.cpu_model.c_str(), m.host.cpu_flags.size());
  std::printf("size       %s in %zu files (%s checksums, %s chunks)\n",
              fs::human_bytes(m.total_bytes()).c_str(), m.files.size(),
              m.checksum_algorithm.c_str(), fs::human_bytes(m.chunk_bytes).c_str());
  std::printf("terminal   %s\n", m.shell_job ? "yes (shell job)" : "no");
  std::printf("processes  %zu\n", m.processes.size());
  std::printf("  %7s %7s %7s %10s %10s  %s\n", "PID", "PPID", "THREADS", "RSS", "GPU", "COMMAND");
  for (const auto& p : m.processes) {
    std::printf("  %7d %7d %7d %10s %10s  %s\n", p.pid, p.ppid, p.threads,
                fs::human_bytes(p.rss_bytes).c_str(),
                p.gpu_bytes ? fs::human_bytes(p.gpu_bytes).c_str() : "-",
                proc::join_cmdline(p.cmdline).c_str());
  }
  if (m.gpu.is_null()) {
    std::printf("gpu        none\n");
  } else {
    std::printf("gpu        NVIDIA driver %s, CUDA %d\n",
                m.gpu.at("driver_version").get<std::string>().c_str(),
                m.gpu.at("cuda_driver_version").get<int>());
    for (const auto& g : m.gpu.at("gpus")) {
      std::printf("  GPU %d  %s  %s  cc %s  %s  bus %s\n", g.at("index").get<int>(),
                  g.at("uuid").get<std::string>().c_str(), g.at("name").get<std::string>().c_str(),
                  g.at("compute_capability").get<std::string>().c_str(),
                  fs::human_bytes(g.at("memory_total").get<uint64_t>()).c_str(),
                  g.at("bus_id").get<std::string>().c_str());
    }
    // CUDA processes in tree order: for a tensor-parallel workload, its ranks.
    int rank = 0;
    for (const auto& p : m.gpu.at("processes")) {
      std::string where;
      for (const auto& u : p.at("gpus")) {
        std::string index = "?";
        for (const auto& g : m.gpu.at("gpus")) {
          if (g.at("uuid") == u.at("uuid")) index = std::to_string(g.at("index").get<int>());
        }
        where += (where.empty() ? "" : ", ") + fs::human_bytes(u.at("bytes").get<uint64_t>()) +
                 " on GPU " + index;
      }
      std::printf("  CUDA process %d (pid %d): %s\n", rank++, p.at("pid").get<pid_t>(),
                  where.empty() ? "no per-GPU usage reported" : where.c_str());
    }
  }
  std::printf("checkpoint");
  for (const auto& p : m.checkpoint_phases) std::printf(" %s %.3fs", p.name.c_str(), p.seconds);
  std::printf("\n");
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
      item["gpu"] = !m.gpu.is_null();
      item["handshake"] = !m.control_dir.empty();
    } catch (const Error& e) {
      item["error"] = e.what();
    }
    list.push_back(std::move(item));
  }
  return {{"directory", dir.string()}, {"snapshots", list}};
}

void print_list_human(const json& doc) {
  const auto& list = doc.at("snapshots");
  if (list.empty()) {
    std::printf("no snapshots in %s\n", doc.at("directory").get<std::string>().c_str());
    return;
  }
  std::printf("%-24s %-20s %10s %9s %-3s  %s\n", "NAME", "CREATED", "SIZE", "PROCESSES", "GPU",
              "COMMAND");
  for (const auto& s : list) {
    const auto name = s.at("name").get<std::string>();
    if (s.contains("error")) {
      std::printf("%-24s unreadable: %s\n", name.c_str(), s.at("error").get<std::string>().c_str());
      continue;
    }
    std::printf("%-24s %-20s %10s %9zu %-3s  %s\n", name.c_str(),
                s.at("created").get<std::string>().c_str(),
                fs::human_bytes(s.at("bytes").get<uint64_t>()).c_str(),
                s.at("processes").get<size_t>(), s.at("gpu").get<bool>() ? "yes" : "no",
                proc::join_cmdline(s.at("source_cmdline").get<std::vector<std::string>>()).c_str());
  }
}

}  // namespace gpusnap::cli
