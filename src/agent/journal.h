// The agent's journal of operations in flight: one file per operation, STATE_DIR/operations/
// ID.json, written before the operation is acknowledged (pending) and again before it starts
// (running, with what a recovery needs: the artifact's path, the workload's handshake
// directory), removed when it ends. Each write is durable (temporary name, fsync, rename, fsync
// of the directory): after a crash the entry reads as the old state or the new one, never torn.
// A file left behind therefore names an operation that a dead agent did not finish.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace gpusnap::agent {

class Journal {
 public:
  // Creates STATE_DIR/operations (mode 0700: the entries name workloads) if needed. Throws
  // Error.
  explicit Journal(const std::filesystem::path& state_dir);

  // Writes (or replaces) the entry of operation `id`. Throws Error.
  void record(const std::string& id, const nlohmann::json& entry);
  // Removes the entry of `id`; never throws (an operation's end must not fail on it).
  void erase(const std::string& id) noexcept;

  struct Leftover {
    std::filesystem::path path;
    nlohmann::json entry;  // null when unreadable
    std::string problem;   // why it is unreadable
  };
  // Every entry present now, sorted by name (the id). Never throws.
  std::vector<Leftover> leftovers() const noexcept;
  // Removes an entry found by leftovers(); never throws.
  static void discard(const Leftover& leftover) noexcept;

 private:
  std::filesystem::path dir_;
};

}  // namespace gpusnap::agent
