// The restore flow, as named, timed phases:
//
//   open        read the manifest; format, host and GPU compatibility checks, the GPU map
//   await-criu-images, await-artifact  (an artifact still arriving: a pull overlapping the
//               restore) CRIU's images before criu-restore; the rest after it, before verify
//   placeholder (--into-container) the target is a waiting placeholder with the captured rootfs
//   verify      every byte against the manifest (skipped with --no-verify)
//   criu-restore  each copy's init, in its fresh namespaces, runs `criu restore`; all at once
//   locate      the restored roots' host pids
//   gpu-init    (GPU snapshots) CUDA initialised in gpusnap, started after open, beside CRIU
//   gpu-restore (GPU snapshots) the driver puts each CUDA process's GPU state back, onto the
//               mapped GPUs, and unlocks it; all processes of all copies in parallel
//   release     the copies are handed over and outlive gpusnap
//
// Until release, every copy's init dies with this object (and with gpusnap), so a failure or a
// kill at any point leaves no process and no namespace behind.
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"
#include "container/enter.h"
#include "container/mount.h"
#include "container/runc.h"
#include "criu/criu.h"
#include "criu/kernel_cache.h"
#include "engine/copy_init.h"
#include "engine/gpu_state.h"
#include "engine/handshake.h"
#include "engine/publish.h"
#include "engine/tier_files.h"
#include "gpu/driver.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"

namespace gpusnap {

namespace {

constexpr int kControlFd = 3;
constexpr int kFirstInheritFd = 10;
constexpr int kFirstListenFd = 512;

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

// Waits for a background task when its owner's scope ends, however it ends: the task uses
// objects of that scope (the artifact, the driver).
template <typename T>
class WaitOnExit {
 public:
  explicit WaitOnExit(std::future<T>& f) : f_(f) {}
  WaitOnExit(const WaitOnExit&) = delete;
  WaitOnExit& operator=(const WaitOnExit&) = delete;
  ~WaitOnExit() {
    if (f_.valid()) f_.wait();
  }

 private:
  std::future<T>& f_;
};

class Restore {
 public:
  Restore(RestoreOptions options, Reporter& reporter)
      : options_(std::move(options)), phases_(reporter) {}

