#include "cli/documents.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "common/fs.h"
#include "common/proc.h"
#include "common/terminal.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"

namespace gpusnap::cli {

using nlohmann::json;

void print_checkpoint_human(const json& doc) {
  std::printf("checkpoint %s: %zu process(es), %s, %.2f s; source %s%s\n",
              doc.at("artifact").get<std::string>().c_str(), doc.at("processes").get<size_t>(),
              fs::human_bytes(doc.at("bytes").get<uint64_t>()).c_str(),
              doc.at("seconds").get<double>(),
              doc.at("source_left_running").get<bool>() ? "left running" : "stopped",
              doc.at("handshake").get<bool>() ? " (paused through the handshake)" : "");
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

namespace {

// A FILE* that writes into memory (open_memstream), for output that is escaped before it is
// shown.
class MemoryOutput {
 public:
  MemoryOutput() : file_(::open_memstream(&buf_, &len_)) {
    if (file_ == nullptr) throw sys_error("open_memstream", errno);
  }
  ~MemoryOutput() {
    if (file_ != nullptr) std::fclose(file_);
    std::free(buf_);  // NOLINT(cppcoreguidelines-no-malloc): open_memstream's buffer
  }
  MemoryOutput(const MemoryOutput&) = delete;
  MemoryOutput& operator=(const MemoryOutput&) = delete;
  FILE* file() { return file_; }
  std::string text() {
    std::fflush(file_);
    return {buf_, len_};
  }

 private:
  char* buf_ = nullptr;
  size_t len_ = 0;
  FILE* file_;
};

}  // namespace

void print_inspect_human(const json& doc) {
  // Every text below may come from a registry (inspect oci://): written to memory first, then
  // to the terminal with its control characters escaped.
  MemoryOutput out;
  // The document is the manifest plus two fields: read it back as one, so that the fields'
  // meaning has a single definition (Manifest::from_json).
  const Manifest m = Manifest::from_json(doc);
  const std::string root = doc.at("artifact").get<std::string>();
  std::fprintf(out.file(), "artifact   %s\n", root.c_str());
  std::fprintf(out.file(), "id         %s\n", m.id.c_str());
  std::fprintf(out.file(), "created    %s by gpusnap %s\n", m.created.c_str(),
               m.gpusnap_version.c_str());
  std::fprintf(out.file(), "source     pid %d: %s\n", m.source_pid,
               proc::join_cmdline(m.source_cmdline).c_str());
  std::fprintf(out.file(), "host       %s, %s, kernel %s, CRIU %s\n", m.host.hostname.c_str(),
               m.host.arch.c_str(), m.host.kernel.c_str(), m.host.criu_version.c_str());
  std::fprintf(out.file(), "cpu        %s (%zu flags)\n", m.host.cpu_model.c_str(),
               m.host.cpu_flags.size());
  std::fprintf(out.file(), "size       %s in %zu files (%s checksums, %s chunks)\n",
               fs::human_bytes(m.total_bytes()).c_str(), m.files.size(),
               m.checksum_algorithm.c_str(), fs::human_bytes(m.chunk_bytes).c_str());
  std::fprintf(out.file(), "terminal   %s\n", m.shell_job ? "yes (shell job)" : "no");
  std::fprintf(out.file(), "processes  %zu\n", m.processes.size());
  std::fprintf(out.file(), "  %7s %7s %7s %10s %10s  %s\n", "PID", "PPID", "THREADS", "RSS", "GPU",
               "COMMAND");
  for (const auto& p : m.processes) {
    std::fprintf(out.file(), "  %7d %7d %7d %10s %10s  %s\n", p.pid, p.ppid, p.threads,
                 fs::human_bytes(p.rss_bytes).c_str(),
                 p.gpu_bytes ? fs::human_bytes(p.gpu_bytes).c_str() : "-",
                 proc::join_cmdline(p.cmdline).c_str());
  }
  if (!m.gpu) {
    std::fprintf(out.file(), "gpu        none\n");
  } else {
    std::fprintf(out.file(), "gpu        NVIDIA driver %s, CUDA %d\n",
                 m.gpu->driver_version.c_str(), m.gpu->cuda_driver_version);
    for (const auto& g : m.gpu->gpus) {
      std::fprintf(out.file(), "  GPU %d  %s  %s  cc %s  %s  bus %s\n", g.index, g.uuid.c_str(),
                   g.name.c_str(), g.compute_capability.c_str(),
                   fs::human_bytes(g.memory_total).c_str(), g.bus_id.c_str());
    }
    // CUDA processes in tree order: for a tensor-parallel workload, its ranks.
    int rank = 0;
    for (const auto& p : m.gpu->processes) {
      std::string where;
      for (const auto& u : p.gpus) {
        std::string index = "?";
        for (const auto& g : m.gpu->gpus) {
          if (g.uuid == u.uuid) index = std::to_string(g.index);
        }
        where += (where.empty() ? "" : ", ") + fs::human_bytes(u.bytes) + " on GPU " + index;
      }
      std::fprintf(out.file(), "  CUDA process %d (pid %d): %s\n", rank++, p.pid,
                   where.empty() ? "no per-GPU usage reported" : where.c_str());
    }
  }
  std::fprintf(out.file(), "checkpoint");
  for (const auto& p : m.checkpoint_phases)
    std::fprintf(out.file(), " %s %.3fs", p.name.c_str(), p.seconds);
  std::fprintf(out.file(), "\n");
  const std::string text = out.text();
  std::fputs(common::terminal_safe(text).c_str(), stdout);
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
