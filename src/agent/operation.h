// One checkpoint, restore or prefetch the agent was asked for: what was asked, where it stands, how
// each phase went, and how it ended. An operation's fields are plain data; the Agent (agent.h) owns
// every Operation and guards it with its lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpusnap/error.h"

namespace gpusnap::agent {

enum class OperationKind { kCheckpoint, kRestore, kPrefetch };
enum class OperationState { kPending, kRunning, kSucceeded, kFailed };

const char* kind_name(OperationKind kind);
const char* state_name(OperationState state);
// Throws Error(kInternal) for a name that is not a kind (a corrupt journal entry).
OperationKind kind_from_name(const std::string& name);

struct PhaseRecord {
  std::string name;
  double seconds = 0;  // so far, while not done
  bool done = false;
  std::chrono::steady_clock::time_point started;
};

struct Operation {
  std::string id;
  OperationKind kind = OperationKind::kCheckpoint;
  OperationState state = OperationState::kPending;
  nlohmann::json request;  // as accepted, defaults filled in
  std::vector<PhaseRecord> phases;
  std::vector<std::string> notes;  // what the engine told a person (Reporter::note)
  nlohmann::json progress;         // {"phase","done","total"} of the running phase, or null
  nlohmann::json error;            // {"kind","exit_code","message","hint"} or null
  nlohmann::json result;           // the document `gpusnap --json` prints, or null
  std::string created_at, started_at, finished_at;  // RFC 3339 UTC; empty until then
  std::chrono::steady_clock::time_point started;

  bool finished() const {
    return state == OperationState::kSucceeded || state == OperationState::kFailed;
  }
  // The API's operation object (docs/design.md, "The agent").
  nlohmann::json to_json() const;
};

// The API's error object for an Error.
nlohmann::json error_json(const Error& error);

}  // namespace gpusnap::agent
