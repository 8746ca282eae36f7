// The checkpoint flow. Each step is a named, timed phase; the order is the contract:
//
//   resolve      read the process tree from /proc (of a container: find it through runc)
//   preflight    refuse what CRIU cannot capture, before anything is frozen
//   pause        (workloads speaking the handshake) finish in-flight work, release the KV cache
//   gpu-facts    (CUDA processes only) driver, GPUs and GPU bytes per process
//   gpu-lock     every CUDA process locked, all before any is checkpointed
//   gpu-checkpoint  the driver moves GPU memory into each process's host memory
//   host-images  that memory goes into files of the artifact, mapped back in place
//                (engine/host_images.h): CRIU then records the mapping, not the bytes
//   dump         CRIU dumps the tree into the staging directory (--leave-running)
//   gpu-resume   with --leave-running: the source's GPU state goes back, unlocked
//   resume       with --leave-running and the handshake: the source serves again
//   checksum     every staged file, in parallel
//   commit       manifest, fsync, rename into place: the artifact becomes visible
//   stop         without --leave-running, the source is stopped, only now
//
// A failure in any phase leaves the source running as before and nothing at the output path.
#include <signal.h>
#include <sys/stat.h>
#include <time.h>

#include <cstdio>
#include <map>
#include <thread>

#include "artifact/writer.h"
#include "common/fs.h"
#include "common/proc.h"
#include "container/enter.h"
#include "container/runc.h"
#include "criu/criu.h"
#include "engine/capture_lock.h"
#include "engine/dump_guard.h"
#include "engine/gpu_state.h"
#include "engine/handshake.h"
#include "engine/host_images.h"
#include "engine/preflight.h"
#include "engine/preload.h"
#include "gpu/driver.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/error.h"

