#include "engine/gpu_state.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "artifact/writer.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/worker_pool.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

using nlohmann::json;

namespace {

// Runs fn(pid) for every pid on its own thread; rethrows the first failure after all finish.
// The driver's calls for different processes are independent, and a checkpoint or restore of
// one process is a long copy: running them side by side is what makes several GPUs fast.
template <class Fn>
void for_each_parallel(const std::vector<pid_t>& pids, Fn fn) {
  common::run_workers(pids.size(), [&](std::size_t k, const std::atomic<bool>&) {
    try {
      fn(pids[k]);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(ErrorKind::kGpu, e.what());
    }
  });
}

std::filesystem::path journal_dir(const std::filesystem::path& run_dir) {
  return run_dir / "journal";
}

}  // namespace

std::vector<pid_t> cuda_processes(gpu::Driver& driver, const std::vector<proc::Process>& tree) {
  std::vector<pid_t> pids;
  for (const auto& p : tree) {
    if (driver.uses_gpu(p.pid)) pids.push_back(p.pid);
  }
  return pids;
}

// The GPUs a CUDA process can see: all of the host's, unless CUDA_VISIBLE_DEVICES narrows
// them (indexes or full UUIDs; the first CUDA process's setting stands for the tree).
std::set<std::string> visible_gpus(const gpu::DriverFacts& facts, const std::vector<pid_t>& pids) {
  std::set<std::string> all;
  for (const auto& g : facts.gpus) all.insert(g.uuid);
  if (pids.empty()) return all;
  const auto setting = proc::environment_value(pids.front(), "CUDA_VISIBLE_DEVICES");
  if (!setting) return all;
  const std::string& value = *setting;
  std::set<std::string> chosen;
  for (size_t start = 0; start <= value.size();) {
    auto comma = std::min(value.find(',', start), value.size());
    auto item = value.substr(start, comma - start);
    for (const auto& g : facts.gpus) {
      if (item == g.uuid || item == std::to_string(g.index)) chosen.insert(g.uuid);
    }
    start = comma + 1;
  }
  return chosen.empty() ? all : chosen;
}

GpuFacts describe_gpu_state(gpu::Driver& driver, const std::vector<pid_t>& pids) {
  auto facts = driver.facts();
  auto usage = driver.usage();
  GpuFacts out;
  out.driver_version = facts.driver_version;
  out.cuda_driver_version = facts.cuda_driver_version;
  std::set<std::string> used;
  for (pid_t pid : pids) {
    GpuProcessRecord rec;
    rec.pid = pid;
    for (const auto& u : usage) {
      if (u.host_pid != pid) continue;
      rec.gpus.push_back({u.gpu_uuid, u.bytes});
      rec.bytes += u.bytes;
      used.insert(u.gpu_uuid);
    }
    out.processes.push_back(std::move(rec));
  }
  // Every GPU the processes can see is recorded, used or not: the driver's restore onto other
  // GPUs takes a map of all of them (a permutation), not only of those holding memory.
  // Without per-process usage (NVML cannot always see processes in other namespaces), every
  // visible GPU counts as used: the checks at restore then err on the safe side.
  auto visible = visible_gpus(facts, pids);
  for (const auto& g : facts.gpus) {
    if (!visible.count(g.uuid)) continue;
    out.gpus.push_back({g.index, used.empty() || used.count(g.uuid) > 0, g.uuid, g.name, g.bus_id,
                        std::to_string(g.cc_major) + "." + std::to_string(g.cc_minor),
                        g.memory_total});
  }
  return out;
}

std::vector<std::string> return_to_running(gpu::Driver& driver, const std::vector<pid_t>& pids,
                                           std::vector<pid_t>* killed) noexcept {
  std::vector<std::string> log;
  for (pid_t pid : pids) {
    try {
      if (!proc::exists(pid)) continue;
      auto state = driver.state(pid);
      if (state == gpu::ProcessState::kCheckpointed) {
        driver.restore(pid, {});
        state = driver.state(pid);
        log.push_back("restored the GPU state of process " + std::to_string(pid));
      }
      if (state == gpu::ProcessState::kLocked) {
        driver.unlock(pid);
        log.push_back("unlocked process " + std::to_string(pid));
      }
      if (driver.state(pid) == gpu::ProcessState::kFailed) {
        ::kill(pid, SIGKILL);
        if (killed != nullptr) killed->push_back(pid);
        log.push_back("process " + std::to_string(pid) +
                      " was marked FAILED by the driver and has been killed");
      }
    } catch (const std::exception& e) {
      log.push_back("process " + std::to_string(pid) +
                    " could not be returned to RUNNING: " + e.what());
    }
  }
  return log;
}

