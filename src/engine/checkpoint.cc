// The checkpoint flow. Each step is a named, timed phase; the order is the contract:
//
//   resolve      read the process tree from /proc (of a container: find it through runc)
//   preflight    refuse what CRIU cannot capture, or what the host has no memory or store
//                space for, before anything is frozen
//   pause        (workloads speaking the handshake) finish in-flight work, release the KV cache
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
// A failure in any phase leaves the source running as before and nothing at the output path.
// A process of the tree that dies after the pause and before the commit fails the capture, whatever
// phase notices it, with the error naming the process and how it died (engine/death_watch.h).
#include <signal.h>
#include <sys/stat.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "artifact/writer.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/utc.h"
#include "container/enter.h"
#include "container/mount.h"
#include "container/runc.h"
#include "criu/criu.h"
#include "criu/kernel_cache.h"
#include "engine/capture_lock.h"
#include "engine/death_watch.h"
#include "engine/dump_guard.h"
#include "engine/gpu_state.h"
#include "engine/handshake.h"
#include "engine/host_images.h"
#include "engine/preflight.h"
#include "engine/preload.h"
#include "engine/tier_files.h"
#include "gpu/driver.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/error.h"

namespace gpusnap {

namespace {

// How long the preload library's helpers may go on populating after the driver's checkpoint
// returns. They work ahead of the driver's copy, so they normally finish before it; this only
// bounds a starved machine.
constexpr std::chrono::milliseconds kFillThreadsLimit{30000};
// How long a capture watches its CUDA processes after CRIU thawed them, before it commits. A
// process that cannot run without its GPU memory (a thread touching device memory outside any
// CUDA call) faults as soon as it runs again; on the H200 JAX with preallocation died within
// this (docs/compatibility.md).
// The death watch's moment after the driver's checkpoint. A capture's own phases after the
// checkpoint (host images, dump, hashing) take 0.3 s at 16 GiB on the H200, more beyond: the
// moment costs a capture little wait of its own. (JAX with preallocation died about a second
// after the checkpoint; it is refused before anything is frozen, engine/preflight.h.)
constexpr std::chrono::milliseconds kSettle{300};
// After a failure: how long a dying process is given to finish dying (a core dump takes a
// while), so that the error names the death rather than what it broke first.
constexpr std::chrono::milliseconds kDyingGrace{500};
constexpr std::chrono::milliseconds kSettlePoll{20};

// A folder of gpusnap's own for one capture (0700, in a folder that exists), removed with
// everything in it when the capture ends, however it ends. A killed gpusnap leaves it; the
// guardian removes the requests in it (engine/dump_guard.h), so what stays is an empty folder.
class CaptureFolder {
 public:
  explicit CaptureFolder(std::filesystem::path path) : path_(std::move(path)) {
    if (::mkdir(path_.c_str(), 0700) != 0) throw sys_error("create " + path_.string(), errno);
  }
  CaptureFolder(const CaptureFolder&) = delete;
  CaptureFolder& operator=(const CaptureFolder&) = delete;
  ~CaptureFolder() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

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
  // Where its memory tier drained to ("" if nowhere): the resume fills from there, so the
  // staging directory must outlive this object (it does: the writer is declared first).
  void set_tier_dir(nlohmann::json dir) { tier_dir_ = std::move(dir); }
  void resume() {
    done_ = true;
    handshake_.clear_exchange();
    handshake_.resume(pid_,
                      {{"restored", false},
                       {"copy", 0},
                       {"copies", 1},
                       {"artifact_id", artifact_id_},
                       {"gpu_map", nlohmann::json::object()},
                       {"settings", nlohmann::json::object()},
                       {"tier_dir", tier_dir_}},
                      timeout_);
    handshake_.clear_exchange();
  }
  // The source is about to be stopped: it is not asked to resume.
  void commit() {
    done_ = true;
    handshake_.clear_exchange();
  }

