// The agent's Prometheus metrics, kept in memory and written in the text exposition format
// 0.0.4 by hand (a few counters and histograms do not need a client library).
//
//   gpusnap_operations_total{kind,result}            operations that ended
//   gpusnap_operations_in_flight{kind}               operations running now (not pending)
//   gpusnap_operations_pending{lane}                 operations waiting in each lane (agent.h)
//   gpusnap_operation_duration_seconds{kind}         histogram, from start to end
//   gpusnap_phase_duration_seconds{kind,phase}       histogram, each engine phase
//   gpusnap_artifact_bytes_total{kind}               written by checkpoints, read by restores,
//                                                    fetched from the registry by prefetches
//   gpusnap_operation_failures_total{kind,error_kind}  failed operations by Error kind
//   gpusnap_last_success_timestamp_seconds{kind}     when the newest successful operation of
//                                                    each kind ended (kinds that had one)
// With registry storage (--registry), what its pushes and pulls moved, counted as each ends
// (store::PushResult, store::PullResult):
//   gpusnap_registry_bytes_total{direction}          chunk bytes uploaded (push) or fetched
//                                                    (pull), as stored (compressed)
//   gpusnap_registry_chunks_total{direction}         the chunks themselves
//   gpusnap_node_cache_hits_total                    chunks a pull found on the node
//   gpusnap_node_cache_misses_total                  chunks a pull fetched from the registry
//   gpusnap_node_cache_hit_bytes_total               the bytes of the hits: what was not fetched
//   gpusnap_node_cache_evictions_total               snapshots evicted to keep the budget
//
// Thread-safe: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "store/transfer.h"

namespace gpusnap::agent {

// A cumulative histogram with fixed upper bounds.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // Appends NAME_bucket/_sum/_count lines, `labels` being the series' other labels
  // (`kind="checkpoint"`, without braces).
  void render(std::string& out, const std::string& name, const std::string& labels) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bound, not cumulative; the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  // `registry_storage`: the agent pushes and pulls (--registry); the registry and node cache
  // families are written only then.
  explicit Metrics(bool registry_storage = false);
  void started(const std::string& kind);
  // An operation that ran ended (`result` "succeeded" or "failed"; error_kind empty on success).
  void finished(const std::string& kind, const std::string& result, double seconds,
                const std::string& error_kind, uint64_t artifact_bytes);
  // An operation that never ran in this agent (found in the journal after a restart): counted
  // as failed, with no duration.
  void failed_without_running(const std::string& kind, const std::string& error_kind);
  void phase(const std::string& kind, const std::string& phase, double seconds);
  // The number of operations waiting in `lane` now.
  void pending(const std::string& lane, int64_t count);
  // Where the agent's pushes and pulls count the chunks they move, as they move them (those a
  // registry held already are not uploaded, so not counted): the registry families and the
  // node cache's misses are read from it, so a push or pull that fails part way counts what it
  // moved.
  const std::shared_ptr<store::TransferCounters>& transfers() const { return transfers_; }
  // A pull ended: the chunks it found on the node (the node cache's hits), with their bytes,
  // and the snapshots the cache evicted.
  struct Pull {
    uint64_t chunks_found = 0;
    uint64_t bytes_found = 0;
    uint64_t evicted = 0;
  };
  void pulled(const Pull& pull);
  // The text format, version 0.0.4.
  std::string render() const;

 private:
  void render_registry(std::string& out) const;  // with mu_ held
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, uint64_t> operations_;  // kind, result
  std::map<std::string, int64_t> in_flight_;
  std::map<std::string, int64_t> pending_;  // by lane
  std::map<std::string, Histogram> duration_;
  std::map<std::pair<std::string, std::string>, Histogram> phases_;  // kind, phase
  std::map<std::string, uint64_t> bytes_;
  std::map<std::pair<std::string, std::string>, uint64_t> failures_;  // kind, error kind
  // Seconds since the epoch, by kind. Kept here rather than read from the history, which
  // forgets: a success followed by 1000 failures would otherwise lose its series.
  std::map<std::string, double> last_success_;
  bool registry_storage_;
  std::shared_ptr<store::TransferCounters> transfers_ = std::make_shared<store::TransferCounters>();
  Pull cache_;  // the pulls' sums
};

// A label value escaped for the text format (backslash, double quote, newline).
std::string escape_label(const std::string& value);

}  // namespace gpusnap::agent