namespace {

// Returns the processes of every journal entry whose owner `recover_owner` accepts to RUNNING,
// and removes the entry. Each action is reported after `prefix`; an unreadable entry only when
// `report_unreadable`.
std::vector<std::string> recover_entries(gpu::Driver& driver, const std::filesystem::path& run_dir,
                                         const std::function<bool(pid_t)>& recover_owner,
                                         const std::string& prefix,
                                         bool report_unreadable) noexcept {
  std::vector<std::string> log;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(journal_dir(run_dir), ec)) {
    try {
      auto doc = json::parse(fs::read_file(entry.path()));
      if (!recover_owner(doc.at("owner").get<pid_t>())) continue;
      if (driver.available()) {
        for (auto& line : return_to_running(driver, doc.at("pids").get<std::vector<pid_t>>())) {
          log.push_back(prefix + line);
        }
      }
      std::filesystem::remove(entry.path(), ec);
    } catch (const std::exception& e) {
      if (report_unreadable) {
        log.push_back("journal entry " + entry.path().string() + " unreadable: " + e.what());
      }
    }
  }
  for (auto& line : artifact::ArtifactWriter::remove_abandoned_staging(run_dir))
    log.push_back(line);
  return log;
}

}  // namespace

std::vector<std::string> recover_abandoned(gpu::Driver& driver,
                                           const std::filesystem::path& run_dir) noexcept {
  // An owner still alive is at work.
  return recover_entries(
      driver, run_dir, [](pid_t owner) { return !proc::exists(owner); },
      "recovered after a killed gpusnap: ", true);
}

std::vector<std::string> recover_entries_of(gpu::Driver& driver,
                                            const std::filesystem::path& run_dir,
                                            pid_t owner) noexcept {
  return recover_entries(
      driver, run_dir, [owner](pid_t o) { return o == owner; }, "", false);
}

GpuCapture::GpuCapture(gpu::Driver& driver, std::vector<pid_t> pids,
                       std::chrono::milliseconds lock_timeout, const std::filesystem::path& run_dir,
                       Reporter& reporter)
    : driver_(driver), pids_(std::move(pids)), lock_timeout_(lock_timeout), reporter_(reporter) {
  // Written before the first lock: from here until done, a killed gpusnap is repairable.
  // One entry per capture (an agent may run several at once), naming only the processes this
  // capture has moved away from RUNNING, so a recovery never touches another capture's.
  std::filesystem::create_directories(journal_dir(run_dir));
  journal_ = journal_dir(run_dir) /
             (std::to_string(::getpid()) + "-" + fs::random_id().substr(0, 8) + ".json");
  write_journal();
}

void GpuCapture::write_journal() {
  fs::write_file_durable(journal_, json{{"owner", ::getpid()}, {"pids", moved_}}.dump());
}

GpuCapture::~GpuCapture() {
  if (!done_) {
    for (const auto& line : return_to_running(driver_, moved_, &killed_)) reporter_.note(line);
  }
  std::error_code ec;
  std::filesystem::remove(journal_, ec);
}

void GpuCapture::fail(const std::exception& error) {
  auto log = return_to_running(driver_, moved_, &killed_);
  done_ = true;
  std::string what = error.what();
  what += log.empty() ? "; no process was left locked" : "; then: " + [&] {
    std::string s;
    for (const auto& l : log) s += (s.empty() ? "" : ", ") + l;
    return s;
  }();
  const auto* e = dynamic_cast<const Error*>(&error);
  throw Error(e ? e->kind() : ErrorKind::kGpu, what, e ? e->hint() : "");
}