 private:
  engine::Handshake handshake_;
  pid_t pid_;
  std::chrono::milliseconds timeout_;
  Reporter& reporter_;
  std::string artifact_id_;
  nlohmann::json tier_dir_ = "";
  bool done_ = false;
};

class Checkpoint {
 public:
  Checkpoint(const CheckpointOptions& options, Reporter& reporter)
      : options_(options), phases_(reporter) {}

  CheckpointResult run() {
    auto criu = criu::locate(options_.criu_path);
    criu::keep_kernel_cache(criu);  // CRIU starts 0.06-0.08 s sooner with it
    gpu::Driver& driver = gpu::given_or_nvidia(options_.driver, owned_driver_);
    for (const auto& line : engine::recover_abandoned(driver, options_.run_dir)) {
      phases_.reporter().note(line);
    }
    artifact::ArtifactWriter writer(options_.output, {options_.artifact_group, options_.run_dir});
    auto tree = phases_.run("resolve", [&] { return resolve(); });
    std::vector<pid_t> pids;
    for (const auto& p : tree) pids.push_back(p.pid);
    const engine::CaptureLock capture_lock(options_.run_dir, pids);
    auto cuda = engine::cuda_processes(driver, tree);
    // Which CUDA processes get their GPU memory written straight into the artifact.
    std::set<pid_t> direct;
    if (options_.host_images && options_.direct_host_images) {
      for (pid_t pid : cuda) {
        if (engine::direct_capture_possible(pid, common::read_mappings(pid), target_.has_value()))
          direct.insert(pid);
      }
    }
    // Where this capture leaves the preload library its requests: a container's processes reach
    // them and their files through mounts, made before the room is reckoned (without them, that
    // memory is copied).
    const auto requests_dir = target_ && !direct.empty()
                                  ? reach_from_container(writer, direct)
                                  : options_.run_dir / engine::kPreloadRequestsDir;
    phases_.run("preflight", [&] {
      preflight(tree);
      engine::refuse_unsafe_nccl(tree, cuda);
      // The specific cause before the general one: a preallocating JAX process also asks for
      // more room than there is, but no room would make it capturable.
      engine::refuse_xla_preallocation(tree, cuda);
      refuse_without_room(driver, tree, cuda, direct, writer.staging());
    });
    Manifest manifest = describe(tree, criu);

    // From here on the workload is changed (paused, its GPU state moved): the guardian undoes
    // that even if gpusnap dies. Declared before the objects that roll back in-process, so that
    // on a failure it comes last and finds nothing left to do.
    std::optional<engine::CaptureGuard> guard;
    // A container's workload drains its tier through this mount; it outlives the pause, whose
    // resume (or rollback) fills back through it.
    std::optional<container::MountInside> tier_mount;
    std::optional<PausedWorkload> paused;
    std::optional<engine::GpuCapture> gpu;
    std::optional<engine::TierChecksums> tier_sums;  // stopped first on a failure
    engine::DeathWatch watch(tree);
    auto handshake = find_handshake();
    std::vector<std::filesystem::path> requests;
    requests.reserve(direct.size());
    for (pid_t pid : direct) requests.push_back(engine::preload_request_path(requests_dir, pid));
    guard.emplace(options_.helper_binary.empty() ? "/proc/self/exe" : options_.helper_binary,
                  writer.staging(), cuda, handshake ? handshake->dir() : std::filesystem::path(),
                  requests, capture_lock.fd());
    // A death during the pause is the handshake's to report: it names it already.
    if (handshake) {
      phases_.run("pause", [&] {
        // The memory tier, if the workload has one, drains into STAGING/tier (engine/tier_files.h).
        const auto tier_dir = engine::make_tier_dir(writer.staging(), options_.pid);
        const auto tier_path = reachable_tier_dir(tier_dir, tier_mount);
        pause(*handshake, {{"tier_dir", tier_path.string()}});
        paused.emplace(std::move(*handshake), options_.pid, options_.handshake_timeout,
                       phases_.reporter());
        tier_ = engine::check_tier_dir(tier_dir);
        paused->set_tier_dir(engine::tier_member(tier_dir).get<std::string>().empty()
                                 ? std::string()
                                 : tier_path.string());
      });
      manifest.control_dir = control_dir_.string();
    } else {
      phases_.reporter().note("capturing pid " + std::to_string(options_.pid) +
                              " as it runs: it does not speak the workload handshake");
    }
    // When the driver's checkpoint returned: from then on a process may notice its GPU memory
    // gone, and the settle moment counts from there.
    auto checkpointed = std::chrono::steady_clock::now();
    std::map<pid_t, std::vector<common::Mapping>> maps_before;
    std::vector<std::unique_ptr<engine::DirectHostImage>> direct_images;
    std::optional<engine::HashedFiles> hashing;
    try {
      if (!cuda.empty()) {
        phases_.run("gpu-facts", [&] {
          describe_gpu(driver, cuda, manifest);
          for (pid_t pid : cuda) maps_before[pid] = common::read_mappings(pid);
        });
        note_processes_without_preload(maps_before);
        gpu.emplace(driver, cuda, options_.gpu_lock_timeout, options_.run_dir, phases_.reporter());
        phases_.run("gpu-lock", [&] { gpu->lock_all(); });
        phases_.run("gpu-checkpoint", [&] {
          // Just before the driver's call, so that no other mapping of the process takes it.
          for (pid_t pid : direct) {
            direct_images.push_back(std::make_unique<engine::DirectHostImage>(
                pid, writer.staging(), requests_dir, phases_.reporter(),
                images_mount_ ? images_mount_->path() : std::filesystem::path()));
          }
          {
            std::vector<std::filesystem::path> files;
            for (const auto& d : direct_images) {
              if (!d->file().empty()) files.push_back(d->file());
            }
            const engine::WriteBehind write_behind(files);
            gpu->checkpoint_all();
          }
          checkpointed = std::chrono::steady_clock::now();
          for (auto& d : direct_images) d->withdraw();
          // The preload library may still be populating a region ahead of the driver's copy;
          // it must be done before the region is copied, moved or dumped.
          for (pid_t pid : engine::wait_for_fill_threads(cuda, kFillThreadsLimit)) {
            if (direct.count(pid) > 0) {
              throw Error(ErrorKind::kTimeout,
                          "process " + std::to_string(pid) + ": " + engine::kPreloadFileName +
                              " was still populating its GPU state's memory after " +
                              std::to_string(kFillThreadsLimit.count()) + " ms",
                          "try again on a less loaded machine, or with --no-direct-host-images");
            }
            maps_before.erase(pid);  // its region stays with CRIU
            phases_.reporter().note(
                "process " + std::to_string(pid) + ": " + engine::kPreloadFileName +
                " was still populating its GPU state's host memory after " +
                std::to_string(kFillThreadsLimit.count()) + " ms; that memory is left to CRIU");
          }
        });
        if (options_.host_images) {
          phases_.run("host-images", [&] {
            std::vector<HostImageRecord> written;
            for (auto& d : direct_images) {
              if (auto rec = d->adopt(writer.staging(), phases_.reporter())) {
                written.push_back(*rec);
              }
            }
            // The files are complete once the driver's call has returned: they are hashed
            // while the regions are made private and while CRIU dumps.
            if (!written.empty()) {
              hashing.emplace(writer.staging(), written, manifest.chunk_bytes, io_threads());
            }
            for (auto& d : direct_images) d->make_private(phases_.reporter());
            manifest.host_images = written;
            store_host_images(maps_before, writer, manifest);
          });
        }
      }

      // The tier's files, complete since the pause, are hashed beside CRIU's dump, which needs
      // one core; not beside the driver's checkpoint, which that slowed by 0.15 s on the H200
      // (docs/benchmarks.md, exp33, exp34). The dump takes 0.1 s longer beside them: a source
      // that runs on (--leave-running) is not kept paused for that, and its tier's files are
      // read after it resumed, in the checksum phase.
      if (tier_.files > 0 && !options_.leave_running) {
        tier_sums.emplace(writer.staging() / engine::kTierDirName, manifest.chunk_bytes,
                          io_threads());
      }
      auto log = writer.staging() / "logs" / "criu-dump.log";
      std::filesystem::create_directories(log.parent_path());
      phases_.run("dump", [&] {
        auto status =
            guard->dump(dump_argv(criu, {options_.pid, writer.criu_dir(), log, manifest.shell_job,
                                         options_.ghost_limit,
                                         engine::criu_external_keys(manifest.host_images)}),
                        log.parent_path() / "criu-dump.out");
        if (!status.ok()) fail_dump(status, log);
      });
      // The source waits for nothing more: its GPU state goes back before the bookkeeping.
      if (gpu && options_.leave_running) phases_.run("gpu-resume", [&] { gpu->resume_all(); });
      if (paused && options_.leave_running) {
        paused->set_artifact_id(manifest.id);
        phases_.run("resume", [&] { paused->resume(); });
        tier_mount.reset();  // filled back: the workload reads the folder no more
      }
      if (hashing) {
        phases_.run("host-images-hash", [&] {
          auto files = hashing->join(manifest.host_images);
          hashed_files_.insert(hashed_files_.end(), files.begin(), files.end());
        });
      }
      if (tier_sums) {
        phases_.run("tier-hash", [&] {
          auto files = tier_sums->join();
          hashed_files_.insert(hashed_files_.end(), files.begin(), files.end());
        });
      }
      if (target_) container::use_namespace_pids(manifest);
      manifest.checkpoint_phases = phases_.timings();
      writer.seal(manifest, phases_, hashed_files_);
      if (gpu) phases_.run("settle", [&] { settle(watch, driver, gpu->pids(), checkpointed); });
      // Last look before the artifact becomes visible.
      require_alive(watch, nullptr);
    } catch (const Error& e) {
      // A dying process often shows first as a CRIU or driver error about a missing pid, while
      // the kernel is still ending it (a core dump takes a while): give its death the time the
      // settle phase gives, so that the error names the cause.
      if (!death_reported_) {
        // gpusnap's own rollback kills a process the driver marked FAILED: not a death to report.
        if (gpu) {
          for (pid_t pid : gpu->killed()) watch.forget(pid);
        }
        watch_for_deaths(watch, &e, std::chrono::steady_clock::now() + kDyingGrace);
      }
      throw;
    }
    // The manifest records its own phases up to the commit; the commit itself is reported.
    manifest.checkpoint_phases = phases_.timings();
    writer.commit(manifest, phases_);
    if (!options_.leave_running) {
      if (gpu) gpu->commit();
      if (paused) paused->commit();
      phases_.run("stop", [&] { stop_tree(tree); });
    }
    guard->commit();
    return {writer.final_path(), std::move(manifest), phases_.timings(), paused.has_value()};
  }