namespace gpusnap {

namespace {

// How long the preload library's helpers may go on populating after the driver's checkpoint
// returns. They work ahead of the driver's copy, so they normally finish before it; this only
// bounds a starved machine.
constexpr std::chrono::milliseconds kFillThreadsLimit{30000};

std::string utc_now() {
  char buf[32];
  time_t now = ::time(nullptr);
  struct tm tm {};
  ::gmtime_r(&now, &tm);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

ProcessRecord record_of(const proc::Process& p) {
  ProcessRecord r;
  r.pid = p.pid;
  r.ppid = p.ppid;
  r.comm = p.comm;
  r.cmdline = p.cmdline;
  r.threads = p.threads;
  r.rss_bytes = p.rss_bytes;
  for (const auto& f : p.files) {
    if (f.fd <= 2) r.stdio.push_back({f.fd, f.target});
  }
  return r;
}

// Stops the source tree for good: every process, root first so it cannot replace children.
void stop_tree(const std::vector<proc::Process>& tree) {
  for (const auto& p : tree) ::kill(p.pid, SIGKILL);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (const auto& p : tree) {
    while (proc::exists(p.pid) && std::chrono::steady_clock::now() < deadline) {
      // A zombie still "exists" until its parent reaps it; that is stopped enough.
      try {
        if (proc::read_process(p.pid).state == 'Z') break;
      } catch (const Error&) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
}

// A workload that answered PAUSED. Whatever happens next, it is asked to resume (as the
// source, restored=false) unless it is about to be stopped: no failure leaves it paused.
class PausedWorkload {
 public:
  PausedWorkload(engine::Handshake handshake, pid_t pid, std::chrono::milliseconds timeout,
                 Reporter& reporter)
      : handshake_(std::move(handshake)), pid_(pid), timeout_(timeout), reporter_(reporter) {}
  PausedWorkload(const PausedWorkload&) = delete;
  PausedWorkload& operator=(const PausedWorkload&) = delete;
  ~PausedWorkload() {
    if (done_) return;
    try {
      resume();
    } catch (const Error& e) {
      reporter_.note(std::string("the workload did not resume after the failed capture: ") +
                     e.what());
    }
  }

  const std::filesystem::path& dir() const { return handshake_.dir(); }
  // The artifact the source was captured into, for its resume context (empty: none made).
  void set_artifact_id(std::string id) { artifact_id_ = std::move(id); }
  void resume() {
    done_ = true;
    handshake_.clear_exchange();
    handshake_.resume(pid_,
                      {{"restored", false},
                       {"copy", 0},
                       {"copies", 1},
                       {"artifact_id", artifact_id_},
                       {"gpu_map", nlohmann::json::object()},
                       {"settings", nlohmann::json::object()}},
                      timeout_);
    handshake_.clear_exchange();
  }
  void release() {
    done_ = true;
    handshake_.clear_exchange();
  }

 private:
  engine::Handshake handshake_;
  pid_t pid_;
  std::chrono::milliseconds timeout_;
  Reporter& reporter_;
  std::string artifact_id_;
  bool done_ = false;
};

class Checkpoint {
 public:
  Checkpoint(const CheckpointOptions& options, Reporter& reporter)
      : options_(options), phases_(reporter) {}

  CheckpointResult run() {
    auto criu = criu::locate(options_.criu_path);
    gpu::Driver& driver = open_driver();
    for (const auto& line : engine::recover_abandoned(driver, options_.run_dir)) {
      phases_.reporter().note(line);
    }
    ArtifactWriter writer(options_.output, {options_.artifact_group, options_.run_dir});
    auto tree = phases_.run("resolve", [&] { return resolve(); });
    std::vector<pid_t> pids;
    for (const auto& p : tree) pids.push_back(p.pid);
    const engine::CaptureLock capture_lock(options_.run_dir, pids);
    auto cuda = engine::cuda_processes(driver, tree);
    phases_.run("preflight", [&] {
      preflight(tree);
      engine::refuse_unsafe_nccl(tree, cuda);
    });
    Manifest manifest = describe(tree, criu);

    // From here on the workload is changed (paused, its GPU state moved): the guardian undoes
    // that even if gpusnap dies. Declared before the objects that roll back in-process, so that
    // on a failure it comes last and finds nothing left to do.
    std::optional<engine::CaptureGuard> guard;
    std::optional<PausedWorkload> paused;
    auto handshake = find_handshake();
    guard.emplace(options_.helper_binary.empty() ? "/proc/self/exe" : options_.helper_binary,
                  writer.staging(), cuda, handshake ? handshake->dir() : std::filesystem::path());
    if (handshake) {
      phases_.run("pause", [&] { handshake->pause(options_.pid, options_.handshake_timeout); });
      paused.emplace(std::move(*handshake), options_.pid, options_.handshake_timeout,
                     phases_.reporter());
      manifest.control_dir = control_dir_.string();
    } else {
      phases_.reporter().note("capturing pid " + std::to_string(options_.pid) +
                              " as it runs: it does not speak the workload handshake");
    }

    std::optional<engine::GpuCapture> gpu;
    std::map<pid_t, std::vector<Mapping>> maps_before;
    if (!cuda.empty()) {
      phases_.run("gpu-facts", [&] {
        describe_gpu(driver, cuda, manifest);
        for (pid_t pid : cuda) maps_before[pid] = read_mappings(pid);
      });
      note_processes_without_preload(maps_before);
      gpu.emplace(driver, cuda, options_.gpu_lock_timeout, options_.run_dir, phases_.reporter());
      phases_.run("gpu-lock", [&] { gpu->lock_all(); });
      phases_.run("gpu-checkpoint", [&] {
        gpu->checkpoint_all();
        // The preload library may still be populating a region ahead of the driver's copy;
        // it must be done before the region is copied, moved or dumped.
        for (pid_t pid : engine::wait_for_fill_threads(cuda, kFillThreadsLimit)) {
          maps_before.erase(pid);  // its region stays with CRIU
          phases_.reporter().note(
              "process " + std::to_string(pid) + ": " + engine::kPreloadFileName +
              " was still populating its GPU state's host memory after " +
              std::to_string(kFillThreadsLimit.count()) + " ms; that memory is left to CRIU");
        }
      });
      if (options_.host_images) {
        phases_.run("host-images", [&] { store_host_images(maps_before, writer, manifest); });
      }
    }

    auto log = writer.staging() / "logs" / "criu-dump.log";
    std::filesystem::create_directories(log.parent_path());
    phases_.run("dump", [&] {
      auto status = guard->dump(
          dump_argv(criu, {options_.pid, writer.criu_dir(), log, manifest.shell_job,
                           options_.ghost_limit, engine::criu_external_keys(manifest.host_images)}),
          log.parent_path() / "criu-dump.out");
      if (!status.ok()) fail_dump(status, log);
    });
    // The source waits for nothing more: its GPU state goes back before the bookkeeping.
    if (gpu && options_.leave_running) phases_.run("gpu-resume", [&] { gpu->resume_all(); });
    if (paused && options_.leave_running) {
      paused->set_artifact_id(manifest.id);
      phases_.run("resume", [&] { paused->resume(); });
    }
    if (target_) container::use_namespace_pids(manifest);
    manifest.checkpoint_phases = phases_.timings();
    writer.seal(manifest, phases_, host_image_files_);
    // The manifest records its own phases up to the commit; the commit itself is reported.
    manifest.checkpoint_phases = phases_.timings();
    writer.commit(manifest, phases_);
    if (!options_.leave_running) {
      if (gpu) gpu->release();
      if (paused) paused->release();
      phases_.run("stop", [&] { stop_tree(tree); });
    }
    guard->commit();
    return {writer.final_path(), std::move(manifest), phases_.timings(), paused.has_value()};
  }

 private:
  // The handshake to use: the workload has a control directory and has said READY.
  std::optional<engine::Handshake> find_handshake() {
    if (!options_.handshake) return std::nullopt;
    auto dir = options_.control_dir.empty() ? engine::control_dir_of(options_.pid)
                                            : std::optional(options_.control_dir);
    if (!dir) return std::nullopt;
    control_dir_ = *dir;
    // A container's workload names its directory in its own root.
    if (target_) dir = "/proc/" + std::to_string(options_.pid) + "/root" + dir->string();
    engine::Handshake handshake(*dir);
    if (!handshake.ready()) return std::nullopt;
    return handshake;
  }

  gpu::Driver& open_driver() {
    if (options_.driver != nullptr) return *options_.driver;
    owned_driver_ = gpu::open_nvidia_driver();
    return *owned_driver_;
  }

  void describe_gpu(gpu::Driver& driver, const std::vector<pid_t>& cuda, Manifest& manifest) {
    if (!driver.available()) {
      throw Error(ErrorKind::kEnvironment,
                  "process " + std::to_string(cuda.front()) +
                      " uses the GPU, but the NVIDIA driver cannot be loaded: " + driver.reason(),
                  "run gpusnap where libcuda.so.1 and libnvidia-ml.so.1 can be loaded");
    }
    manifest.gpu = engine::describe_gpu_state(driver, cuda);
    for (const auto& p : manifest.gpu.at("processes")) {
      for (auto& rec : manifest.processes) {
        if (rec.pid == p.at("pid").get<pid_t>()) rec.gpu_bytes = p.at("bytes").get<uint64_t>();
      }
    }
  }

  // Each CUDA process's new host memory into files of the artifact, one process at a time,
  // each with every I/O thread.
  void store_host_images(const std::map<pid_t, std::vector<Mapping>>& before,
                         const ArtifactWriter& writer, Manifest& manifest) {
    engine::HostImageOptions o;
    o.threads = options_.io_threads > 0
                    ? options_.io_threads
                    : std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
    o.chunk_bytes = manifest.chunk_bytes;
    o.file_bytes = options_.host_image_file_bytes;
    for (const auto& [pid, maps] : before) {
      auto ranges =
          engine::new_anonymous_ranges(maps, read_mappings(pid), engine::kMinHostImageBytes);
      auto stored = engine::store_host_images(pid, ranges, writer.staging(), o, phases_.reporter());
      manifest.host_images.insert(manifest.host_images.end(), stored.images.begin(),
                                  stored.images.end());
      host_image_files_.insert(host_image_files_.end(), stored.files.begin(), stored.files.end());
    }
    if (!manifest.host_images.empty() && engine::on_tmpfs_without_huge_pages(writer.staging())) {
      phases_.reporter().note(
          "the artifact is on a tmpfs without huge pages: its host images are written and mapped "
          "4 KiB at a time; a tmpfs mounted with huge=within_size stores and restores them "
          "faster (docs/benchmarks.md)");
    }
  }

  // The driver's checkpoint of a process started without libgpusnap-preload.so populates its
  // host memory in one thread: said once, with the way out.
  void note_processes_without_preload(const std::map<pid_t, std::vector<Mapping>>& maps) {
    std::string pids;
    for (const auto& [pid, m] : maps) {
      if (!engine::maps_preload_library(m))
        pids += (pids.empty() ? "" : ", ") + std::to_string(pid);
    }
    if (pids.empty()) return;
    phases_.reporter().note(
        "CUDA process " + pids + " runs without " + engine::kPreloadFileName +
        ": the driver's checkpoint fills its host memory in one thread (16 GiB: 4-6 s longer on "
        "the H200); workloads started by `gpusnap run` or `gpusnap init` have it "
        "(docs/design.md, \"The driver's checkpoint\")");
  }

  std::vector<proc::Process> resolve() {
    if (options_.container) {
      target_ = container::capture_target(*options_.container);
      options_.pid = target_->root;
    }
    engine::refuse_bad_root(options_.pid);
    return proc::read_tree(options_.pid);
  }

  void preflight(const std::vector<proc::Process>& tree) {
    engine::refuse_uncapturable(tree);
    for (const auto& p : tree) {
      if (p.state == 'Z') {
        throw Error(ErrorKind::kNotCapturable,
                    "process " + std::to_string(p.pid) + " (" + p.comm + ") is a zombie",
                    "let its parent reap it, then try again");
      }
    }
  }

  Manifest describe(const std::vector<proc::Process>& tree, const criu::Binary& criu) {
    Manifest m;
    m.id = fs::random_id();
    m.created = utc_now();
    m.gpusnap_version = GPUSNAP_VERSION;
    m.source_pid = options_.pid;
    m.source_cmdline = tree.front().cmdline;
    m.host = HostFacts::probe(criu.version);
    m.shell_job = engine::uses_terminal(tree);
    for (const auto& p : tree) m.processes.push_back(record_of(p));
    if (target_) m.container = container::describe(*target_, tree);
    return m;
  }

  // CRIU's dump command. A container's tree is dumped by CRIU inside the container's
  // namespaces, started there by `gpusnap __container-exec`, so that it sees the tree's own
  // pids, mounts and files, and dumps no namespace.
  std::vector<std::string> dump_argv(const criu::Binary& criu, criu::DumpOptions o) {
    if (!target_) return criu::dump_args(criu, o);
    container::EnterSpec enter;
    enter.target = target_->state.pid;
    enter.output = o.log.parent_path() / "criu-dump.out";
    o.pid = proc::innermost_pid(proc::read_process(o.pid));
    o.images = container::host_path(o.images);
    o.log = container::host_path(o.log);
    enter.argv = container::criu_argv_inside(criu, criu::dump_args(criu, o));
    return {options_.helper_binary.empty() ? "/proc/self/exe" : options_.helper_binary,
            "__container-exec", container::to_json(enter)};
  }

  [[noreturn]] void fail_dump(const ExitStatus& status, const std::filesystem::path& log) {
    const std::string summary = criu::summarize_failure(log);
    // The staging directory goes away with the failure: keep CRIU's log beside the output.
    // Moved, not copied: when the dump failed for lack of space, a copy has no room (it came
    // out empty), while a rename within the filesystem needs none.
    auto kept = options_.output;
    kept += ".criu-dump.log";
    std::string where = "log: " + kept.string();
    if (::rename(log.c_str(), kept.c_str()) != 0) {
      where = "its log could not be kept: " + errno_text(errno);
    } else {
      ::chmod(kept.c_str(), 0600);  // it quotes the workload's files and memory layout
    }
    throw Error(ErrorKind::kCriu,
                "criu dump " + status.describe() + ": " + summary + " (" + where + ")",
                "read the log; the workload was left running");
  }

  CheckpointOptions options_;  // a copy: a container capture fills in the pid
  std::optional<container::CaptureTarget> target_;
  std::filesystem::path control_dir_;  // the workload's, as it names it
  Phases phases_;
  std::vector<FileRecord> host_image_files_;  // hashed while written: seal need not read them
  std::unique_ptr<gpu::Driver> owned_driver_;
};

}  // namespace

CheckpointResult checkpoint(const CheckpointOptions& options, Reporter& reporter) {
  return Checkpoint(options, reporter).run();
}

}  // namespace gpusnap
