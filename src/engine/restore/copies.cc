// The copies a restore makes (src/engine/restore/copies.h).
#include "engine/restore/copies.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "container/enter.h"
#include "container/runc.h"
#include "engine/copy_init.h"
#include "engine/handshake.h"
#include "engine/publish.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

constexpr int kControlFd = 3;
constexpr int kFirstInheritFd = 10;
constexpr int kFirstListenFd = 512;

}  // namespace

// One copy being restored. Owns the copy's init until release(); destroying an unreleased
// copy kills the init, which takes the whole namespace down with it. A copy restored into a
// placeholder container (`into`: its PID 1) outlives its init: destroying it unreleased closes
// the control socket, on which the init kills the restored tree, and waits for that.
class Copy {
 public:
  // Starts the copy's init, which runs CRIU's restore and reports on control(). Each step is
  // one of the copy's resources or one piece of the init's spec.
  Copy(int index, const Manifest& manifest, const std::filesystem::path& images,
       const criu::Binary& criu, const RestoreOptions& options, pid_t into = 0)
      : index_(index), into_(into) {
    info_.index = index;
    info_.dir = options.run_dir / "copies" /
                (manifest.id.substr(0, 8) + "-" + std::to_string(index) + "-" +
                 fs::random_id().substr(0, 6));
    std::filesystem::create_directories(info_.dir);
    // Its logs quote the workload's output and files: root-only, like the artifact.
    if (::chmod(info_.dir.c_str(), 0700) != 0) {
      throw sys_error("chmod " + info_.dir.string(), errno);
    }
    criu::RestoreOptions ro;
    ro.images = images;
    ro.log = info_.dir / "restore.log";
    ro.pidfile = info_.dir / "root.pid";
    ro.shell_job = manifest.shell_job;
    auto stdio = open_stdio();
    plan_stdio(manifest, stdio, ro);
    auto image_fds = plan_host_images(manifest, images, ro);
    publish_ports(options.publish);
    engine::CopyInitSpec spec;
    spec.criu_argv =
        into_ != 0 ? criu_argv_in_placeholder(criu, ro, spec) : criu::restore_args(criu, ro);
    prepare_handshake_dir(manifest, spec);
    spec.pidfile = ro.pidfile;
    spec.criu_output = info_.dir / "criu.out";
    start_init(spec, options);
  }

  Copy(const Copy&) = delete;
  Copy& operator=(const Copy&) = delete;
  ~Copy() {
    if (into_ == 0 || !init_ || !init_->running()) return;
    control_.reset();
    init_->wait(std::chrono::seconds(30));
  }

  int control() const { return control_.get(); }
  CopyInfo& info() { return info_; }
  // The workload's handshake directory as the host reaches it.
  std::filesystem::path handshake_dir(const Manifest& manifest) const {
    if (into_ == 0) return info_.dir / "control";
    return handshake_dir_in(info_.host_pid, manifest);
  }
  static std::filesystem::path handshake_dir_in(pid_t pid, const Manifest& manifest) {
    return "/proc/" + std::to_string(pid) + "/root" + manifest.control_dir;
  }

  // Reads the init's report: the restored root's namespace pid, or why it failed.
  void take_report() {
    std::string line;
    char c;
    while (::recv(control_.get(), &c, 1, 0) == 1 && c != '\n') line += c;
    if (line.rfind("R ", 0) == 0) {
      info_.ns_pid = std::stoi(line.substr(2));
      return;
    }
    auto log = info_.dir / "restore.log";
    std::string why = line.size() > 2 ? line.substr(2) : "its init died";
    if (std::filesystem::exists(log)) why += ": " + criu::summarize_failure(log);
    throw Error(ErrorKind::kCriu,
                "copy " + std::to_string(index_) + " failed to restore: " + why +
                    " (log: " + log.string() + ")",
                "read the log; nothing of this restore is left running");
  }

  void locate() {
    info_.host_pid = proc::host_pid_in_namespace(info_.init_pid, info_.ns_pid);
    if (info_.host_pid == 0) {
      throw Error(ErrorKind::kCriu, "copy " + std::to_string(index_) +
                                        ": the restored process exited right after restore "
                                        "(output: " +
                                        (info_.dir / "output.log").string() + ")");
    }
  }

  // The host pid of a process of this copy, by its pid inside the copy's namespace.
  pid_t host_pid_of(pid_t ns_pid) const {
    pid_t pid = proc::host_pid_in_namespace(info_.init_pid, ns_pid);
    if (pid == 0) {
      throw Error(ErrorKind::kCriu, "copy " + std::to_string(index_) + ": process " +
                                        std::to_string(ns_pid) + " is missing after restore");
    }
    return pid;
  }

  void release() {
    char go = 'G';
    if (::send(control_.get(), &go, 1, MSG_NOSIGNAL) != 1) throw sys_error("release copy", errno);
    char ack[2] = {};
    if (::recv(control_.get(), ack, sizeof ack, MSG_WAITALL) != 2 || ack[0] != 'A') {
      throw Error(ErrorKind::kInternal, "copy " + std::to_string(index_) + " was not released");
    }
    control_.reset();
    if (into_ != 0) {
      init_->wait();  // it exits once the placeholder has the root
    } else {
      init_->release();
    }
  }

