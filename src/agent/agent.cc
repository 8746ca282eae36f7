#include "agent/agent.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "artifact/writer.h"
#include "common/chunk_memory.h"
#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "common/utc.h"
#include "engine/documents.h"
#include "engine/gpu_state.h"
#include "engine/handshake.h"
#include "gpu/driver.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"
#include "store/reach.h"

namespace gpusnap::agent {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// How long a restarted agent waits for a dead agent's CRIU dump to end before it goes on.
constexpr auto kGuardianWait = std::chrono::minutes(10);

// Records the engine's progress into the operation, under the agent's lock, and keeps the
// journal entry's phase current, so that a recovery can say where the operation stopped.
// Called from two threads at once while a restore's pull still arrives (store/reach.h): the
// restore's and the pull's.
class OperationReporter : public Reporter {
 public:
  OperationReporter(std::mutex& mu, Operation& op, Metrics& metrics, Journal& journal, json entry)
      : mu_(mu), op_(op), metrics_(metrics), journal_(journal), entry_(std::move(entry)) {}

  void phase_started(std::string_view name) override {
    // The journal first: whoever sees the phase in the operation finds it in the journal too.
    {
      std::lock_guard lock(entry_mu_);
      entry_["phase"] = std::string(name);
      try {
        journal_.record(op_.id, entry_);
      } catch (const Error&) {
        // The entry of the previous phase stays: a recovery then names an earlier phase, which
        // changes nothing it does.
      }
    }
    std::lock_guard lock(mu_);
    op_.phases.push_back({std::string(name), 0, false, Clock::now()});
    op_.progress = nullptr;
  }

  void phase_finished(std::string_view name, double seconds) override {
    {
      std::lock_guard lock(mu_);
      // The latest phase of that name still running (names do not repeat today).
      for (auto& phase : op_.phases) {
        if (phase.name == name && !phase.done) {
          phase.done = true;
          phase.seconds = seconds;
        }
      }
      op_.progress = nullptr;
    }
    metrics_.phase(kind_name(op_.kind), std::string(name), seconds);
  }

  void progress(std::string_view name, uint64_t done, uint64_t total) override {
    std::lock_guard lock(mu_);
    op_.progress = {{"phase", std::string(name)}, {"done", done}, {"total", total}};
  }

  void note(std::string_view text) override {
    std::lock_guard lock(mu_);
    op_.notes.emplace_back(text);
  }

