#include "container/runc.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>

#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "artifact/xxh3.h"
#include "common/fd.h"
#include "common/fs.h"
#include "common/subprocess.h"
#include "container/build_id.h"
#include "container/runtime_root.h"
#include "gpusnap/error.h"

namespace gpusnap::container {

namespace {

using nlohmann::json;

std::string find_runc() {
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/sbin:/usr/bin:/sbin:/bin";
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = std::min(dirs.find(':', start), dirs.size());
    std::string candidate = dirs.substr(start, end - start) + "/runc";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  throw Error(ErrorKind::kEnvironment, "runc was not found on PATH",
              "install runc (Debian: apt-get install runc), the runtime of the container");
}

std::string describe_ref(const ContainerRef& ref) {
  return "container " + ref.id + " (runc root " + ref.runtime_root.string() + ")";
}
std::string describe_ref(const State& state) {
  return describe_ref(ContainerRef{state.id, state.runtime_root});
}

// gpusnap's role as a container's PID 1, from its command line: `gpusnap init [--placeholder]`.
enum class Role { kOther, kShim, kPlaceholder };
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

std::string ns_link(pid_t pid, const char* ns) {
  std::error_code ec;
  auto target = std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/ns/" + ns, ec);
  return ec ? std::string() : target.string();
}

// The checks a capture and a restore share: running, our user namespace, a writable /tmp.
void refuse_unusable(const State& state) {
  if (state.status != "running" || state.pid <= 0) {
    throw Error(ErrorKind::kNotFound, describe_ref(state) + " is " + state.status + ", not running",
                "start it, or name a running container");
  }
  if (ns_link(state.pid, "user") != ns_link(::getpid(), "user")) {
    throw Error(
        ErrorKind::kNotCapturable,
        describe_ref(state) + " runs in its own user namespace, which gpusnap does not enter",
        "run the container without a user namespace");
  }
  // CRIU runs inside the container and probes the kernel with a scratch directory in /tmp.
  auto tmp = "/proc/" + std::to_string(state.pid) + "/root/tmp";
  if (::access(tmp.c_str(), W_OK) != 0) {
    throw Error(ErrorKind::kNotCapturable,
                describe_ref(state) + " has no writable /tmp, which CRIU needs inside it",
                "give the container a writable /tmp (e.g. a tmpfs or an emptyDir volume)");
  }
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

State read_state(const ContainerRef& given) {
  if (given.id.empty()) throw Error(ErrorKind::kUsage, "no container id given");
  ContainerRef ref = given;
  if (ref.runtime_root.empty()) ref.runtime_root = find_runtime_root(ref.id);
  auto runc = find_runc();
  auto r = common::run_capture({runc, "--root", ref.runtime_root.string(), "state", ref.id},
                               std::chrono::seconds(30));
  if (!r.status.ok()) {
    if (r.output.find("does not exist") != std::string::npos ||
        r.output.find("no such file") != std::string::npos) {
      throw Error(ErrorKind::kNotFound, describe_ref(ref) + " does not exist",
                  "check the id with `runc --root " + ref.runtime_root.string() +
                      " list`, or pass the runtime's state directory with --runtime-root");
    }
    auto line = r.output.substr(0, r.output.find('\n'));
    throw Error(ErrorKind::kEnvironment, "runc state " + ref.id + " failed: " + line,
                "check that runc works and that --runtime-root is runc's state directory");
  }
  try {
    auto doc = json::parse(r.output);
    State s;
    s.id = doc.at("id").get<std::string>();
    s.status = doc.at("status").get<std::string>();
    s.pid = doc.at("pid").get<pid_t>();
    s.bundle = doc.at("bundle").get<std::string>();
    s.rootfs = doc.at("rootfs").get<std::string>();
    s.runtime_root = ref.runtime_root;
    return s;
  } catch (const json::exception& e) {
    throw Error(ErrorKind::kEnvironment, "cannot read runc's state of " + ref.id + ": " + e.what(),
                "use runc 1.x, whose `state` prints JSON");
  }
}

namespace {

// The container's state, refused as unusable or when, running, its PID 1 is not `role` (named
// `what` in the error, of `kind`, with `hint`).
State state_run_by(const ContainerRef& ref, Role role, ErrorKind kind, const std::string& what,
                   const std::string& hint) {
  State state = read_state(ref);
  if (state.status == "running" && role_of(state.pid) != role) {
    throw Error(
        kind,
        describe_ref(state) + ": its PID 1 (pid " + std::to_string(state.pid) + ") is not " + what,
        hint);
  }
  refuse_unusable(state);
  return state;
}

}  // namespace

CaptureTarget capture_target(const ContainerRef& ref) {
  CaptureTarget t;
  t.state = state_run_by(ref, Role::kShim, ErrorKind::kNotCapturable, "the gpusnap shim",
                         "start the container's process as `gpusnap init -- CMD ARGS...`");
  auto children = proc::children(t.state.pid);
  if (children.size() != 1) {
    throw Error(ErrorKind::kNotCapturable,
                describe_ref(t.state) + ": the shim has " + std::to_string(children.size()) +
                    " children; the capture takes exactly one tree, the command it started",
                children.empty() ? "wait until the container's command runs"
                                 : "keep the workload in one process tree (no daemonized "
                                   "processes left to PID 1)");
  }
  t.root = children.front();
  return t;
}

ContainerRecord describe(const CaptureTarget& target, const std::vector<proc::Process>& tree) {
  std::set<std::string> paths;
  for (const auto& p : tree) paths.merge(mapped_files(p.pid));
  ContainerRecord rec{"runc",
                      target.state.id,
                      target.state.bundle.string(),
                      target.state.rootfs.string(),
                      {},
                      target.state.runtime_root.string()};
  const auto root = open_root(target.root);
  for (const auto& path : paths) {
    auto id = identify(root.get(), path);
    if (!id) continue;  // gone since: CRIU decides what that means
    rec.rootfs_files.push_back({path, id->size, id->xxh3, id->build_id});
  }
  return rec;
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

Placeholder placeholder_target(const ContainerRef& ref, const Manifest& manifest) {
  if (!manifest.container) {
    throw Error(ErrorKind::kUsage, "artifact " + manifest.id + " was not captured from a container",
                "restore it without --into-container, or capture the workload with "
                "`gpusnap checkpoint --container ID`");
  }
  Placeholder p;
  p.state = state_run_by(ref, Role::kPlaceholder, ErrorKind::kUsage, "a gpusnap placeholder",
                         "start the target container with `gpusnap init --placeholder` as its "
                         "process");
  if (!proc::children(p.state.pid).empty()) {
    throw Error(ErrorKind::kUsage,
                describe_ref(p.state) + ": the placeholder is not waiting, it already runs a "
                                        "restored workload",
                "start a new placeholder container for this restore");
  }
  const auto root = open_root(p.state.pid);
  for (const auto& f : manifest.container->rootfs_files) {
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
                  describe_ref(p.state) +
                      "'s root filesystem differs from the captured container's: it " + problem,
                  "start the placeholder from the same image as the captured container (" +
                      manifest.container->id + ")");
    }
  }
  return p;
}

}  // namespace gpusnap::container