 private:
  // The copy's own standard descriptors: the workload's pointed at things of the source (its
  // log file, a pipe to its launcher, a terminal). A copy gets stdin from /dev/null and its
  // output into the copy's output.log; in a placeholder, the container's own (its log).
  struct Stdio {
    common::UniqueFd in;
    common::UniqueFd out;
  };
  Stdio open_stdio() const {
    Stdio s;
    if (into_ != 0) {
      s.out = container::borrow_fd(into_, STDOUT_FILENO);
      s.in = container::borrow_fd(into_, STDIN_FILENO);
    } else {
      s.out.reset(::open((info_.dir / "output.log").c_str(),
                         O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
      s.in.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    }
    if (!s.out || !s.in) throw sys_error("open the copy's output", errno);
    return s;
  }

  // The descriptor plan: each external file CRIU restores (by its key) is a descriptor the
  // init inherits, numbered from kFirstInheritFd in the order planned.
  int plan_inherit(int fd_here, const std::string& key, criu::RestoreOptions& ro) {
    int target = kFirstInheritFd + static_cast<int>(inherit_.size());
    inherit_.emplace_back(fd_here, target);
    ro.inherit.push_back({target, key});
    return target;
  }

  // The workload's stdio targets, each key once (CRIU matches each key once): stdin from the
  // copy's stdin, everything else into its output. `stdio` stays open until the init starts.
  void plan_stdio(const Manifest& manifest, const Stdio& stdio, criu::RestoreOptions& ro) {
    std::set<std::string> keys;
    for (const auto& p : manifest.processes) {
      for (const auto& s : p.stdio) {
        auto key = criu::inherit_key(s.target);
        if (key.empty() || !keys.insert(key).second) continue;
        plan_inherit(s.fd == 0 ? stdio.in.get() : stdio.out.get(), key, ro);
      }
    }
  }

  // Host images: CRIU maps each one back from the artifact, given to it as a descriptor under
  // the key it recorded. Read-only: the copy's mapping is private. Returns the descriptors,
  // to hold until the init starts.
  std::vector<common::UniqueFd> plan_host_images(const Manifest& manifest,
                                                 const std::filesystem::path& images,
                                                 criu::RestoreOptions& ro) {
    std::vector<common::UniqueFd> fds;
    for (const auto& image : manifest.host_images) {
      common::UniqueFd fd(
          ::open((images.parent_path() / image.file).c_str(), O_RDONLY | O_CLOEXEC));
      if (!fd) throw sys_error("open host image " + image.file, errno);
      if (kFirstInheritFd + static_cast<int>(inherit_.size()) >= kFirstListenFd) {
        throw Error(ErrorKind::kBadArtifact, "the artifact names too many files to hand to CRIU",
                    "take the checkpoint with --no-host-images");
      }
      plan_inherit(fd.get(), image.criu_key, ro);
      fds.push_back(std::move(fd));
    }
    return fds;
  }

  // One listener per --publish, on HOSTPORT + the copy's index (or any free port).
  void publish_ports(const std::vector<PortPublish>& publish) {
    for (const auto& pub : publish) {
      uint16_t host_port = pub.host_port == 0 ? 0 : static_cast<uint16_t>(pub.host_port + index_);
      uint16_t bound = 0;
      listeners_.push_back(engine::listen_on(pub.host_address, host_port, &bound));
      info_.ports.push_back({pub.host_address, bound, pub.port});
      forwarded_ports_.push_back(pub.port);
    }
  }

  // CRIU runs inside the placeholder: its files through the host root, the root left to the
  // placeholder's init, the tree in the placeholder's cgroups.
  std::vector<std::string> criu_argv_in_placeholder(const criu::Binary& criu,
                                                    const criu::RestoreOptions& ro,
                                                    engine::CopyInitSpec& spec) const {
    criu::RestoreOptions inside = ro;
    inside.images = container::host_path(ro.images);
    inside.log = container::host_path(ro.log);
    inside.pidfile = container::host_path(ro.pidfile);
    inside.sibling = false;
    inside.keep_cgroups = true;
    spec.into_pid = into_;
    spec.criu_pid = container::criu_pid_inside();
    spec.last_pid = criu::highest_task_id(ro.images);
    return container::criu_argv_inside(criu, criu::restore_args(criu, inside));
  }

  // The workload's handshake directory. A copy of its own gets a fresh one, mounted by its
  // init at the captured path; in a placeholder it is the placeholder's own (a fresh volume at
  // the same path), which must be there for the resume request.
  void prepare_handshake_dir(const Manifest& manifest, engine::CopyInitSpec& spec) const {
    if (manifest.control_dir.empty()) return;
    if (into_ != 0) {
      std::error_code ec;
      std::filesystem::create_directories(handshake_dir_in(into_, manifest), ec);
      return;
    }
    spec.handshake_source = info_.dir / "control";
    spec.handshake_target = manifest.control_dir;
    std::filesystem::create_directories(spec.handshake_source);
  }

  // Starts `gpusnap __copy-init` with the planned descriptors: a separate program rather than
  // a forked function, as gpusnap may have driver threads. A copy of its own gets fresh
  // namespaces and dies with gpusnap until released.
  void start_init(engine::CopyInitSpec& spec, const RestoreOptions& options) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      throw sys_error("socketpair", errno);
    }
    control_.reset(sv[0]);
    common::UniqueFd child_end(sv[1]);
    spec.control_fd = kControlFd;
    common::SpawnOptions o;
    o.keep_fds.push_back({child_end.get(), kControlFd});
    for (const auto& [src, dst] : inherit_) {
      o.keep_fds.push_back({src, dst});
      spec.inherit_fds.push_back(dst);
    }
    for (size_t i = 0; i < listeners_.size(); ++i) {
      int fd = kFirstListenFd + static_cast<int>(i);
      o.keep_fds.push_back({listeners_[i].get(), fd});
      spec.forwards.push_back({fd, forwarded_ports_[i]});
    }
    o.argv = {options.helper_binary.empty() ? "/proc/self/exe" : options.helper_binary,
              "__copy-init", engine::to_json(spec)};
    o.kill_with_parent = into_ == 0;
    o.new_session = true;  // a Ctrl-C at gpusnap's terminal must not reach released copies
    if (into_ == 0) {
      o.clone_flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS;
    }
    init_.emplace(o);
    info_.init_pid = into_ != 0 ? into_ : init_->pid();
    // Our copies of the listeners close here: the init holds them.
    inherit_.clear();
    listeners_.clear();
  }