 private:
  std::mutex& mu_;
  Operation& op_;
  Metrics& metrics_;
  Journal& journal_;
  std::mutex entry_mu_;  // the entry and its journal file, one writer at a time
  json entry_;
};

// Capture guardians (engine/dump_guard.h) of a staging directory of `storage` whose writer is
// dead. Such a guardian finishes a dump it is running, returns its GPU processes to RUNNING,
// asks a paused workload to resume and exits; recovering the same processes under it would
// race with CRIU.
std::vector<pid_t> orphaned_dump_guardians(const std::filesystem::path& storage) {
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const auto name = e.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    try {
      const auto p = proc::read_process(std::stoi(name));
      if (p.cmdline.size() != 3 || p.cmdline[1] != "__dump-guard") continue;
      const std::filesystem::path staging =
          json::parse(p.cmdline[2]).at("staging").get<std::string>();
      if (staging.parent_path() != storage) continue;
      // The writer holds the staging directory's lock while it lives (artifact/writer.h).
      common::UniqueFd fd(::open(staging.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (fd && ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;
      out.push_back(p.pid);
    } catch (const std::exception&) {
      // Gone while we looked, or not ours to understand: not a guardian we wait for.
    }
  }
  return out;
}

// Staging directories named with this very pid: a previous agent that had our pid (an agent
// that is PID 1 of its container always has) wrote them. Nothing of ours writes yet, so an
// unlocked one is stale. Never throws.
void remove_own_pid_staging(const std::filesystem::path& storage) noexcept {
  const std::string tag = ".staging-" + std::to_string(::getpid()) + "-";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(storage, ec)) {
    const auto name = e.path().filename().string();
    if (name.empty() || name[0] != '.' || name.find(tag) == std::string::npos) continue;
    common::UniqueFd fd(::open(e.path().c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd || ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;
    fs::remove_tree_noexcept(e.path());
  }
}

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

// What the agent says about an operation a dead agent left in its journal, by how far it got.
std::string interrupted_message(const Operation& op, const json& entry) {
  const std::string kind = kind_name(op.kind);
  const std::string name = op.request.value("artifact", op.request.value("reference", "?"));
  const bool was_running = entry.value("state", "") == "running";
  const std::string phase = entry.value("phase", "");
  std::string message = "the agent restarted ";
  if (!was_running) {
    message.append("before the ").append(kind).append(" of ").append(name);
    message.append(" started; nothing was done");
    return message;
  }
  message.append("during the ").append(kind);
  if (op.kind == OperationKind::kCheckpoint) {
    message.append(" of pid ").append(std::to_string(entry.value("pid", 0))).append(" into ");
  } else {
    message.append(" of ");
  }
  message.append(name);
  if (!phase.empty()) message.append(" (phase ").append(phase).append(")");
  if (op.kind == OperationKind::kPrefetch) {
    return message.append("; nothing half-pulled is visible, and the chunks it had fetched stay in "
                          "the node cache");
  }
  if (op.kind == OperationKind::kRestore) {
    return message.append("; copies not yet released ended with it");
  }
  std::error_code ec;
  return message.append(std::filesystem::exists(entry.value("artifact", ""), ec)
                            ? "; the artifact had been committed, but the operation did not "
                              "finish (the source may still be running)"
                            : "; the workload was resumed and nothing was written");
}

// What the pull of a restore or a prefetch did: the result's "pulled" document.
json pulled_document(const store::SnapshotSource& source) {
  const store::PullResult* p = source.pulled();
  return {{"reference", source.reference()},
          {"artifact", source.artifact().string()},
          {"pulled", source.pulls()},
          {"chunks_fetched", p ? p->chunks_fetched : 0},
          {"bytes_fetched", p ? p->bytes_fetched : 0},
          {"chunks_from_cache", p ? p->chunks_from_cache : 0},
          {"bytes_from_cache", p ? p->bytes_from_cache : 0}};
}

// The registry storage's settings, its pushes and pulls counting the chunks they move into
// `counters` (the metrics').
RegistryStorageSettings counted(RegistryStorageSettings settings,
                                std::shared_ptr<store::TransferCounters> counters) {
  settings.counters = std::move(counters);
  return settings;
}

// Adds what a snapshot source's pull found on the node (the cache's hits) and evicted to the
// metrics when the operation is done with the source, whether it succeeded or not. Nothing when
// nothing was pulled, or the pull did not end. What it fetched is counted as it arrives
// (Metrics::transfers).
class PullCounter {
 public:
  PullCounter(Metrics& metrics, const store::SnapshotSource& source)
      : metrics_(metrics), source_(source) {}
  PullCounter(const PullCounter&) = delete;
  PullCounter& operator=(const PullCounter&) = delete;
  ~PullCounter() {
    const store::PullResult* p = source_.pulled();
    if (p == nullptr) return;
    metrics_.pulled({.chunks_found = p->chunks_from_cache,
                     .bytes_found = p->bytes_from_cache,
                     .evicted = p->evicted.size()});
  }

 private:
  Metrics& metrics_;
  const store::SnapshotSource& source_;
};

}  // namespace

Agent::Agent(AgentConfig config)
    : config_(std::move(config)),
      log_(config_.log_format),
      metrics_(config_.remote.has_value()),
      remote_(config_.remote ? std::optional<RegistryStorage>(
                                   std::in_place, counted(*config_.remote, metrics_.transfers()))
                             : std::nullopt),
      journal_(config_.state_dir) {
  if (config_.node.empty()) config_.node = hostname();
  recover();
  gpu_.workers.emplace_back([this](const std::stop_token& stop) { work(gpu_, stop); });
  for (size_t i = 0; i < std::max<size_t>(config_.prefetch_workers, 1); ++i) {
    prefetch_.workers.emplace_back([this](const std::stop_token& stop) { work(prefetch_, stop); });
  }
}

Agent::~Agent() { stop(); }

void Agent::stop() noexcept {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  // Every lane is told first, then each is waited for: a restore may wait for a prefetch's
  // pull (PullClaim), which must go on meanwhile.
  for (Lane* lane : {&gpu_, &prefetch_}) {
    for (auto& worker : lane->workers) worker.request_stop();
    lane->wake.notify_all();
  }
  for (Lane* lane : {&gpu_, &prefetch_}) {
    for (auto& worker : lane->workers) {
      if (worker.joinable()) worker.join();
    }
  }
  // What never started: failed now, so that nobody waits for it and no journal entry outlives
  // the agent for an operation that did nothing.
  std::lock_guard lock(mu_);
  for (Lane* lane : {&gpu_, &prefetch_}) {
    for (const auto& op : lane->queue) {
      op->state = OperationState::kFailed;
      op->finished_at = utc::now(utc::Precision::kMilliseconds);
      op->error =
          error_json(Error(ErrorKind::kInternal,
                           "the agent stopped before this " + std::string(kind_name(op->kind)) +
                               " started; nothing was done",
                           "send the request again"));
      metrics_.failed_without_running(kind_name(op->kind), Error::kind_name(ErrorKind::kInternal));
      log_.operation_finished(*op, op->state, op->error, std::nullopt);
      journal_.erase(op->id);
    }
    lane->queue.clear();
    metrics_.pending(lane->name, 0);
  }
}

json Agent::submit_checkpoint(const json& body) {
  auto request = parse_checkpoint_request(body);
  checkpoint_options(request, config_.engine);     // refuse now what the engine cannot take
  if (remote_) remote_->tag_of(request.artifact);  // and what the registry cannot
  return submit(OperationKind::kCheckpoint, to_json(request));
}

json Agent::submit_restore(const json& body) {
  auto request = parse_restore_request(body);
  restore_options(request, config_.engine);
  if (request.reference) remote("a restore from a reference").check_reference(*request.reference);
  return submit(OperationKind::kRestore, to_json(request));
}

json Agent::submit_prefetch(const json& body) {
  auto request = parse_prefetch_request(body);
  const RegistryStorage& r = remote("a prefetch");
  if (request.reference.empty()) {
    r.tag_of(request.artifact);
  } else {
    r.check_reference(request.reference);
  }
  return submit(OperationKind::kPrefetch, to_json(request));
}

const RegistryStorage& Agent::remote(const std::string& what) const {
  if (!remote_) {
    throw Error(ErrorKind::kUsage, what + " needs registry storage, which this agent has not",
                "start gpusnap-agent with --registry oci://HOST/REPO (chart value "
                "storage.type=oci)");
  }
  return *remote_;
}

json Agent::submit(OperationKind kind, json request) {
  auto op = std::make_shared<Operation>();
  op->id = fs::random_id().substr(0, 16);
  op->kind = kind;
  op->request = std::move(request);
  op->created_at = utc::now(utc::Precision::kMilliseconds);
  std::lock_guard lock(mu_);
  if (stopping_) {
    throw Error(ErrorKind::kEnvironment, "the agent is stopping", "send the request again later");
  }
  Lane& lane = lane_of(kind);
  if (lane.queue.size() >= config_.max_pending) {
    const std::string what =
        kind == OperationKind::kPrefetch ? "prefetches" : "checkpoints and restores";
    throw LaneFull("the agent already holds " + std::to_string(lane.queue.size()) + " pending " +
                       what + ", the most it queues (--max-pending " +
                       std::to_string(config_.max_pending) + ")",
                   "send the request again after Retry-After seconds, or start the agent with a "
                   "larger --max-pending",
                   static_cast<int>(std::clamp(std::ceil(lane.last_seconds), 1.0, 60.0)));
  }
  // Journaled before it is acknowledged: a client told "accepted" learns how it ended, even
  // across a restart.
  journal_.record(op->id, journal_entry(*op));
  add(op);
  lane.queue.push_back(op);
  metrics_.pending(lane.name, static_cast<int64_t>(lane.queue.size()));
  lane.wake.notify_all();
  return op->to_json();
}

void Agent::add(const std::shared_ptr<Operation>& op) {
  operations_[op->id] = op;
  order_.push_back(op->id);
  // Forget the oldest finished operations beyond the history's size.
  while (order_.size() > config_.history) {
    auto it = std::find_if(order_.begin(), order_.end(),
                           [&](const std::string& id) { return operations_.at(id)->finished(); });
    if (it == order_.end()) break;
    operations_.erase(*it);
    order_.erase(it);
  }
}

json Agent::journal_entry(const Operation& op) const {
  return {{"id", op.id},
          {"kind", kind_name(op.kind)},
          {"state", state_name(op.state)},
          {"request", op.request},
          {"created_at", op.created_at},
          {"started_at", op.started_at},
          {"agent_pid", ::getpid()}};
}

std::optional<json> Agent::operation(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto it = operations_.find(id);
  if (it == operations_.end()) return std::nullopt;
  return it->second->to_json();
}

json Agent::operations() const {
  std::lock_guard lock(mu_);
  json list = json::array();
  for (const auto& id : order_) list.push_back(operations_.at(id)->to_json());
  return {{"operations", list}};
}

json Agent::snapshots() const { return engine::list_document(config_.engine.storage); }

json Agent::snapshot(const std::string& name) const {
  check_artifact_name(name);
  return engine::inspect_document(Artifact::open(config_.engine.storage / name));
}

void Agent::work(Lane& lane, const std::stop_token& stop) {
  for (;;) {
    std::shared_ptr<Operation> op;
    {
      std::unique_lock lock(mu_);
      // Wakes every second without work, to reap the copies that ended.
      lane.wake.wait_for(lock, stop, std::chrono::seconds(1), [&] { return !lane.queue.empty(); });
      if (stop.stop_requested()) return;
      if (!lane.queue.empty()) {
        op = lane.queue.front();
        lane.queue.pop_front();
        metrics_.pending(lane.name, static_cast<int64_t>(lane.queue.size()));
      }
    }
    if (&lane == &gpu_) reap_copies();  // restores, which release copies, run there alone
    if (op) run(lane, op);
  }
}

void Agent::reap_copies() {
  std::erase_if(released_inits_, [](pid_t pid) {
    const pid_t r = ::waitpid(pid, nullptr, WNOHANG);
    return r == pid || (r < 0 && errno == ECHILD);
  });
}

std::vector<std::string> Agent::notes_of(const Operation& op) const {
  std::lock_guard lock(mu_);
  return op.notes;
}

void Agent::run(Lane& lane, const std::shared_ptr<Operation>& op) {
  const std::string kind = kind_name(op->kind);
  json entry;
  // Logged before the state shows it: whoever sees the operation running finds its line. Its
  // id, kind and request do not change once it is accepted.
  log_.operation_started(*op);
  {
    std::lock_guard lock(mu_);
    op->state = OperationState::kRunning;
    op->started_at = utc::now(utc::Precision::kMilliseconds);
    op->started = Clock::now();
    entry = journal_entry(*op);
  }
  metrics_.started(kind);
  json result, error;
  uint64_t bytes = 0;
  try {
    switch (op->kind) {
      case OperationKind::kCheckpoint: result = run_checkpoint(*op, entry, bytes); break;
      case OperationKind::kRestore: result = run_restore(*op, entry, bytes); break;
      case OperationKind::kPrefetch: result = run_prefetch(*op, entry, bytes); break;
    }
  } catch (const Error& e) {
    error = error_json(e);
  } catch (const std::exception& e) {
    error = error_json(Error(ErrorKind::kInternal, std::string("internal error: ") + e.what()));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - op->started).count();
  const auto outcome = error.is_null() ? OperationState::kSucceeded : OperationState::kFailed;
  log_.operation_finished(*op, outcome, error, seconds);
  {
    std::lock_guard lock(mu_);
    op->state = outcome;
    op->finished_at = utc::now(utc::Precision::kMilliseconds);
    op->result = std::move(result);
    op->error = error;
    op->progress = nullptr;
    lane.last_seconds = seconds;
  }
  metrics_.finished(kind, error.is_null() ? "succeeded" : "failed", seconds,
                    error.is_null() ? "" : error.at("kind").get<std::string>(), bytes);
  journal_.erase(op->id);
  common::release_free_memory();  // what a pull kept for its chunks (common/chunk_memory.h)
}

json Agent::run_checkpoint(Operation& op, json& entry, uint64_t& bytes) {
  const auto request = parse_checkpoint_request(op.request);
  const auto options = checkpoint_options(request, config_.engine);
  // What a recovery needs should the agent die from here on.
  entry["artifact"] = options.output.string();
  entry["pid"] = options.pid;
  if (auto dir = engine::control_dir_of(options.pid)) entry["control_dir"] = dir->string();
  journal_.record(op.id, entry);
  OperationReporter reporter(mu_, op, metrics_, journal_, entry);
  auto r = checkpoint(options, reporter);
  bytes = r.manifest.total_bytes();
  json pushed;
  if (remote_) {
    // Committed here; stored once the registry holds it too, under the digest it reports.
    try {
      pushed = remote_->push(options.output, request.artifact, reporter);
    } catch (const Error& e) {
      throw Error(e.kind(),
                  "captured into " + options.output.string() + ", but the push to " +
                      remote_->settings().repository + " failed: " + e.what(),
                  e.hint());
    }
  }
  json result = engine::checkpoint_document(r, options.leave_running, notes_of(op));
  if (!pushed.is_null()) {
    result["reference"] = pushed.at("reference");
    result["pushed"] = std::move(pushed);
  }
  return result;
}

json Agent::run_restore(Operation& op, json& entry, uint64_t& bytes) {
  const auto request = parse_restore_request(op.request);
  auto options = restore_options(request, config_.engine);
  entry["artifact"] = options.artifact.string();
  journal_.record(op.id, entry);
  OperationReporter reporter(mu_, op, metrics_, journal_, entry);
  // Not held here: the registry has it (the reference the caller gave, else the name's tag),
  // pulled while it restores, as `gpusnap restore oci://` does.
  std::string where = options.artifact.string();
  std::error_code ec;
  std::optional<PullClaim> claim;  // before the source: its pull has ended when this goes
  if (remote_ && !std::filesystem::exists(options.artifact, ec)) {
    where = (request.reference ? remote_->check_reference(*request.reference)
                               : remote_->tag_of(request.artifact))
                .str();
    claim.emplace(*this, where, reporter);
  }
  PrefixReporter pull_reporter(reporter, "pull-");
  store::SnapshotSource source(where, reach_options(options), store::Arrival::kWhileRestoring,
                               pull_reporter);
  PullCounter counted(metrics_, source);
  source.prepare(options);
  auto r = restore(options, reporter);
  bytes = r.manifest.total_bytes();
  for (const auto& c : r.copies) released_inits_.push_back(c.init_pid);
  if (auto line = source.summary(); !line.empty()) reporter.note(line);
  json result = engine::restore_document(r, options.artifact, notes_of(op));
  if (source.remote()) result["pulled"] = pulled_document(source);
  return result;
}

json Agent::run_prefetch(Operation& op, const json& entry, uint64_t& bytes) {
  const auto request = parse_prefetch_request(op.request);
  const RegistryStorage& r = remote("a prefetch");
  OperationReporter reporter(mu_, op, metrics_, journal_, entry);
  const auto ref =
      request.reference.empty() ? r.tag_of(request.artifact) : r.check_reference(request.reference);
  PullClaim claim(*this, ref.str(), reporter);
  PrefixReporter pull_reporter(reporter, "pull-");
  store::SnapshotSource source(ref.str(), reach_options(RestoreOptions{}),
                               store::Arrival::kBeforeReturning, pull_reporter);
  PullCounter counted(metrics_, source);
  reporter.note(source.summary());
  json result = pulled_document(source);
  bytes = result["bytes_fetched"].get<uint64_t>();
  result["notes"] = notes_of(op);
  return result;
}

Agent::PullClaim::PullClaim(Agent& agent, std::string reference, Reporter& reporter)
    : agent_(agent), reference_(std::move(reference)) {
  const auto since = Clock::now();
  bool waited = false;
  {
    std::unique_lock lock(agent_.mu_);
    while (agent_.pulling_.contains(reference_)) {
      waited = true;
      agent_.pull_ended_.wait(lock);
    }
    agent_.pulling_.insert(reference_);
  }
  if (waited) {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%.1f",
                  std::chrono::duration<double>(Clock::now() - since).count());
    reporter.note("waited " + std::string(seconds) + " s for another operation's pull of " +
                  reference_);
  }
}

Agent::PullClaim::~PullClaim() {
  {
    std::lock_guard lock(agent_.mu_);
    agent_.pulling_.erase(reference_);
  }
  agent_.pull_ended_.notify_all();
}

store::ReachOptions Agent::reach_options(const RestoreOptions& restore) const {
  store::ReachOptions o = remote_ ? remote_->reach_options() : store::ReachOptions{};
  o.criu_path = config_.engine.criu_path;
  o.gpu_map = restore.gpu_map;
  o.replicas = restore.replicas;
  return o;
}

void Agent::recover() noexcept {
  std::vector<std::string> actions;
  wait_for_dump_guardians(actions);
  recover_gpu_processes(actions);
  // Staging directories nobody writes any more.
  artifact::ArtifactWriter::remove_stale_staging(config_.engine.storage);
  remove_own_pid_staging(config_.engine.storage);
  // A dead pull's staging under RUN_DIR/pulled stays: its chunks are written nowhere else, and
  // the next pull of that snapshot resumes from it (store/transfer.h, PullOptions).
  recover_operations(actions);
}

// A dead agent's dump may still be running: its guardian finishes it and cleans up.
void Agent::wait_for_dump_guardians(std::vector<std::string>& actions) noexcept {
  const auto& storage = config_.engine.storage;
  const auto waiting_since = Clock::now();
  for (auto guardians = orphaned_dump_guardians(storage); !guardians.empty();
       guardians = orphaned_dump_guardians(storage)) {
    if (Clock::now() - waiting_since > kGuardianWait) {
      actions.push_back("a previous agent's CRIU dump is still running after 10 minutes");
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// The engine's recovery, as `gpusnap recover` runs it: CUDA processes a dead capture left
// locked or checkpointed go back to RUNNING. Entries naming this very pid are a previous
// agent's that had our pid, which the engine's own recovery takes for alive.
void Agent::recover_gpu_processes(std::vector<std::string>& actions) noexcept {
  try {
    auto driver = gpu::open_nvidia_driver();
    for (auto& line : engine::recover_abandoned(*driver, config_.engine.run_dir)) {
      actions.push_back(std::move(line));
    }
    for (auto& line : engine::recover_entries_of(*driver, config_.engine.run_dir, ::getpid())) {
      actions.push_back("recovered after a killed agent: " + line);
    }
  } catch (const std::exception& e) {
    actions.push_back(std::string("GPU recovery failed: ") + e.what());
  }
}

// Each operation a dead agent left in the journal: the workload's handshake, then its record,
// failed, with `actions` as its notes.
void Agent::recover_operations(std::vector<std::string>& actions) noexcept {
  std::vector<std::shared_ptr<Operation>> recovered;
  for (const auto& leftover : journal_.leftovers()) {
    if (leftover.entry.is_null()) {
      actions.push_back("journal entry " + leftover.path.string() +
                        " unreadable: " + leftover.problem);
      Journal::discard(leftover);
      continue;
    }
    try {
      const json& e = leftover.entry;
      auto op = std::make_shared<Operation>();
      op->id = e.at("id").get<std::string>();
      op->kind = kind_from_name(e.at("kind").get<std::string>());
      op->request = e.value("request", json::object());
      op->created_at = e.value("created_at", "");
      op->started_at = e.value("started_at", "");
      op->finished_at = utc::now(utc::Precision::kMilliseconds);
      op->state = OperationState::kFailed;
      op->notes = actions;
      if (e.value("state", "") == "running" && op->kind == OperationKind::kCheckpoint) {
        // A paused workload waits for a resume that its dead agent will never send. Asking
        // one that is not paused costs nothing: it answers at once.
        if (auto dir = e.value("control_dir", ""); !dir.empty()) {
          engine::Handshake(dir).request_resume_as_source();
        }
      }
      op->error = error_json(
          Error(ErrorKind::kInternal, interrupted_message(*op, e), "send the request again"));
      metrics_.failed_without_running(kind_name(op->kind), Error::kind_name(ErrorKind::kInternal));
      log_.operation_finished(*op, op->state, op->error, std::nullopt);
      recovered.push_back(op);
    } catch (const std::exception& err) {
      actions.push_back("journal entry " + leftover.path.string() + " unreadable: " + err.what());
    }
    Journal::discard(leftover);
  }
  std::sort(recovered.begin(), recovered.end(),
            [](const auto& a, const auto& b) { return a->created_at < b->created_at; });
  std::lock_guard lock(mu_);
  for (const auto& op : recovered) add(op);
}

}  // namespace gpusnap::agent