  RestoreResult run() {
    // CRIU resolves relative paths from its own working directory, not ours.
    options_.run_dir = std::filesystem::absolute(options_.run_dir);
    if (options_.replicas < 1) {
      throw Error(ErrorKind::kUsage, "--replicas must be at least 1");
    }
    if (options_.into_container && (options_.replicas != 1 || !options_.publish.empty())) {
      throw Error(ErrorKind::kUsage,
                  "--into-container restores one copy into the placeholder's own namespaces",
                  "drop --replicas and --publish; reach the copy as the container is reached");
    }
    auto criu = criu::locate(options_.criu_path);
    criu::keep_kernel_cache(criu);  // CRIU starts 0.06-0.08 s sooner with it
    gpu::Driver& driver = gpu::given_or_nvidia(options_.driver, owned_driver_);
    for (const auto& line : engine::recover_abandoned(driver, options_.run_dir)) {
      phases_.reporter().note(line);
    }
    engine::GpuPlan gpu_plan;
    ArrivingArtifact* arriving = options_.arriving;
    auto artifact = phases_.run("open", [&] {
      auto a = Artifact::open(arriving != nullptr ? arriving->staging() : options_.artifact);
      check_host_compatible(a.manifest(), HostFacts::probe(criu.version));
      gpu_plan =
          engine::plan_gpu_restore(a.manifest().gpu, driver, options_.gpu_map, options_.replicas);
      return a;
    });
    for (const auto& line : gpu_plan.notes) phases_.reporter().note(line);
    // The driver's restore needs CUDA initialised in gpusnap's own process (cuInit: ~0.2 s on
    // an H200): it starts now and runs while CRIU restores.
    std::future<void> driver_ready;
    WaitOnExit<void> driver_joiner{driver_ready};
    if (gpu_plan.has_gpu_state) {
      driver_ready = std::async(std::launch::async, [&driver] { driver.prepare_restore(); });
    }
    pid_t into = 0;
    if (options_.into_container) {
      phases_.run("placeholder", [&] {
        into =
            container::placeholder_target(*options_.into_container, artifact.manifest()).state.pid;
      });
    }
    // An artifact still arriving: without GPU state CRIU's restore lets the copies run, so
    // every byte must be there first (a CPU snapshot is CRIU's images alone: nothing to
    // overlap). With GPU state CRIU restores from its images while the GPU memory arrives.
    if (arriving != nullptr && !gpu_plan.has_gpu_state) {
      artifact = phases_.run("await-artifact", [&] { return arrived(*arriving); });
      arriving = nullptr;
    }
    // The tiers' fill done ahead, while CRIU and the driver restore the copies
    // (engine/tier_files.h). Not for an artifact still arriving (its tier files are not there yet).
    // A copy in a placeholder reaches the prefill's sockets through a mount (resume()).
    std::optional<engine::TierPrefills> prefills;
    if (gpu_plan.has_gpu_state && !artifact.manifest().control_dir.empty() && arriving == nullptr) {
      std::map<std::string, std::string> gpu_map;
      for (const auto& p : gpu_plan.pairs) gpu_map[p.old_uuid] = p.new_uuid;
      try {
        prefills.emplace(options_.artifact, gpu_map, options_.replicas, options_.run_dir,
                         options_.verify ? artifact.manifest().chunk_bytes : 0);
      } catch (const Error& e) {
        // Only slower without it: each copy then fills its tier itself.
        phases_.reporter().note(std::string("tier prefill not started: ") + e.what());
      }
    }
    // With GPU state, nothing of a copy serves before its GPU state is restored (its CUDA
    // processes stay checkpointed, the copy unreleased): the bytes are checked while CRIU
    // restores, and the check must pass before gpu-restore. Without GPU state CRIU's restore
    // lets the copies run, so the check comes first. The tier's files a prefill reads are
    // checked by the sums it computes as it reads them (verify-tier, before the resume): not
    // read a second time beside CRIU's restore (0.13 s of a 16 GiB restore on the H200).
    const std::set<std::string> prefilled =
        prefills ? prefills->files_read(artifact.manifest()) : std::set<std::string>();
    std::future<std::vector<VerifyProblem>> verifying;
    auto verify_in_background = [&] {
      verifying = std::async(std::launch::async, [&artifact, &prefilled] {
        VerifyScope scope;
        scope.deferred = prefilled;
        return artifact.verify({}, scope);
      });
    };
    if (options_.verify && gpu_plan.has_gpu_state && arriving == nullptr) {
      verify_in_background();
    } else if (options_.verify && !gpu_plan.has_gpu_state) {
      phases_.run("verify", [&] { check(artifact.verify(VerifyOptions{0, &phases_.reporter()})); });
    }
    WaitOnExit<std::vector<VerifyProblem>> verify_joiner{verifying};
    if (arriving != nullptr) {
      phases_.run("await-criu-images", [&] { arriving->await_criu_images(); });
    }
    std::vector<std::unique_ptr<Copy>> copies;
    phases_.run("criu-restore", [&] {
      for (int i = 0; i < options_.replicas; ++i) {
        copies.push_back(std::make_unique<Copy>(i, artifact.manifest(), artifact.criu_dir(), criu,
                                                options_, into));
      }
      wait_reports(copies);
    });
    phases_.run("locate", [&] {
      for (auto& c : copies) c->locate();
    });
    // CRIU no longer reads the staging directory: the artifact may take its final name. The
    // host images were handed to CRIU as descriptors, which the rename leaves valid; their
    // bytes are first read by the driver's restore, the tier's by the resume.
    if (arriving != nullptr) {
      artifact = phases_.run("await-artifact", [&] { return arrived(*arriving); });
      if (options_.verify) verify_in_background();
    }
    if (driver_ready.valid()) phases_.run("gpu-init", [&] { driver_ready.get(); });
    if (verifying.valid()) phases_.run("verify", [&] { check(verifying.get()); });
    if (gpu_plan.has_gpu_state) {
      phases_.run("gpu-restore", [&] {
        std::vector<pid_t> pids;
        for (auto& c : copies) {
          for (const auto& p : artifact.manifest().gpu->processes) {
            pids.push_back(c->host_pid_of(p.pid));
          }
        }
        engine::restore_gpu_processes(driver, pids, gpu_plan.pairs);
      });
    }
    if (options_.verify && !prefilled.empty()) {
      // As long as a prefill may take to fill (its own timeout): the copies wait for it anyway.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      phases_.run("verify-tier", [&] {
        check(engine::verify_prefilled(artifact, *prefills, prefilled, deadline));
      });
    }
    RestoreResult result;
    if (!artifact.manifest().control_dir.empty()) {
      phases_.run("resume", [&] {
        resume(copies, artifact.manifest(), gpu_plan, prefills ? &*prefills : nullptr, into);
      });
      result.handshake = true;
    }
    if (prefills) {
      // Each prefill's report: what it filled, and whether its copy took the memory.
      const auto lines = phases_.run("tier-prefills", [&] { return prefills->finish(); });
      for (const auto& line : lines) phases_.reporter().note(line);
    }
    phases_.run("release", [&] {
      for (auto& c : copies) {
        c->release();
        result.copies.push_back(c->info());
      }
    });
    result.manifest = artifact.manifest();
    result.phases = phases_.timings();
    return result;
  }