void GpuCapture::lock_all() {
  try {
    // A process that is not RUNNING belongs to another checkpoint in flight: leave it be.
    for (pid_t pid : pids_) {
      auto state = driver_.state(pid);
      if (state != gpu::ProcessState::kRunning) {
        throw Error(ErrorKind::kGpu,
                    "process " + std::to_string(pid) + " is " + gpu::state_name(state) +
                        ", not RUNNING: another checkpoint of it is in progress",
                    "wait for it to finish, or run `gpusnap recover --pid " + std::to_string(pid) +
                        "` if no gpusnap is running");
      }
    }
    // One by one, in tree order: each lock waits for that process's submitted work to drain.
    for (pid_t pid : pids_) {
      try {
        driver_.lock(pid, lock_timeout_);
      } catch (...) {
        // A lock that failed half-way is ours to undo too.
        if (driver_.state(pid) != gpu::ProcessState::kRunning) moved_.push_back(pid);
        throw;
      }
      moved_.push_back(pid);
      write_journal();
    }
  } catch (const std::exception& e) {
    fail(e);
  }
}

void GpuCapture::checkpoint_all() {
  try {
    for_each_parallel(pids_, [&](pid_t pid) { driver_.checkpoint(pid); });
  } catch (const std::exception& e) {
    fail(e);
  }
}

void GpuCapture::resume_all() {
  try {
    for_each_parallel(pids_, [&](pid_t pid) {
      driver_.restore(pid, {});
      driver_.unlock(pid);
    });
    done_ = true;
  } catch (const std::exception& e) {
    fail(e);
  }
}

void GpuCapture::commit() { done_ = true; }

