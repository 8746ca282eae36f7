// The agent's service: accepts checkpoint, restore and prefetch requests, runs them with the
// engine on worker threads of its own, keeps their history, journal and metrics, logs their
// start and end, and recovers what a previous agent left when it died. The HTTP layer
// (server.h) only translates to and from it.
//
// Concurrency: operations run in two lanes, each a queue of `pending` operations and the
// threads that take them in order.
//   gpu       checkpoints and restores, one at a time. Both touch the GPU (a restore's
//             gpu-restore too), and two at once are not safe: two restores can each pass the
//             free-memory check of their GPU plan and then run the GPU out of memory in the
//             driver's restore, which leaves a process FAILED for good; two checkpoints of
//             overlapping trees would fight over the same processes' locks.
//   prefetch  pulls into the node cache, `prefetch_workers` at a time. A prefetch touches no
//             GPU but takes as long as its registry does: in the gpu lane, one from a registry
//             that trickles would hold every checkpoint and restore behind it.
// Each lane holds at most `max_pending` pending operations; beyond it a request is refused
// (LaneFull) before anything is journaled, so that a flood costs neither memory nor fsyncs.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent/journal.h"
#include "agent/log.h"
#include "agent/metrics.h"
#include "agent/operation.h"
#include "agent/registry_storage.h"
#include "agent/request.h"
#include "store/peers.h"

namespace gpusnap::agent {

struct AgentConfig {
  EngineSettings engine;
  std::filesystem::path state_dir = "/var/lib/gpusnap/agent";  // the journal
  size_t history = 1000;  // finished operations kept in memory, newest last
  std::string node;       // reported by healthz; empty: the host name
  // Registry storage (--registry): push after each capture, pull what a restore needs and
  // this node does not hold. Without: the storage directory is all there is.
  std::optional<RegistryStorageSettings> remote;
  // Pending operations each lane holds at most (--max-pending).
  size_t max_pending = 64;
  // Prefetches that run at once (--prefetch-workers).
  size_t prefetch_workers = 1;
  LogFormat log_format = LogFormat::kText;  // --log-format
  // The chunks served to the other agents (--serve-peers, store/peers.h); null: none.
  std::shared_ptr<store::PeerChunks> peer_chunks;
};

// A request refused because its lane already holds AgentConfig::max_pending pending
// operations: HTTP 429, with Retry-After. Nothing was journaled or queued.
class LaneFull : public Error {
 public:
  LaneFull(const std::string& message, const std::string& hint, int retry_after_s)
      : Error(ErrorKind::kEnvironment, message, hint), retry_after_s_(retry_after_s) {}
  // When the caller may try again: about the time the lane's last operation took.
  int retry_after_s() const { return retry_after_s_; }

 private:
  int retry_after_s_;
};

class Agent {
 public:
  // Opens the journal, recovers what a dead agent left (see recover()), then starts the
  // worker. Throws Error when the state directory cannot be used.
  explicit Agent(AgentConfig config);
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;
  // stop().
  ~Agent();

  // Validate a request and queue it; returns the operation (pending), already journaled.
  // Throws Error(kUsage) for a bad request, Error(kEnvironment) for one this build cannot
  // carry out, and LaneFull when the operation's lane holds max_pending pending ones.
  nlohmann::json submit_checkpoint(const nlohmann::json& body);
  nlohmann::json submit_restore(const nlohmann::json& body);
  // POST /v1/prefetch: pull a snapshot into the node cache ahead of a restore. Error(kUsage)
  // too when the agent has no registry storage.
  nlohmann::json submit_prefetch(const nlohmann::json& body);

  std::optional<nlohmann::json> operation(const std::string& id) const;
  nlohmann::json operations() const;
  std::string metrics() const { return metrics_.render(); }
  const EventLog& log() const { return log_; }
  // GET /v1/snapshots and /v1/snapshots/NAME: the documents of `gpusnap list --json` and
  // `gpusnap inspect --json`. Throw Error (kUsage for a bad name, kNotFound, kBadArtifact).
  nlohmann::json snapshots() const;
  nlohmann::json snapshot(const std::string& name) const;
  const AgentConfig& config() const { return config_; }

