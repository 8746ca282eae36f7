// Reading processes from /proc: the tree under a root, each process's identity, its open files.
// Everything here is read-only and tolerant of processes that exit while being read.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace gpusnap::proc {

struct OpenFile {
  int fd = -1;
  std::string target;  // readlink of /proc/PID/fd/N: a path, "pipe:[123]", "anon_inode:[io_uring]"
};

struct Process {
  pid_t pid = 0;
  pid_t ppid = 0;
  std::string comm;
  std::vector<std::string> cmdline;
  char state = '?';  // /proc/PID/stat state letter
  int threads = 0;
  uint64_t rss_bytes = 0;
  std::vector<pid_t> nspid;  // NSpid: this pid in every PID namespace, outermost first
  std::vector<OpenFile> files;
};

bool exists(pid_t pid);
// Reads one process; throws Error(kNotFound) when it does not exist.
Process read_process(pid_t pid);
// The process and all its descendants, root first, parents before children.
std::vector<Process> read_tree(pid_t root);
// The pipes ("pipe:[INODE]") whose read end and write end are both held by processes of
// `tree`: the tree talks to itself through them, so they belong to the snapshot as they are
// (a child's stdin or stdout piped to its parent), unlike a pipe to something outside.
std::set<std::string> pipes_within(const std::vector<Process>& tree);
// Direct children of pid (all threads' children files).
std::vector<pid_t> children(pid_t pid);
// The pid as the innermost PID namespace sees it (last NSpid entry).
pid_t innermost_pid(const Process& process);
// Translate a pid seen inside the namespace of `ns_init` (host pid of that namespace's init)
// into a host pid by looking at the init's descendants. Returns 0 when not found.
pid_t host_pid_in_namespace(pid_t ns_init, pid_t ns_pid);
// The value `name` has in the environment process `pid` started with (/proc/PID/environ: what
// it set later is not seen); nullopt when it has none or it cannot be read.
std::optional<std::string> environment_value(pid_t pid, std::string_view name);
// Joins a command line for display.
std::string join_cmdline(const std::vector<std::string>& argv);

}  // namespace gpusnap::proc