namespace {

// Finds a GPU by UUID or by index: among the artifact's (GpuRecord) or this host's (GpuInfo).
template <class Gpu>
const Gpu* find_gpu(const std::vector<Gpu>& gpus, const std::string& key) {
  for (const auto& g : gpus) {
    if (g.uuid == key || std::to_string(g.index) == key) return &g;
  }
  return nullptr;
}

// The driver this host has, refused unless it is the one the artifact was taken with.
gpu::DriverFacts refuse_other_driver(const GpuFacts& source, gpu::Driver& driver) {
  if (!driver.available()) {
    throw Error(ErrorKind::kEnvironment,
                "the artifact holds GPU state but this host has no usable NVIDIA driver: " +
                    driver.reason(),
                "restore it on a host with the NVIDIA driver " + source.driver_version);
  }
  auto facts = driver.facts();
  if (facts.driver_version != source.driver_version) {
    throw Error(ErrorKind::kIncompatible,
                "the artifact was taken with NVIDIA driver " + source.driver_version +
                    ", this host has " + facts.driver_version,
                "restore it on a host with driver " + source.driver_version);
  }
  return facts;
}

// Source GPU uuid -> target GPU uuid, as --gpu-map says: "OLD=NEW" entries, each side a UUID
// or an index.
std::map<std::string, std::string> explicit_map(const std::vector<GpuRecord>& source,
                                                const std::vector<gpu::GpuInfo>& local,
                                                const std::vector<std::string>& map) {
  std::map<std::string, std::string> target;
  for (const auto& entry : map) {
    auto eq = entry.find('=');
    const GpuRecord* from =
        eq == std::string::npos ? nullptr : find_gpu(source, entry.substr(0, eq));
    const gpu::GpuInfo* to =
        eq == std::string::npos ? nullptr : find_gpu(local, entry.substr(eq + 1));
    if (eq == std::string::npos || from == nullptr || to == nullptr) {
      throw Error(ErrorKind::kUsage,
                  "bad --gpu-map entry '" + entry + "': " +
                      (eq == std::string::npos ? "expected OLD=NEW"
                       : from == nullptr ? "no GPU '" + entry.substr(0, eq) + "' in the artifact"
                                         : "no GPU '" + entry.substr(eq + 1) + "' on this host"),
                  "use OLD=NEW with GPU UUIDs or indexes (`gpusnap inspect` lists the "
                  "artifact's GPUs, nvidia-smi -L this host's)");
    }
    target[from->uuid] = to->uuid;
  }
  return target;
}

// Completes `target` for the GPUs the map left out: the same GPU where this host has it, else
// the first free GPU of the same model. GPUs holding memory are placed first; the others the
// process could see then take the remaining GPUs, so that the map given to the driver covers
// every GPU it knows of. Says each move in `notes`.
void place_remaining(const std::vector<GpuRecord>& source, const std::vector<gpu::GpuInfo>& local,
                     std::map<std::string, std::string>& target, std::vector<std::string>& notes) {
  std::set<std::string> taken;
  for (const auto& [from, to] : target) taken.insert(to);
  std::vector<const GpuRecord*> order;
  for (const auto& g : source) {
    if (g.used) order.push_back(&g);
  }
  for (const auto& g : source) {
    if (!g.used) order.push_back(&g);
  }
  for (const GpuRecord* g : order) {
    if (target.count(g->uuid)) continue;
    if (find_gpu(local, g->uuid) != nullptr && !taken.count(g->uuid)) {
      target[g->uuid] = g->uuid;
      taken.insert(g->uuid);
      continue;
    }
    for (const auto& l : local) {
      if (!taken.count(l.uuid) && l.name == g->name) {
        target[g->uuid] = l.uuid;
        taken.insert(l.uuid);
        notes.push_back("GPU " + g->uuid + " maps to " + l.uuid);
        break;
      }
    }
    if (!target.count(g->uuid)) {
      throw Error(
          ErrorKind::kIncompatible,
          "no GPU of model " + g->name + " left on this host for the artifact's GPU " + g->uuid +
              " (the workload saw " + std::to_string(source.size()) + " GPU(s))",
          "restore it on a host with " + std::to_string(source.size()) + " " + g->name + " GPU(s)");
    }
  }
}

// Same model only, and room for every copy's memory on each target GPU.
void check_targets(const GpuFacts& source, const std::vector<gpu::GpuInfo>& local,
                   const std::map<std::string, std::string>& target, int replicas) {
  std::map<std::string, uint64_t> need;
  for (const auto& p : source.processes) {
    for (const auto& u : p.gpus) need[target.at(u.uuid)] += u.bytes;
  }
  for (const auto& g : source.gpus) {
    const gpu::GpuInfo& t = *find_gpu(local, target.at(g.uuid));
    if (t.name != g.name) {
      throw Error(ErrorKind::kIncompatible,
                  "the artifact's GPU " + g.uuid + " is an " + g.name + ", the target " + t.uuid +
                      " is an " + t.name,
                  "map it onto a GPU of the same model");
    }
    uint64_t wanted = need[t.uuid] * static_cast<uint64_t>(replicas);
    if (wanted > t.memory_free) {
      throw Error(ErrorKind::kIncompatible,
                  "GPU " + t.uuid + " has " + fs::human_bytes(t.memory_free) + " free, the " +
                      std::to_string(replicas) + " copy(ies) need " + fs::human_bytes(wanted),
                  "free GPU memory, restore fewer copies, or map onto other GPUs (--gpu-map)");
    }
  }
}

}  // namespace

GpuPlan plan_gpu_restore(const std::optional<GpuFacts>& gpu_facts, gpu::Driver& driver,
                         const std::vector<std::string>& map, int replicas) {
  GpuPlan plan;
  if (!gpu_facts) {
    if (!map.empty()) {
      throw Error(ErrorKind::kUsage, "the artifact holds no GPU state; --gpu-map does not apply",
                  "leave out --gpu-map");
    }
    return plan;
  }
  plan.has_gpu_state = true;
  const auto local = refuse_other_driver(*gpu_facts, driver).gpus;
  auto target = explicit_map(gpu_facts->gpus, local, map);
  place_remaining(gpu_facts->gpus, local, target, plan.notes);
  check_targets(*gpu_facts, local, target, replicas);
  bool identity = std::all_of(target.begin(), target.end(),
                              [](const auto& kv) { return kv.first == kv.second; });
  if (!identity) {
    for (const auto& [from, to] : target) plan.pairs.push_back({from, to});
  }
  return plan;
}

void restore_gpu_processes(gpu::Driver& driver, const std::vector<pid_t>& host_pids,
                           const std::vector<gpu::GpuPair>& pairs) {
  for_each_parallel(host_pids, [&](pid_t pid) {
    driver.restore(pid, pairs);
    driver.unlock(pid);
  });
}

}  // namespace gpusnap::engine
