#include "agent/operation.h"

namespace gpusnap::agent {

using nlohmann::json;

const char* kind_name(OperationKind kind) {
  switch (kind) {
    case OperationKind::kCheckpoint: return "checkpoint";
    case OperationKind::kRestore: return "restore";
    case OperationKind::kPrefetch: return "prefetch";
  }
  return "?";
}

const char* state_name(OperationState state) {
  switch (state) {
    case OperationState::kPending: return "pending";
    case OperationState::kRunning: return "running";
    case OperationState::kSucceeded: return "succeeded";
    case OperationState::kFailed: return "failed";
  }
  return "?";
}

OperationKind kind_from_name(const std::string& name) {
  if (name == "checkpoint") return OperationKind::kCheckpoint;
  if (name == "restore") return OperationKind::kRestore;
  if (name == "prefetch") return OperationKind::kPrefetch;
  throw Error(ErrorKind::kInternal, "unknown operation kind '" + name + "'");
}

json Operation::to_json() const {
  json phase_list = json::array();
  const auto now = std::chrono::steady_clock::now();
  for (const auto& p : phases) {
    const double seconds =
        p.done ? p.seconds : std::chrono::duration<double>(now - p.started).count();
    phase_list.push_back({{"name", p.name}, {"seconds", seconds}, {"done", p.done}});
  }
  return {{"id", id},
          {"kind", kind_name(kind)},
          {"state", state_name(state)},
          {"request", request},
          {"phases", phase_list},
          {"notes", notes},
          {"progress", progress},
          {"error", error},
          {"result", result},
          {"created_at", created_at},
          {"started_at", started_at.empty() ? json() : json(started_at)},
          {"finished_at", finished_at.empty() ? json() : json(finished_at)}};
}

json error_json(const Error& error) {
  return {{"kind", Error::kind_name(error.kind())},
          {"exit_code", error.exit_code()},
          {"message", error.what()},
          {"hint", error.hint()}};
}

}  // namespace gpusnap::agent