 private:
  // Every copy is asked to resume with its own context, all at once; each must say RESUMED.
  // `into`: the placeholder's PID 1 for a copy restored into one, else 0.
  void resume(std::vector<std::unique_ptr<Copy>>& copies, const Manifest& manifest,
              const engine::GpuPlan& gpu_plan, const engine::TierPrefills* prefills, pid_t into) {
    nlohmann::json gpu_map = nlohmann::json::object();
    for (const auto& p : gpu_plan.pairs) gpu_map[p.old_uuid] = p.new_uuid;
    // Each copy's memory tier fills from the artifact itself (engine/tier_files.h), or takes over
    // what its prefill filled.
    nlohmann::json tier_dir = engine::artifact_tier_dir(options_.artifact, manifest);
    std::vector<nlohmann::json> prefill_dirs;
    for (size_t i = 0; i < copies.size(); ++i) {
      prefill_dirs.push_back(prefills != nullptr ? prefills->context_dir(static_cast<int>(i))
                                                 : nlohmann::json(std::string()));
    }
    // A copy in a placeholder sees the placeholder's mounts only: both folders are mounted into
    // its handshake directory, read-only, for the time of the resume.
    std::optional<container::MountInside> tier_mount, prefill_mount;
    if (into != 0) {
      mount_for_placeholder(into, manifest, engine::kTierMountName, tier_dir, tier_mount,
                            Unmounted::kKeepHostPath);
      mount_for_placeholder(into, manifest, engine::kPrefillMountName, prefill_dirs[0],
                            prefill_mount, Unmounted::kLeaveOut);
    }
    std::vector<std::optional<Error>> errors(copies.size());
    {
      std::vector<std::jthread> threads;
      for (size_t i = 0; i < copies.size(); ++i) {
        threads.emplace_back([&, i] {
          try {
            engine::Handshake handshake(copies[i]->handshake_dir(manifest));
            handshake.resume(copies[i]->info().host_pid,
                             {{"restored", true},
                              {"copy", static_cast<int>(i)},
                              {"copies", static_cast<int>(copies.size())},
                              {"artifact_id", manifest.id},
                              {"gpu_map", gpu_map},
                              {"settings", options_.settings},
                              {"tier_dir", tier_dir},
                              {"tier_prefill_dir", prefill_dirs[i]}},
                             options_.handshake_timeout);
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

  // What a folder that cannot be mounted into a placeholder becomes. The tier's keeps the host's
  // path, which the copy reaches when the placeholder mounts the artifact's volume at the same
  // path, and otherwise refuses to fill (gpusnap then kills the copy: never a copy with wrong
  // memory); the prefill's is left out, and the copy fills by itself.
  enum class Unmounted { kKeepHostPath, kLeaveOut };

  // Mounts the host folder `dir` (when not "") at NAME in the placeholder's handshake
  // directory and points `dir` there; where that cannot be done, a note, and `otherwise`.
  void mount_for_placeholder(pid_t into, const Manifest& manifest, const char* name,
                             nlohmann::json& dir, std::optional<container::MountInside>& mount,
                             Unmounted otherwise) {
    const auto& host = dir.get_ref<const std::string&>();
    if (host.empty()) return;
    try {
      mount.emplace(into, host, std::filesystem::path(manifest.control_dir) / name, true);
      dir = mount->path().string();
    } catch (const Error& e) {
      phases_.reporter().note(std::string("memory tier: ") + e.what());
      if (otherwise == Unmounted::kLeaveOut) dir = std::string();
    }
  }

  // The artifact once every byte has arrived, under its final name.
  Artifact arrived(ArrivingArtifact& arriving) {
    options_.artifact = arriving.complete();
    return Artifact::open(options_.artifact);
  }

  void check(const std::vector<VerifyProblem>& problems) {
    if (problems.empty()) return;
    std::string what = problems[0].path + ": " + problems[0].problem;
    if (problems.size() > 1) what += " (and " + std::to_string(problems.size() - 1) + " more)";
    throw Error(ErrorKind::kBadArtifact,
                "artifact " + options_.artifact.string() + " is corrupt: " + what,
                "copy it again or take a new checkpoint (--no-verify skips this check)");
  }

  // All copies restore at once; wait until each has reported, or the deadline passes.
  void wait_reports(std::vector<std::unique_ptr<Copy>>& copies) {
    auto deadline = std::chrono::steady_clock::now() + options_.timeout;
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
                        std::to_string(options_.timeout.count() / 1000) + " s",
                    "look at restore.log under " + options_.run_dir.string() + "/copies");
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

  RestoreOptions options_;
  Phases phases_;
  std::unique_ptr<gpu::Driver> owned_driver_;
};

}  // namespace

RestoreResult restore(const RestoreOptions& options, Reporter& reporter) {
  return Restore(options, reporter).run();
}

}  // namespace gpusnap
