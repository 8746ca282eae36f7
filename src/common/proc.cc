#include "common/proc.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "common/fs.h"
#include "gpusnap/error.h"

namespace gpusnap::proc {

namespace {

std::string proc_path(pid_t pid, const char* leaf) {
  return "/proc/" + std::to_string(pid) + "/" + leaf;
}

std::string status_field(const std::string& status, const std::string& key) {
  std::istringstream in(status);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size() + 1, key + ":") == 0) {
      auto value = line.substr(key.size() + 1);
      auto start = value.find_first_not_of(" \t");
      return start == std::string::npos ? "" : value.substr(start);
    }
  }
  return {};
}

std::vector<OpenFile> read_files(pid_t pid) {
  std::vector<OpenFile> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(proc_path(pid, "fd"), ec)) {
    char target[PATH_MAX];
    ssize_t n = ::readlink(entry.path().c_str(), target, sizeof target - 1);
    if (n < 0) continue;  // closed while we looked
    target[n] = '\0';
    files.push_back({std::stoi(entry.path().filename().string()), target});
  }
  std::sort(files.begin(), files.end(),
            [](const OpenFile& a, const OpenFile& b) { return a.fd < b.fd; });
  return files;
}

}  // namespace

bool exists(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

Process read_process(pid_t pid) {
  Process p;
  p.pid = pid;
  std::string status;
  if (pid <= 0 || !fs::try_read_file(proc_path(pid, "status"), &status)) {
    throw Error(ErrorKind::kNotFound, "no process with pid " + std::to_string(pid),
                "check the pid with `ps -p " + std::to_string(pid) + "`");
  }
  p.comm = status_field(status, "Name");
  p.ppid = std::stoi("0" + status_field(status, "PPid"));
  p.threads = std::stoi("0" + status_field(status, "Threads"));
  auto rss = status_field(status, "VmRSS");  // "1234 kB"; absent for zombies and kernel threads
  if (!rss.empty()) p.rss_bytes = std::stoull(rss) * 1024;
  auto state = status_field(status, "State");
  if (!state.empty()) p.state = state[0];
  std::istringstream nspid(status_field(status, "NSpid"));
  for (pid_t v; nspid >> v;) p.nspid.push_back(v);

  std::string cmdline;
  if (fs::try_read_file(proc_path(pid, "cmdline"), &cmdline)) {
    std::string arg;
    for (char c : cmdline) {
      if (c == '\0') {
        p.cmdline.push_back(arg);
        arg.clear();
      } else {
        arg += c;
      }
    }
    if (!arg.empty()) p.cmdline.push_back(arg);
  }
  p.files = read_files(pid);
  return p;
}

std::vector<pid_t> children(pid_t pid) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(proc_path(pid, "task"), ec)) {
    std::string text;
    if (!fs::try_read_file(task.path() / "children", &text)) continue;
    std::istringstream in(text);
    for (pid_t child; in >> child;) out.push_back(child);
  }
  return out;
}

std::set<std::string> pipes_within(const std::vector<Process>& tree) {
  std::set<std::string> readers, writers, both;
  for (const auto& p : tree) {
    for (const auto& f : p.files) {
      if (f.target.rfind("pipe:[", 0) != 0) continue;
      // Both ends show the same inode; the descriptor's access mode tells them apart
      // ("flags:" in fdinfo, octal; O_WRONLY is 01).
      std::string info;
      if (!fs::try_read_file("/proc/" + std::to_string(p.pid) + "/fdinfo/" + std::to_string(f.fd),
                             &info)) {
        continue;
      }
      auto at = info.find("flags:");
      if (at == std::string::npos) continue;
      long flags = std::strtol(info.c_str() + at + 6, nullptr, 8);
      ((flags & O_ACCMODE) == O_RDONLY ? readers : writers).insert(f.target);
    }
  }
  for (const auto& pipe : readers) {
    if (writers.count(pipe)) both.insert(pipe);
  }
  return both;
}

std::vector<Process> read_tree(pid_t root) {
  std::vector<Process> tree{read_process(root)};
  for (size_t i = 0; i < tree.size(); ++i) {
    for (pid_t child : children(tree[i].pid)) {
      try {
        tree.push_back(read_process(child));
      } catch (const Error&) {
        // exited between the two reads: it is no longer part of the tree
      }
    }
  }
  return tree;
}

pid_t innermost_pid(const Process& process) {
  return process.nspid.empty() ? process.pid : process.nspid.back();
}

std::optional<std::string> environment_value(pid_t pid, std::string_view name) {
  std::string environ;
  if (!fs::try_read_file("/proc/" + std::to_string(pid) + "/environ", &environ)) return {};
  // NAME=VALUE entries, each ended by a NUL.
  for (size_t start = 0; start < environ.size();) {
    size_t end = environ.find('\0', start);
    if (end == std::string::npos) end = environ.size();
    const std::string_view entry(environ.data() + start, end - start);
    if (entry.size() > name.size() && entry.starts_with(name) && entry[name.size()] == '=') {
      return std::string(entry.substr(name.size() + 1));
    }
    start = end + 1;
  }
  return {};
}

pid_t host_pid_in_namespace(pid_t ns_init, pid_t ns_pid) {
  std::vector<pid_t> queue{ns_init};
  for (size_t i = 0; i < queue.size(); ++i) {
    for (pid_t child : children(queue[i])) {
      try {
        if (innermost_pid(read_process(child)) == ns_pid) return child;
      } catch (const Error&) {
        continue;
      }
      queue.push_back(child);
    }
  }
  return 0;
}

std::string join_cmdline(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& arg : argv) {
    if (!out.empty()) out += ' ';
    out += arg;
  }
  return out;
}

}  // namespace gpusnap::proc
