// The checkpoint flow. Each step is a named, timed phase; the order is the contract:
//
//   resolve      read the process tree from /proc (of a container: find it through runc)
//   preflight    refuse what CRIU cannot capture, or what the host has no memory or store
//                space for, before anything is frozen
//   pause        (workloads speaking the handshake) finish in-flight work, release the KV cache;
//                the memory tier, if the workload has one, drains into STAGING/tier
//   gpu-facts    (CUDA processes only) driver, GPUs and GPU bytes per process
//   gpu-lock     every CUDA process locked, all before any is checkpointed
//   gpu-checkpoint  the driver moves GPU memory into each process's host memory: with
//                libgpusnap-preload.so, straight into a file of the artifact
//   host-images  that memory goes into files of the artifact (where the driver did not write
//                it there itself), mapped back in place, privately (engine/host_images.h):
//                CRIU then records the mapping, not the bytes; hashing goes on meanwhile
//   dump         CRIU dumps the tree into the staging directory (--leave-running)
//   gpu-resume   with --leave-running: the source's GPU state goes back, unlocked
//   resume       with --leave-running and the handshake: the source serves again
//   host-images-hash  (only what the dump did not hide) the files the driver wrote, hashed
//   tier-hash    (a memory tier, source stopped) the wait for the tier's files, hashed in the
//                background since the dump began
//   checksum     every staged file, in parallel
//   settle       (CUDA processes only) every process still alive a moment (kSettle) after the
//                driver's checkpoint, its GPU state where it should be: else nothing is
//                committed. The phases since the checkpoint fill the moment
//   commit       manifest, fsync, rename into place: the artifact becomes visible
//   stop         without --leave-running, the source is stopped, only now
//
// Each feature is one object acting at these points (engine/capture/): the paused workload, the
// memory tier, the GPU state, the host images; its destructor is its rollback. A failure in any
// phase leaves the source running as before and nothing at the output path. A process of the
// tree that dies after the pause and before the commit fails the capture, whatever phase
// notices it, with the error naming the process and how it died (engine/death_watch.h).
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "artifact/writer.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/utc.h"
#include "container/enter.h"
#include "container/runc.h"
#include "criu/criu.h"
#include "criu/kernel_cache.h"
#include "engine/capture/gpu_checkpoint.h"
#include "engine/capture/host_image_capture.h"
#include "engine/capture/paused_workload.h"
#include "engine/capture/tier_drain.h"
#include "engine/capture_lock.h"
#include "engine/death_watch.h"
#include "engine/dump_guard.h"
#include "engine/gpu_state.h"
#include "engine/preflight.h"
#include "gpu/driver.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/error.h"

