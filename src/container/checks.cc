#include "container/checks.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include <xxhash.h>

#include "artifact/xxh3.h"
#include "common/fd.h"
#include "common/fs.h"
#include "container/build_id.h"
#include "gpusnap/error.h"

namespace gpusnap::container {

namespace {

std::string ns_link(pid_t pid, const char* ns) {
  std::error_code ec;
  auto target = std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/ns/" + ns, ec);
  return ec ? std::string() : target.string();
}

struct FileIdentity {
  uint64_t size = 0;
  std::string xxh3;      // of the whole content: a file that is not an ELF with a build-id
  std::string build_id;  // an ELF's GNU build-id (container/build_id.h)
};

// A container's root directory, as process `pid` sees it, for identify().
common::UniqueFd open_root(pid_t pid) {
  const auto path = "/proc/" + std::to_string(pid) + "/root";
  common::UniqueFd fd(::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!fd) throw sys_error("open " + path, errno);
  return fd;
}

// Size and identity of the file at `path` in the container's root `root`, or nullopt when it
// cannot be read. The path is resolved inside that root, its symbolic links and ".." included
// (RESOLVE_IN_ROOT): a path from a manifest never reaches a file of the host.
std::optional<FileIdentity> identify(int root, const std::string& path) {
  open_how how{};
  how.flags = O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
  how.resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
  common::UniqueFd fd(
      static_cast<int>(::syscall(SYS_openat2, root, path.c_str(), &how, sizeof how)));
  struct stat st {};
  if (!fd || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  FileIdentity id{static_cast<uint64_t>(st.st_size), "", ""};
  if (auto build_id = gnu_build_id(fd.get())) {
    id.build_id = *build_id;
    return id;
  }
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 XXH3_freeState);
  XXH3_64bits_reset(state.get());
  std::vector<char> buf(1 << 20);
  for (ssize_t n; (n = ::read(fd.get(), buf.data(), buf.size())) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::nullopt;
    }
    artifact::xxh3_64_update(state.get(), buf.data(), static_cast<size_t>(n));
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits_digest(state.get())));
  id.xxh3 = hex;
  return id;
}

// The files a process maps (its executable, its libraries), as paths in its root.
std::set<std::string> mapped_files(pid_t pid) {
  std::set<std::string> files;
  std::string maps;
  if (!fs::try_read_file("/proc/" + std::to_string(pid) + "/maps", &maps)) return files;
  size_t start = 0;
  while (start < maps.size()) {
    size_t end = std::min(maps.find('\n', start), maps.size());
    std::string line = maps.substr(start, end - start);
    start = end + 1;
    auto slash = line.find(" /");
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash + 1);
    if (path.size() > 10 && path.compare(path.size() - 10, 10, " (deleted)") == 0) continue;
    files.insert(path);
  }
  return files;
}

pid_t ns_pid_of(pid_t host_pid) {
  try {
    return proc::innermost_pid(proc::read_process(host_pid));
  } catch (const Error&) {
    return 0;
  }
}

}  // namespace

Role role_of(pid_t pid) {
  std::vector<std::string> argv;
  try {
    argv = proc::read_process(pid).cmdline;
  } catch (const Error&) {
    return Role::kOther;
  }
  if (argv.size() < 2 || std::filesystem::path(argv[0]).filename() != "gpusnap" ||
      argv[1] != "init") {
    return Role::kOther;
  }
  for (const auto& a : argv) {
    if (a == "--") break;
    if (a == "--placeholder") return Role::kPlaceholder;
  }
  return Role::kShim;
}

void refuse_unusable(pid_t pid, const std::string& status, const std::string& what) {
  if (status != "running" || pid <= 0) {
    throw Error(ErrorKind::kNotFound, what + " is " + status + ", not running",
                "start it, or name a running container");
  }
  if (ns_link(pid, "user") != ns_link(::getpid(), "user")) {
    throw Error(ErrorKind::kNotCapturable,
                what + " runs in its own user namespace, which gpusnap does not enter",
                "run the container without a user namespace");
  }
  // CRIU runs inside the container and probes the kernel with a scratch directory in /tmp.
  auto tmp = "/proc/" + std::to_string(pid) + "/root/tmp";
  if (::access(tmp.c_str(), W_OK) != 0) {
    throw Error(ErrorKind::kNotCapturable,
                what + " has no writable /tmp, which CRIU needs inside it",
                "give the container a writable /tmp (e.g. a tmpfs or an emptyDir volume)");
  }
}

std::vector<RootfsFileRecord> identify_mapped_files(pid_t root_pid,
                                                    const std::vector<proc::Process>& tree) {
  std::set<std::string> paths;
  for (const auto& p : tree) paths.merge(mapped_files(p.pid));
  std::vector<RootfsFileRecord> files;
  const auto root = open_root(root_pid);
  for (const auto& path : paths) {
    auto id = identify(root.get(), path);
    if (!id) continue;  // gone since: CRIU decides what that means
    files.push_back({path, id->size, id->xxh3, id->build_id});
  }
  return files;
}

void refuse_other_rootfs(pid_t pid, const std::vector<RootfsFileRecord>& files,
                         const std::string& what, const std::string& captured_id) {
  const auto root = open_root(pid);
  for (const auto& f : files) {
    auto id = identify(root.get(), f.path);
    std::string problem;
    if (!id) {
      problem = "has no " + f.path;
    } else if (id->size != f.size) {
      problem = "has another " + f.path + " (" + std::to_string(id->size) + " bytes, captured " +
                std::to_string(f.size) + ")";
    } else if (!f.build_id.empty() ? id->build_id != f.build_id : id->xxh3 != f.xxh3) {
      problem = "has another " + f.path + " (same size, other " +
                (!f.build_id.empty() ? "build-id" : "content") + ")";
    }
    if (!problem.empty()) {
      throw Error(ErrorKind::kIncompatible,
                  what + "'s root filesystem differs from the captured container's: it " + problem,
                  "start the placeholder from the same image as the captured container (" +
                      captured_id + ")");
    }
  }
}

void use_namespace_pids(Manifest& manifest) {
  std::map<pid_t, pid_t> ns;
  auto translate = [&](pid_t host) {
    auto it = ns.find(host);
    if (it == ns.end()) it = ns.emplace(host, ns_pid_of(host)).first;
    return it->second;
  };
  for (auto& p : manifest.processes) {
    p.pid = translate(p.pid);
    p.ppid = translate(p.ppid);
  }
  if (manifest.gpu) {
    for (auto& p : manifest.gpu->processes) p.pid = translate(p.pid);
  }
  for (auto& image : manifest.host_images) image.pid = translate(image.pid);
  manifest.source_pid = translate(manifest.source_pid);
}

}  // namespace gpusnap::container
