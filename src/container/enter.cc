#include "container/enter.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "gpusnap/error.h"

namespace gpusnap::container {

namespace {

// clone3's argument block up to set_tid (Linux 5.5). Spelled out here: <linux/sched.h>
// clashes with glibc's <sched.h>.
struct CloneArgs {
  uint64_t flags = 0;
  uint64_t pidfd = 0;
  uint64_t child_tid = 0;
  uint64_t parent_tid = 0;
  uint64_t exit_signal = SIGCHLD;
  uint64_t stack = 0;
  uint64_t stack_size = 0;
  uint64_t tls = 0;
  uint64_t set_tid = 0;
  uint64_t set_tid_size = 0;
  uint64_t cgroup = 0;
};

struct Namespace {
  const char* name;
  int flag;
};
// Joined by this process before the fork (the PID namespace applies to the child) ...
constexpr Namespace kBeforeFork[] = {
    {"ipc", CLONE_NEWIPC}, {"uts", CLONE_NEWUTS}, {"net", CLONE_NEWNET}, {"pid", CLONE_NEWPID}};
// ... and by the child: the cgroup namespace after it has moved into the container's cgroups
// (from inside that namespace the move is refused), the mount namespace last (it hides the
// host's cgroup filesystem).
constexpr Namespace kAfterFork[] = {{"cgroup", CLONE_NEWCGROUP}, {"mnt", CLONE_NEWNS}};

common::UniqueFd open_namespace(pid_t pid, const char* name) {
  auto path = "/proc/" + std::to_string(pid) + "/ns/" + name;
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw sys_error("open " + path, errno);
  return fd;
}

// cgroup.procs files of the target's cgroups, one per hierarchy mounted on the host.
std::vector<std::string> cgroup_procs_files(pid_t pid) {
  struct Mount {
    std::string point, fstype, options;
  };
  std::vector<Mount> mounts;
  std::ifstream mountinfo("/proc/self/mountinfo");
  for (std::string line; std::getline(mountinfo, line);) {
    std::istringstream in(line);
    std::string id, parent, dev, root, point, opts, field;
    in >> id >> parent >> dev >> root >> point >> opts;
    while (in >> field && field != "-") {
    }
    Mount m;
    std::string source;
    in >> m.fstype >> source >> m.options;
    m.point = point;
    if (root == "/" && (m.fstype == "cgroup" || m.fstype == "cgroup2")) mounts.push_back(m);
  }
  std::vector<std::string> files;
  std::ifstream cgroups("/proc/" + std::to_string(pid) + "/cgroup");
  for (std::string line; std::getline(cgroups, line);) {
    auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    std::string hierarchy = line.substr(0, first);
    std::string controllers = line.substr(first + 1, second - first - 1);
    std::string path = line.substr(second + 1);
    for (const auto& m : mounts) {
      bool match = hierarchy == "0" ? m.fstype == "cgroup2" : m.fstype == "cgroup";
      if (match && hierarchy != "0") {
        std::string options = "," + m.options + ",";
        std::istringstream each(controllers);
        for (std::string c; std::getline(each, c, ',');) {
          match &= options.find("," + c + ",") != std::string::npos;
        }
      }
      if (match) {
        files.push_back(m.point + path + "/cgroup.procs");
        break;
      }
    }
  }
  return files;
}

[[noreturn]] void child_fail(int report_fd, const std::string& what) {
  std::string line = what + ": " + ::strerrordesc_np(errno);
  (void)::write(report_fd, line.data(), line.size());
  ::_exit(127);
}

}  // namespace

std::string host_path(const std::filesystem::path& path) {
  return "/proc/self/fd/" + std::to_string(kHostRootFd) +
         std::filesystem::absolute(path).lexically_normal().string();
}

std::vector<std::string> criu_command(const criu::Binary& criu) {
  std::error_code ec;
  auto prefix = std::filesystem::canonical(criu.path, ec).parent_path();
  auto lib = prefix / "usr/lib/x86_64-linux-gnu";
  auto loader = lib / "ld-linux-x86-64.so.2";
  auto program = prefix / "usr/sbin/criu";
  if (ec || !std::filesystem::exists(loader) || !std::filesystem::exists(program)) {
    throw Error(ErrorKind::kEnvironment,
                "CRIU at " + criu.path +
                    " is not a private prefix with its own loader, which a container capture "
                    "needs (CRIU runs inside the container's mount namespace)",
                "run scripts/install-criu and use /opt/gpusnap/criu/criu");
  }
  return {host_path(loader), "--inhibit-cache", "--library-path",
          host_path(lib) + ":" + host_path(prefix / "lib/x86_64-linux-gnu"), host_path(program)};
}

std::vector<std::string> criu_argv_inside(const criu::Binary& criu,
                                          const std::vector<std::string>& args) {
  auto argv = criu_command(criu);
  argv.insert(argv.end(), args.begin() + 1, args.end());
  return argv;
}

pid_t criu_pid_inside() {
  std::string text;
  long pid_max = 0;
  if (fs::try_read_file("/proc/sys/kernel/pid_max", &text))
    pid_max = std::strtol(text.c_str(), nullptr, 10);
  return static_cast<pid_t>(pid_max > 1000 ? pid_max - 1 : 32767);
}

common::UniqueFd borrow_fd(pid_t pid, int fd) {
  common::UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!pidfd) throw sys_error("pidfd_open " + std::to_string(pid), errno);
  common::UniqueFd copy(static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), fd, 0)));
  if (!copy) {
    throw sys_error("take descriptor " + std::to_string(fd) + " of pid " + std::to_string(pid),
                    errno);
  }
  return copy;
}