namespace gpusnap {

namespace {

// The death watch's moment after the driver's checkpoint. A capture's own phases after the
// checkpoint (host images, dump, hashing) take 0.3 s at 16 GiB on the H200, more beyond: the
// moment costs a capture little wait of its own. (JAX with preallocation died about a second
// after the checkpoint; it is refused before anything is frozen, engine/preflight.h.)
constexpr std::chrono::milliseconds kSettle{300};
// After a failure: how long a dying process is given to finish dying (a core dump takes a
// while), so that the error names the death rather than what it broke first.
constexpr std::chrono::milliseconds kDyingGrace{500};
constexpr std::chrono::milliseconds kSettlePoll{20};

// `internal`: the pipes the tree holds both ends of (proc::pipes_within). Such a pipe on a
// standard descriptor is the tree's own plumbing (a worker's stdin and stdout to its parent):
// it is not recorded as stdio, which a restore would give to the copy's log and /dev/null.
ProcessRecord record_of(const proc::Process& p, const std::set<std::string>& internal) {
  ProcessRecord r;
  r.pid = p.pid;
  r.ppid = p.ppid;
  r.comm = p.comm;
  r.cmdline = p.cmdline;
  r.threads = p.threads;
  r.rss_bytes = p.rss_bytes;
  for (const auto& f : p.files) {
    if (f.fd <= 2 && !internal.count(f.target)) r.stdio.push_back({f.fd, f.target});
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

class Checkpoint {
 public:
  Checkpoint(const CheckpointOptions& options, Reporter& reporter)
      : options_(options), phases_(reporter) {}

  CheckpointResult run() {
    const auto criu = criu::locate(options_.criu_path);
    criu::keep_kernel_cache(criu);  // CRIU starts 0.06-0.08 s sooner with it
    gpu::Driver& driver = gpu::given_or_nvidia(options_.driver, owned_driver_);
    note(engine::recover_abandoned(driver, options_.run_dir));
    artifact::ArtifactWriter writer(options_.output, {options_.artifact_group, options_.run_dir});
    const auto tree = phases_.run("resolve", [&] { return resolve(); });
    const engine::CaptureLock capture_lock(options_.run_dir, pids_of(tree));
    const auto cuda = engine::cuda_processes(driver, tree);
    // From the pause on the workload is changed (paused, its GPU state moved): the guardian
    // undoes that even if gpusnap dies. Declared first, so that on a failure it comes last and
    // finds nothing left to do; the features roll back in reverse order of declaration.
    std::optional<engine::CaptureGuard> guard;
    engine::PausedWorkload workload(options_, target_.has_value(), phases_.reporter());
    engine::GpuCheckpoint gpu(driver, cuda, options_, phases_.reporter());
    engine::HostImageCapture images(cuda, writer.staging(), options_, target_.has_value(),
                                    io_threads(), phases_.reporter());
    engine::TierDrain tier(writer.staging(), options_.pid, io_threads());  // stops first
    phases_.run("preflight", [&] { preflight(driver, tree, cuda, images, writer); });
    Manifest manifest = describe(tree, criu);
    engine::DeathWatch watch(tree);
    guard.emplace(helper_binary(), writer.staging(), cuda, pids_of(tree), workload.dir(),
                  images.requests(), capture_lock.fd());
    // A death during the pause is the handshake's to report: it names it already.
    if (workload.speaks_handshake()) {
      phases_.run("pause", [&] {
        workload.pause(tier.make_folder());
        tier_drained_ = tier.check();
        workload.keep_tier(tier_drained_);
      });
      manifest.control_dir = workload.control_dir().string();
    } else {
      phases_.reporter().note("capturing pid " + std::to_string(options_.pid) +
                              " as it runs: it does not speak the workload handshake");
    }
    try {
      if (gpu.any()) {
        phases_.run("gpu-facts", [&] {
          gpu.describe(manifest, tier.contents());
          images.remember_mappings();
        });
        images.note_processes_without_preload();
        phases_.run("gpu-lock", [&] { gpu.lock(); });
        phases_.run("gpu-checkpoint", [&] {
          images.before_gpu_checkpoint();
          gpu.checkpoint();
          images.after_gpu_checkpoint();
        });
        if (options_.host_images) phases_.run("host-images", [&] { keep(images.store(manifest)); });
      }
      tier.before_dump(manifest.chunk_bytes, options_.leave_running);
      phases_.run("dump", [&] { dump(*guard, criu, writer, manifest); });
      // The source waits for nothing more: its GPU state goes back before the bookkeeping.
      if (gpu.any() && options_.leave_running) phases_.run("gpu-resume", [&] { gpu.resume(); });
      if (workload.paused() && options_.leave_running) {
        phases_.run("resume", [&] { workload.resume(manifest.id); });
      }
      if (images.hashing()) phases_.run("host-images-hash", [&] { keep(images.hashed(manifest)); });
      if (tier.hashing()) phases_.run("tier-hash", [&] { keep(tier.hashed()); });
      if (target_) container::use_namespace_pids(manifest);
      manifest.checkpoint_phases = phases_.timings();
      writer.seal(manifest, phases_, hashed_files_);
      if (gpu.any()) phases_.run("settle", [&] { settle(watch, gpu); });
      require_alive(watch, nullptr);  // last look before the artifact becomes visible
    } catch (const Error& e) {
      name_the_death(watch, gpu, e);
      throw;
    }
    // The manifest records its own phases up to the commit; the commit itself is reported.
    manifest.checkpoint_phases = phases_.timings();
    writer.commit(manifest, phases_);
    if (!options_.leave_running) {
      gpu.commit();
      workload.commit();
      phases_.run("stop", [&] { stop_tree(tree); });
    }
    guard->commit();
    return {writer.final_path(), std::move(manifest), phases_.timings(), workload.paused()};
  }

 private:
  static std::vector<pid_t> pids_of(const std::vector<proc::Process>& tree) {
    std::vector<pid_t> pids;
    for (const auto& p : tree) pids.push_back(p.pid);
    return pids;
  }

  std::string helper_binary() const {
    return options_.helper_binary.empty() ? "/proc/self/exe" : options_.helper_binary;
  }

  void note(const std::vector<std::string>& lines) {
    for (const auto& line : lines) phases_.reporter().note(line);
  }

  // Files hashed before the seal: seal need not read them.
  void keep(const std::vector<FileRecord>& files) {
    hashed_files_.insert(hashed_files_.end(), files.begin(), files.end());
  }

  // A dying process often shows first as a CRIU or driver error about a missing pid, while the
  // kernel is still ending it (a core dump takes a while): after a failure its death is given
  // the time the settle phase gives, so that the error names the cause.
  void name_the_death(engine::DeathWatch& watch, const engine::GpuCheckpoint& gpu, const Error& e) {
    if (death_reported_) return;
    // gpusnap's own rollback kills a process the driver marked FAILED: not a death to report.
    for (pid_t pid : gpu.killed()) watch.forget(pid);
    watch_for_deaths(watch, &e, std::chrono::steady_clock::now() + kDyingGrace);
  }

  // Throws, when a process of the tree is dead, an Error naming each death and how it came;
  // `cause` is the failure that led here, if any (a dead process often shows first as a CRIU or
  // driver error about a missing pid), and is kept in the message.
  void require_alive(engine::DeathWatch& watch, const Error* cause) {
    auto deaths = watch.deaths();
    if (deaths.empty()) return;
    std::string message;
    for (const auto& d : deaths) message += (message.empty() ? "" : "; ") + d;
    message += " during the capture: an artifact of it would not restore, so nothing was committed";
    if (cause != nullptr) message += std::string(" (then: ") + cause->what() + ")";
    death_reported_ = true;
    if (tier_drained_) {
      // The drain took the memory tier's GPU memory away at the pause: a thread that runs GPU
      // work after it reads memory that is not there (CUDA_ERROR_ILLEGAL_ADDRESS), the likeliest
      // death of a tier workload here (docs/handshake.md, "No GPU work during a tier pause").
      throw Error(ErrorKind::kNotCapturable,
                  message + "; its memory tier had been drained at the pause: most likely GPU "
                            "work it ran after the pause found that memory gone",
                  "hold the workload's GPU work at the pause: wrap each section that launches "
                  "GPU work in the handshake's gpu_work() (docs/handshake.md, 'No GPU work "
                  "during a tier pause'); gpusnap left the rest of the workload as it was");
    }
    throw Error(ErrorKind::kNotCapturable, message,
                "gpusnap left the rest of the workload as it was, not stopped; the kernel log "
                "(dmesg) says where it faulted; frameworks that die at the driver's checkpoint, "
                "and the settings that avoid it: docs/compatibility.md");
  }

  // Throws as require_alive() does if a process of the tree dies before `until`.
  void watch_for_deaths(engine::DeathWatch& watch, const Error* cause,
                        std::chrono::steady_clock::time_point until) {
    for (;;) {
      require_alive(watch, cause);
      if (std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(kSettlePoll);
    }
  }

  // Phase settle: the driver's checkpoint returned at gpu.checkpointed(); a process that cannot
  // live without its GPU memory dies within moments of running on without it (before CRIU
  // freezes it, and once thawed). Then every CUDA process's GPU state must be where the capture
  // left it: back and running (--leave-running) or checkpointed, awaiting the stop. Only what is
  // left of the moment is waited for here: the phases since the checkpoint count.
  void settle(engine::DeathWatch& watch, const engine::GpuCheckpoint& gpu) {
    watch_for_deaths(watch, nullptr, gpu.checkpointed() + kSettle);
    gpu.require_settled();
  }

  int io_threads() const {
    return options_.io_threads > 0
               ? options_.io_threads
               : std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
  }

  void preflight(gpu::Driver& driver, const std::vector<proc::Process>& tree,
                 const std::vector<pid_t>& cuda, const engine::HostImageCapture& images,
                 const artifact::ArtifactWriter& writer) {
    engine::refuse_uncapturable(tree);
    for (const auto& p : tree) {
      if (p.state == 'Z') {
        throw Error(ErrorKind::kNotCapturable,
                    "process " + std::to_string(p.pid) + " (" + p.comm + ") is a zombie",
                    "let its parent reap it, then try again");
      }
    }
    engine::refuse_unsafe_nccl(tree, cuda);
    // The specific cause before the general one: a preallocating JAX process also asks for
    // more room than there is, but no room would make it capturable.
    engine::refuse_xla_preallocation(tree, cuda);
    refuse_without_room(driver, tree, cuda, images.direct(), writer.staging());
  }

  // CRIU's dump, its arguments given by the features (the host images' external files).
  void dump(engine::CaptureGuard& guard, const criu::Binary& criu,
            const artifact::ArtifactWriter& writer, const Manifest& manifest) {
    auto log = writer.staging() / "logs" / "criu-dump.log";
    std::filesystem::create_directories(log.parent_path());
    auto status = guard.dump(
        dump_argv(criu, {options_.pid, writer.criu_dir(), log, manifest.shell_job,
                         options_.ghost_limit, engine::HostImageCapture::criu_keys(manifest)}),
        log.parent_path() / "criu-dump.out");
    if (!status.ok()) fail_dump(status, log);
  }

  // Refuses, before anything is frozen, a capture the host has no memory or store space for
  // (GPU bytes per process from NVML). Without NVML's per-process figures nothing is known, and
  // nothing refused.
  void refuse_without_room(gpu::Driver& driver, const std::vector<proc::Process>& tree,
                           const std::vector<pid_t>& cuda, const std::set<pid_t>& direct,
                           const std::filesystem::path& store) {
    engine::CaptureRoom room;
    for (const auto& p : tree) room.cpu_bytes += p.rss_bytes;
    if (!cuda.empty() && driver.available()) {
      bool seen = false;
      for (const auto& u : driver.usage()) {
        if (std::find(cuda.begin(), cuda.end(), u.host_pid) == cuda.end()) continue;
        seen = true;
        room.gpu_bytes += u.bytes;
        if (direct.count(u.host_pid) == 0) room.copied_gpu_bytes += u.bytes;
      }
      if (!seen) {
        phases_.reporter().note(
            "NVML shows no GPU memory for the CUDA processes: the host memory and store space "
            "the capture needs were not checked");
        return;
      }
    }
    engine::measure_host(room, store);
    room.store = store.parent_path();  // the staging directory's name means nothing to a user
    engine::refuse_without_room(room);
  }

  std::vector<proc::Process> resolve() {
    if (options_.container) {
      target_ = container::capture_target(*options_.container);
      options_.pid = target_->root;
    }
    engine::refuse_bad_root(options_.pid);
    return proc::read_tree(options_.pid);
  }

  Manifest describe(const std::vector<proc::Process>& tree, const criu::Binary& criu) {
    Manifest m;
    m.id = fs::random_id();
    m.created = utc::now();
    m.gpusnap_version = GPUSNAP_VERSION;
    m.source_pid = options_.pid;
    m.source_cmdline = tree.front().cmdline;
    m.host = HostFacts::probe(criu.version);
    m.shell_job = engine::uses_terminal(tree);
    auto internal = proc::pipes_within(tree);
    for (const auto& p : tree) m.processes.push_back(record_of(p, internal));
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
    return {helper_binary(), "__container-exec", container::to_json(enter)};
  }

  [[noreturn]] void fail_dump(const common::ExitStatus& status, const std::filesystem::path& log) {
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
  Phases phases_;
  bool death_reported_ = false;  // require_alive() threw: the error already names the deaths
  bool tier_drained_ = false;    // the pause drained a memory tier into the staging directory
  // Files hashed before the seal (host images while written, the memory tier's in the
  // background): seal need not read them.
  std::vector<FileRecord> hashed_files_;
  std::unique_ptr<gpu::Driver> owned_driver_;  // outlives the features, which use it
};

}  // namespace

CheckpointResult checkpoint(const CheckpointOptions& options, Reporter& reporter) {
  return Checkpoint(options, reporter).run();
}

}  // namespace gpusnap
