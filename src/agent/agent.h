// The agent's service: accepts checkpoint and restore requests, runs them one at a time with
// the engine on its worker thread, keeps their history, journal and metrics, and recovers what
// a previous agent left when it died. The HTTP layer (server.h) only translates to and from it.
//
// Concurrency: one operation runs at a time; the others wait as `pending`, in order. Both kinds
// touch the GPU (a restore's gpu-restore too), and two at once are not safe: two restores can
// each pass the free-memory check of their GPU plan and then run the GPU out of memory in the
// driver's restore, which leaves a process FAILED for good; two checkpoints of overlapping
// trees would fight over the same processes' locks.
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
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent/journal.h"
#include "agent/metrics.h"
#include "agent/operation.h"
#include "agent/registry_storage.h"
#include "agent/request.h"

namespace gpusnap::agent {

struct AgentConfig {
  EngineSettings engine;
  std::filesystem::path state_dir = "/var/lib/gpusnap/agent";  // the journal
  size_t history = 1000;  // finished operations kept in memory, newest last
  std::string node;       // reported by healthz; empty: the host name
  // Registry storage (--registry): push after each capture, pull what a restore needs and
  // this node does not hold. Without: the storage directory is all there is.
  std::optional<RegistryStorageSettings> remote;
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
  // Throws Error(kUsage) for a bad request and Error(kEnvironment) for one this build cannot
  // carry out.
  nlohmann::json submit_checkpoint(const nlohmann::json& body);
  nlohmann::json submit_restore(const nlohmann::json& body);
  // POST /v1/prefetch: pull a snapshot into the node cache ahead of a restore. Error(kUsage)
  // too when the agent has no registry storage.
  nlohmann::json submit_prefetch(const nlohmann::json& body);

  std::optional<nlohmann::json> operation(const std::string& id) const;
  nlohmann::json operations() const;
  std::string metrics() const { return metrics_.render(); }
  // GET /v1/snapshots and /v1/snapshots/NAME: the documents of `gpusnap list --json` and
  // `gpusnap inspect --json`. Throw Error (kUsage for a bad name, kNotFound, kBadArtifact).
  nlohmann::json snapshots() const;
  nlohmann::json snapshot(const std::string& name) const;
  const AgentConfig& config() const { return config_; }

  // Takes no more work: the running operation finishes (a capture is never abandoned half
  // way), pending ones are failed. Idempotent; never throws.
  void stop() noexcept;

 private:
  nlohmann::json submit(OperationKind kind, nlohmann::json request);
  void work(const std::stop_token& stop);
  void run(const std::shared_ptr<Operation>& op);
  // The steps of run() for each kind: the operation's result document, and the bytes it
  // wrote, read or fetched (the metrics).
  nlohmann::json run_checkpoint(Operation& op, nlohmann::json& entry, uint64_t& bytes);
  nlohmann::json run_restore(Operation& op, nlohmann::json& entry, uint64_t& bytes);
  nlohmann::json run_prefetch(Operation& op, const nlohmann::json& entry, uint64_t& bytes);
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
  std::optional<RegistryStorage> remote_;
  Journal journal_;
  Metrics metrics_;
  mutable std::mutex mu_;
  std::condition_variable_any wake_;
  std::map<std::string, std::shared_ptr<Operation>> operations_;
  std::deque<std::string> order_;  // ids, oldest first (the history)
  std::deque<std::shared_ptr<Operation>> queue_;
  bool stopping_ = false;
  // Namespace inits of the copies restores released: our children, reaped when they end so
  // that they do not stay zombies for the agent's lifetime. Worker thread only.
  std::vector<pid_t> released_inits_;
  // Last: started once everything above exists, joined before anything above is destroyed.
  std::jthread worker_;
};

}  // namespace gpusnap::agent