common::ExitStatus run_inside(const EnterSpec& spec) {
  // Everything that can fail is opened and prepared before the fork.
  std::vector<std::pair<int, common::UniqueFd>> before, after;
  for (const auto& ns : kBeforeFork)
    before.emplace_back(ns.flag, open_namespace(spec.target, ns.name));
  for (const auto& ns : kAfterFork)
    after.emplace_back(ns.flag, open_namespace(spec.target, ns.name));
  std::vector<std::string> cgroups;
  if (spec.join_cgroups) cgroups = cgroup_procs_files(spec.target);
  common::UniqueFd root(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC));
  common::UniqueFd null_in(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  common::UniqueFd out(
      ::open(spec.output.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!root || !null_in || !out) throw sys_error("open the program's root and output", errno);
  common::Pipe report =
      common::Pipe::make();  // the child's reason if it fails before exec; EOF at exec
  std::vector<char*> argv;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const std::string last_pid = std::to_string(spec.last_pid);

  for (auto& [flag, fd] : before) {
    if (::setns(fd.get(), flag) != 0) {
      throw sys_error("join the namespaces of pid " + std::to_string(spec.target), errno);
    }
  }
  CloneArgs args;
  pid_t tid = spec.pid;
  if (tid != 0) {
    args.set_tid = reinterpret_cast<uint64_t>(&tid);
    args.set_tid_size = 1;
  }
  long child = ::syscall(SYS_clone3, &args, sizeof args);
  if (child < 0) {
    throw sys_error("start a process in the namespaces of pid " + std::to_string(spec.target) +
                        (tid != 0 ? " as pid " + std::to_string(tid) : std::string()),
                    errno);
  }
  if (child == 0) {
    int fail = report.write.get();
    for (const auto& file : cgroups) {
      int fd = ::open(file.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0 || ::write(fd, "0", 1) != 1) child_fail(fail, "join the cgroup " + file);
      ::close(fd);
    }
    for (auto& [flag, fd] : after) {
      if (::setns(fd.get(), flag) != 0) child_fail(fail, "join a namespace");
    }
    if (::dup2(null_in.get(), 0) < 0 || ::dup2(out.get(), 1) < 0 || ::dup2(out.get(), 2) < 0 ||
        ::dup2(root.get(), kHostRootFd) < 0 || ::fcntl(kHostRootFd, F_SETFD, 0) != 0) {
      // (dup2 onto itself would leave close-on-exec set: hence the explicit fcntl)
      child_fail(fail, "set up descriptors");
    }
    if (spec.last_pid > 0) {
      // ns_last_pid is the writer's own PID namespace's, whichever procfs it is reached through:
      // the host's (the container's /proc/sys is read-only). A host whose /proc/sys is read-only
      // too gets a line in the program's output and the program all the same: a tree with few
      // threads restores without it, and CRIU names the clash when one happens.
      int fd = ::openat(root.get(), "proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
      if (fd < 0 ||
          ::write(fd, last_pid.data(), last_pid.size()) != static_cast<ssize_t>(last_pid.size())) {
        const std::string line = "gpusnap: cannot set the PID namespace's last pid to " + last_pid +
                                 ": " + errno_text(errno) + "\n";
        (void)::write(2, line.data(), line.size());
      }
      if (fd >= 0) ::close(fd);
    }
    for (int fd : spec.inherit_fds) {
      int flags = ::fcntl(fd, F_GETFD);
      if (flags < 0 || ::fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC) != 0) {
        child_fail(fail, "pass descriptor " + std::to_string(fd));
      }
    }
    ::execv(argv[0], argv.data());
    child_fail(fail, "run " + spec.argv[0]);
  }
  report.write.reset();
  std::string why;
  char buf[256];
  for (ssize_t n; (n = ::read(report.read.get(), buf, sizeof buf)) != 0;) {
    if (n > 0) why.append(buf, static_cast<size_t>(n));
    if (n < 0 && errno != EINTR) break;
  }
  int raw = 0;
  while (::waitpid(static_cast<pid_t>(child), &raw, 0) < 0 && errno == EINTR) {
  }
  if (!why.empty()) {
    throw Error(ErrorKind::kInternal,
                "in the namespaces of pid " + std::to_string(spec.target) + ": " + why);
  }
  if (WIFEXITED(raw)) return {true, WEXITSTATUS(raw)};
  return {false, WTERMSIG(raw)};
}

std::string to_json(const EnterSpec& spec) {
  return nlohmann::json{
      {"target", spec.target},           {"argv", spec.argv}, {"output", spec.output.string()},
      {"inherit_fds", spec.inherit_fds}, {"pid", spec.pid},   {"join_cgroups", spec.join_cgroups},
      {"last_pid", spec.last_pid}}
      .dump();
}

int exec_main(const std::string& spec_json) {
  auto doc = nlohmann::json::parse(spec_json);
  EnterSpec spec;
  spec.target = doc.at("target").get<pid_t>();
  spec.argv = doc.at("argv").get<std::vector<std::string>>();
  spec.output = doc.at("output").get<std::string>();
  spec.inherit_fds = doc.at("inherit_fds").get<std::vector<int>>();
  spec.pid = doc.at("pid").get<pid_t>();
  spec.join_cgroups = doc.at("join_cgroups").get<bool>();
  spec.last_pid = doc.value("last_pid", 0);
  common::ExitStatus status = run_inside(spec);
  return status.exited ? status.code : 128 + status.code;
}

}  // namespace gpusnap::container