  int index_;
  pid_t into_ = 0;
  CopyInfo info_;
  common::UniqueFd control_;
  std::vector<std::pair<int, int>> inherit_;  // {fd here, fd in the init}, until the init starts
  std::vector<common::UniqueFd> listeners_;   // until the init starts
  std::vector<uint16_t> forwarded_ports_;     // the copy's port of each listener
  std::optional<common::Subprocess> init_;
};

namespace {

// All copies restore at once; wait until each has reported, or the deadline passes.
void wait_reports(std::vector<std::unique_ptr<Copy>>& copies, const RestoreOptions& options) {
  auto deadline = std::chrono::steady_clock::now() + options.timeout;
  std::vector<bool> done(copies.size(), false);
  for (size_t left = copies.size(); left > 0;) {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t i = 0; i < copies.size(); ++i) {
      if (done[i]) continue;
      fds.push_back({copies[i]->control(), POLLIN, 0});
      which.push_back(i);
    }
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                  deadline - std::chrono::steady_clock::now())
                  .count();
    if (ms <= 0) {
      throw Error(ErrorKind::kTimeout,
                  "criu restore did not finish within " +
                      std::to_string(options.timeout.count() / 1000) + " s",
                  "look at restore.log under " + options.run_dir.string() + "/copies");
    }
    if (::poll(fds.data(), fds.size(), static_cast<int>(ms)) < 0 && errno != EINTR) {
      throw sys_error("poll", errno);
    }
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      copies[which[k]]->take_report();
      done[which[k]] = true;
      --left;
    }
  }
}

}  // namespace

Copies::Copies() = default;
Copies::~Copies() = default;

void Copies::restore(const Manifest& manifest, const std::filesystem::path& images,
                     const criu::Binary& criu, const RestoreOptions& options, pid_t into) {
  for (int i = 0; i < options.replicas; ++i) {
    copies_.push_back(std::make_unique<Copy>(i, manifest, images, criu, options, into));
  }
  wait_reports(copies_, options);
}

void Copies::locate() {
  for (auto& c : copies_) c->locate();
}

std::vector<pid_t> Copies::host_pids(const std::vector<pid_t>& ns_pids) const {
  std::vector<pid_t> pids;
  for (const auto& c : copies_) {
    for (pid_t pid : ns_pids) pids.push_back(c->host_pid_of(pid));
  }
  return pids;
}

void Copies::resume(const Manifest& manifest, const std::vector<nlohmann::json>& contexts,
                    std::chrono::milliseconds timeout) {
  std::vector<std::optional<Error>> errors(copies_.size());
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < copies_.size(); ++i) {
      threads.emplace_back([&, i] {
        try {
          Handshake handshake(copies_[i]->handshake_dir(manifest));
          handshake.resume(copies_[i]->info().host_pid, contexts.at(i), timeout);
          handshake.clear_exchange();
        } catch (const Error& e) {
          errors[i] = e;
        }
      });
    }
  }
  for (size_t i = 0; i < errors.size(); ++i) {
    if (errors[i]) {
      throw Error(errors[i]->kind(), "copy " + std::to_string(i) + ": " + errors[i]->what(),
                  errors[i]->hint());
    }
  }
}

std::vector<CopyInfo> Copies::release() {
  std::vector<CopyInfo> released;
  for (auto& c : copies_) {
    c->release();
    released.push_back(c->info());
  }
  return released;
}

}  // namespace gpusnap::engine
