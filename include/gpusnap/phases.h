// Named, timed phases. A checkpoint and a restore are each a sequence of phases; each is timed,
// reported to whoever watches (a terminal, --json output, the agent's metrics), and kept for
// the operation's result.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace gpusnap {

struct PhaseTiming {
  std::string name;
  double seconds = 0;
};

// Receives progress as it happens. The default does nothing.
class Reporter {
 public:
  virtual ~Reporter() = default;
  virtual void phase_started(std::string_view /*name*/) {}
  virtual void phase_finished(std::string_view /*name*/, double /*seconds*/) {}
  // Byte-level progress inside a phase (checksums, copies): done out of total.
  virtual void progress(std::string_view /*name*/, uint64_t /*done*/, uint64_t /*total*/) {}
  // A line worth telling a person (a warning, a decision gpusnap took).
  virtual void note(std::string_view /*text*/) {}
};

// Human progress on a terminal (stderr), one line per phase with its time.
class TerminalReporter : public Reporter {
 public:
  explicit TerminalReporter(bool live);  // live: redraw progress lines (stderr is a tty)
  void phase_started(std::string_view name) override;
  void phase_finished(std::string_view name, double seconds) override;
  void progress(std::string_view name, uint64_t done, uint64_t total) override;
  void note(std::string_view text) override;

 private:
  bool live_;
  std::chrono::steady_clock::time_point last_draw_{};
};

class Phases {
 public:
  explicit Phases(Reporter& reporter) : reporter_(reporter) {}

  // Runs fn as the phase `name`, timing it; the timing is kept even when fn throws.
  template <class Fn>
  auto run(std::string_view name, Fn&& fn) -> decltype(fn()) {
    Timer timer(*this, name);
    return fn();
  }

  const std::vector<PhaseTiming>& timings() const { return timings_; }
  double total_seconds() const;
  Reporter& reporter() { return reporter_; }

 private:
  class Timer {
   public:
    Timer(Phases& phases, std::string_view name);
    Timer(const Timer&) = delete;
    Timer& operator=(const Timer&) = delete;
    ~Timer();

   private:
    Phases& phases_;
    std::string name_;
    std::chrono::steady_clock::time_point start_;
  };

  Reporter& reporter_;
  std::vector<PhaseTiming> timings_;
};

}  // namespace gpusnap