 private:
  // Asks the workload to pause and says what it gave back, where it says so.
  void pause(engine::Handshake& handshake, const nlohmann::json& members) {
    auto answer = handshake.pause(options_.pid, options_.handshake_timeout, members);
    auto released = answer.find("released_bytes");
    if (released != answer.end() && released->is_number_unsigned() &&
        released->get<uint64_t>() > 0) {
      phases_.reporter().note("the workload released " +
                              fs::human_bytes(released->get<uint64_t>()) + " (" +
                              std::to_string(released->get<uint64_t>()) +
                              " bytes) of cached free GPU memory at the pause: it is not captured");
    }
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

  // Phase settle: the driver's checkpoint returned at `checkpointed`; a process that cannot live
  // without its GPU memory dies within moments of running on without it (before CRIU freezes it,
  // and once thawed). Then every CUDA process's GPU state must be where the capture left it:
  // back and running (--leave-running) or checkpointed, awaiting the stop. Only what is left of
  // the moment is waited for here: the phases since the checkpoint count.
  void settle(engine::DeathWatch& watch, gpu::Driver& driver, const std::vector<pid_t>& cuda,
              std::chrono::steady_clock::time_point checkpointed) {
    watch_for_deaths(watch, nullptr, checkpointed + kSettle);
    auto expected =
        options_.leave_running ? gpu::ProcessState::kRunning : gpu::ProcessState::kCheckpointed;
    for (pid_t pid : cuda) {
      auto state = driver.state(pid);
      if (state == expected) continue;
      throw Error(ErrorKind::kGpu,
                  "the driver reports process " + std::to_string(pid) + "'s GPU state " +
                      gpu::state_name(state) + " after the dump, not " + gpu::state_name(expected) +
                      ": it cannot be carried, so nothing was committed",
                  "gpusnap left the workload as it was, not stopped; see the driver's messages "
                  "in the kernel log (dmesg)");
    }
  }

  // The tier's folder as the workload reaches it. A container's workload sees its own mounts
  // only: the folder is mounted into its handshake directory (container/mount.h). Where that
  // cannot be done, the host's path, which reaches the folder only when the container mounts the
  // staging directory's volume at the same path; where it does not, the tier says so and its
  // memory goes with the driver's checkpoint: slower, never wrong.
  std::filesystem::path reachable_tier_dir(const std::filesystem::path& tier_dir,
                                           std::optional<container::MountInside>& mount) {
    if (!target_) return tier_dir;
    try {
      mount.emplace(options_.pid, tier_dir, control_dir_ / engine::kTierMountName, false);
      return mount->path();
    } catch (const Error& e) {
      phases_.reporter().note(std::string("memory tier: ") + e.what());
      return tier_dir;
    }
  }

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

  void describe_gpu(gpu::Driver& driver, const std::vector<pid_t>& cuda, Manifest& manifest) {
    if (!driver.available()) {
      throw Error(ErrorKind::kEnvironment,
                  "process " + std::to_string(cuda.front()) +
                      " uses the GPU, but the NVIDIA driver cannot be loaded: " + driver.reason(),
                  "run gpusnap where libcuda.so.1 and libnvidia-ml.so.1 can be loaded");
    }
    manifest.gpu = engine::describe_gpu_state(driver, cuda);
    engine::add_tier_memory(manifest.gpu, options_.pid, tier_);
    for (const auto& p : manifest.gpu->processes) {
      for (auto& rec : manifest.processes) {
        if (rec.pid == p.pid) rec.gpu_bytes = p.bytes;
      }
    }
  }

  int io_threads() const {
    return options_.io_threads > 0
               ? options_.io_threads
               : std::max(4, static_cast<int>(std::thread::hardware_concurrency()));
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

  // Each CUDA process's new host memory into files of the artifact, one process at a time,
  // each with every I/O thread.
  void store_host_images(const std::map<pid_t, std::vector<common::Mapping>>& before,
                         const artifact::ArtifactWriter& writer, Manifest& manifest) {
    engine::HostImageOptions o;
    o.threads = io_threads();
    o.chunk_bytes = manifest.chunk_bytes;
    o.file_bytes = options_.host_image_file_bytes;
    if (target_ && !before.empty()) o.visible_dir = container_host_images_dir(writer);
    for (const auto& [pid, maps] : before) {
      auto ranges = engine::new_anonymous_ranges(maps, common::read_mappings(pid),
                                                 engine::kMinHostImageBytes);
      auto stored = engine::store_host_images(pid, ranges, writer.staging(), o, phases_.reporter());
      manifest.host_images.insert(manifest.host_images.end(), stored.images.begin(),
                                  stored.images.end());
      hashed_files_.insert(hashed_files_.end(), stored.files.begin(), stored.files.end());
    }
    if (!manifest.host_images.empty() && engine::on_tmpfs_without_huge_pages(writer.staging())) {
      phases_.reporter().note(
          "the artifact is on a tmpfs without huge pages: its host images are written and mapped "
          "4 KiB at a time; a tmpfs mounted with huge=within_size stores and restores them "
          "faster (docs/benchmarks.md)");
    }
  }

  // A container's processes open their host images through a mount of the folder in their /tmp:
  // kept until the capture ends, as CRIU's dump finds the files through it. Read-only, unless
  // the driver writes into them there (reach_from_container()). "" (with a note) when it cannot
  // be made: that memory then goes through CRIU's pages, as before.
  std::filesystem::path container_host_images_dir(const artifact::ArtifactWriter& writer,
                                                  bool read_only = true) {
    if (images_mount_) return images_mount_->path();
    const auto dir = writer.staging() / engine::kHostImageDir;
    try {
      std::filesystem::create_directories(dir);
      images_mount_.emplace(options_.pid, dir, engine::kContainerHostImageMount, read_only);
      return images_mount_->path();
    } catch (const std::exception& e) {
      phases_.reporter().note(std::string("host images: ") + e.what());
      return {};
    }
  }

  // The driver's memory of a container's processes straight into the artifact, as on the host:
  // the library in them looks for its request at kContainerPreloadRequests (`gpusnap init` set
  // that), where a folder of this capture's own is mounted read-only, holding their requests
  // alone (another capture's, or a request for a process elsewhere, are never in their reach);
  // the file a request names is in the host-images folder, mounted writable for the driver's
  // write. That folder is the staging directory's: what a process of the container could put
  // there lands in its own artifact, listed and checksummed, and reaches nothing else. Returns
  // the requests' folder; without either mount, `direct` is emptied (with a note) and that
  // memory is copied after the driver's call.
  std::filesystem::path reach_from_container(const artifact::ArtifactWriter& writer,
                                             std::set<pid_t>& direct) {
    auto fallback = [&](const std::string& why) {
      phases_.reporter().note("the driver's memory of the container's processes is copied into "
                              "the artifact after its checkpoint: " +
                              why);
      direct.clear();
      requests_mount_.reset();
      requests_folder_.reset();
      return options_.run_dir / engine::kPreloadRequestsDir;
    };
    try {
      // Root's only, as DirectHostImage makes it for the host's workloads.
      const auto requests_root = options_.run_dir / engine::kPreloadRequestsDir;
      std::filesystem::create_directories(options_.run_dir);
      if (::mkdir(requests_root.c_str(), 0700) != 0 && errno != EEXIST) {
        throw sys_error("create " + requests_root.string(), errno);
      }
      requests_folder_.emplace(requests_root / ("container-" + fs::random_id().substr(0, 12)));
      requests_mount_.emplace(options_.pid, requests_folder_->path(),
                              engine::kContainerPreloadRequests, true);
    } catch (const std::exception& e) {
      return fallback(e.what());
    }
    if (container_host_images_dir(writer, false).empty()) return fallback("no host-images mount");
    return requests_folder_->path();
  }

  // The driver's checkpoint of a process started without libgpusnap-preload.so populates its
  // host memory in one thread: said once, with the way out.
  void note_processes_without_preload(const std::map<pid_t, std::vector<common::Mapping>>& maps) {
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
    return {options_.helper_binary.empty() ? "/proc/self/exe" : options_.helper_binary,
            "__container-exec", container::to_json(enter)};
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
  std::filesystem::path control_dir_;  // the workload's, as it names it
  Phases phases_;
  bool death_reported_ = false;  // require_alive() threw: the error already names the deaths
  // Files hashed before the seal (host images while written, the memory tier's in the
  // background): seal need not read them.
  std::vector<FileRecord> hashed_files_;
  engine::TierContents tier_;  // what the workload's memory tier drained at the pause
  // A container's host-images folder mounted into it (container_host_images_dir()), and this
  // capture's preload requests with their mount (reach_from_container()); the mounts go first.
  std::optional<CaptureFolder> requests_folder_;
  std::optional<container::MountInside> requests_mount_;
  std::optional<container::MountInside> images_mount_;
  std::unique_ptr<gpu::Driver> owned_driver_;
};

}  // namespace

CheckpointResult checkpoint(const CheckpointOptions& options, Reporter& reporter) {
  return Checkpoint(options, reporter).run();
}

}  // namespace gpusnap