  // Takes no more work: the running operations finish (a capture is never abandoned half
  // way), pending ones are failed. Idempotent; never throws.
  void stop() noexcept;

 private:
  // A queue of pending operations and the threads that run them, oldest first.
  struct Lane {
    explicit Lane(const char* lane_name) : name(lane_name) {}
    const char* name;  // the metrics' `lane` label
    std::deque<std::shared_ptr<Operation>> queue;
    double last_seconds = 5;  // how long its last operation took: the refusal's Retry-After
    std::condition_variable_any wake;
    std::vector<std::jthread> workers;
  };
  Lane& lane_of(OperationKind kind) { return kind == OperationKind::kPrefetch ? prefetch_ : gpu_; }

  nlohmann::json submit(OperationKind kind, nlohmann::json request);
  void work(Lane& lane, const std::stop_token& stop);
  void run(Lane& lane, const std::shared_ptr<Operation>& op);
  // The steps of run() for each kind: the operation's result document, and the bytes it
  // wrote, read or fetched (the metrics).
  nlohmann::json run_checkpoint(Operation& op, nlohmann::json& entry, uint64_t& bytes);
  nlohmann::json run_restore(Operation& op, nlohmann::json& entry, uint64_t& bytes);
  nlohmann::json run_prefetch(Operation& op, const nlohmann::json& entry, uint64_t& bytes);
  // Marks `reference` pulled by one operation while it lives. Its constructor waits until no
  // other operation pulls it (pulling_), and notes how long it waited, when it did.
  class PullClaim {
   public:
    PullClaim(Agent& agent, std::string reference, Reporter& reporter);
    PullClaim(const PullClaim&) = delete;
    PullClaim& operator=(const PullClaim&) = delete;
    ~PullClaim();

   private:
    Agent& agent_;
    std::string reference_;
  };
  // The registry storage; Error(kUsage) naming `what` when the agent has none.
  const RegistryStorage& remote(const std::string& what) const;
  // How this node reaches a snapshot for `restore` (store/reach.h): the registry storage's
  // settings, the engine's CRIU, the restore's GPU map and copies for the host check.
  store::ReachOptions reach_options(const RestoreOptions& restore) const;
  // Reads the journal a dead agent left: waits for its dump guardians, runs the engine's
  // recovery (GPU journal, the workload's handshake), removes stale staging directories, and
  // records each interrupted operation as failed. Never throws.
  void recover() noexcept;
  // The steps of recover(), in its order; each adds what it did to `actions`.
  void wait_for_dump_guardians(std::vector<std::string>& actions) noexcept;
  void recover_gpu_processes(std::vector<std::string>& actions) noexcept;
  void recover_operations(std::vector<std::string>& actions) noexcept;
  void add(const std::shared_ptr<Operation>& op);           // with mu_ held
  void reap_copies();                                       // released copies' inits that ended
  nlohmann::json journal_entry(const Operation& op) const;  // with mu_ held
  std::vector<std::string> notes_of(const Operation& op) const;  // takes mu_

  AgentConfig config_;
  EventLog log_;
  Metrics metrics_;  // before remote_: its pushes and pulls count into it
  std::optional<RegistryStorage> remote_;
  Journal journal_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Operation>> operations_;
  std::deque<std::string> order_;  // ids, oldest first (the history)
  bool stopping_ = false;
  // The references operations are pulling now (a prefetch, a restore of what this node does
  // not hold), and the signal of a pull's end: an operation that would pull one of them waits
  // for that pull instead of fetching the same snapshot beside it (PullClaim).
  std::set<std::string> pulling_;
  std::condition_variable_any pull_ended_;
  // Namespace inits of the copies restores released: our children, reaped when they end so
  // that they do not stay zombies for the agent's lifetime. The gpu lane's worker only.
  std::vector<pid_t> released_inits_;
  // Last: their workers start once everything above exists and are joined before anything
  // above is destroyed.
  Lane gpu_{"gpu"};
  Lane prefetch_{"prefetch"};
};

}  // namespace gpusnap::agent
