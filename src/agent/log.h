// The agent's log: what an operator reads with `kubectl logs` or journalctl. One line per
// request that changes something or fails, one when an operation starts and one when it ends
// (its outcome, its duration and, when it failed, its error's kind and message), and the
// agent's own lines (where it serves, the signal that stops it). A failure is always here as
// well as in the operation's record: the record lives in memory and in the journal, which
// are gone once the history rolls over or the node is.
//
// Every line opens with the time, in UTC (RFC 3339, milliseconds). Two forms:
//   text  2026-12-05T08:40:01.456Z gpusnap-agent: operation 3f2a… checkpoint failed in 0.012 s:
//         not-found: no process 999999 (fix: …)
//   json  one object a line (JSON lines), for a log pipeline: {"time","event",…}; the events
//         are "agent", "request", "operation-started" and "operation-finished".
//
// Thread-safe: each line goes out in one write(2) under a lock, so that the lines of the HTTP
// threads and of the workers never interleave.
#pragma once

#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "agent/operation.h"

namespace gpusnap::agent {

enum class LogFormat { kText, kJson };

// "text" or "json"; Error(kUsage) naming the flag otherwise.
LogFormat log_format_from_name(const std::string& name);

class EventLog {
 public:
  // Writes to `fd`, which stays the caller's (standard error by default).
  explicit EventLog(LogFormat format = LogFormat::kText, int fd = 2);

  LogFormat format() const { return format_; }
  // A line of the agent's own.
  void agent(std::string_view message) const;
  // An answered request; `error` is the answer's error object ({"kind","message",...}), or
  // null when it succeeded.
  void request(std::string_view method, std::string_view path, int status,
               const nlohmann::json& error) const;
  // The operation (its id, kind and request) as it starts, and as it ends: `outcome`
  // kSucceeded or kFailed, `error` the API's error object or null, `seconds` from its start to
  // its end, none for one that did not run in this agent (failed while pending, or found in a
  // dead agent's journal; its duration is then null in json, absent in text). Given apart
  // from the operation's own state so that the line can be written before the state shows.
  void operation_started(const Operation& op) const;
  void operation_finished(const Operation& op, OperationState outcome, const nlohmann::json& error,
                          std::optional<double> seconds) const;
  // An error that ends the agent before it serves (main's): in text exactly as the CLI prints
  // one ("gpusnap-agent: error: MESSAGE (fix: HINT)"), without the time, since a person at a
  // terminal reads it; in json as the line of an "agent" event with the error.
  void fatal(const Error& error) const;

 private:
  // One line: `fields` after "time" in json, "TIME gpusnap-agent: `text`" in text.
  void write(nlohmann::ordered_json fields, const std::string& text) const;

  LogFormat format_;
  int fd_;
  mutable std::mutex mu_;
};

}  // namespace gpusnap::agent
