#include "gpusnap/phases.h"

#include <cstdio>

namespace gpusnap {

Phases::Timer::Timer(Phases& phases, std::string_view name)
    : phases_(phases), name_(name), start_(std::chrono::steady_clock::now()) {
  phases_.reporter_.phase_started(name_);
}

Phases::Timer::~Timer() {
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  phases_.timings_.push_back({name_, seconds});
  phases_.reporter_.phase_finished(name_, seconds);
}

double Phases::total_seconds() const {
  double total = 0;
  for (const auto& t : timings_) total += t.seconds;
  return total;
}

TerminalReporter::TerminalReporter(bool live) : live_(live) {}

void TerminalReporter::phase_started(std::string_view name) {
  if (live_) std::fprintf(stderr, "  %-22.*s ...\r", static_cast<int>(name.size()), name.data());
}

void TerminalReporter::phase_finished(std::string_view name, double seconds) {
  if (!live_) return;  // not a terminal: --json carries the timings for tools
  std::fprintf(stderr, "  %-22.*s %8.3f s%s\n", static_cast<int>(name.size()), name.data(), seconds,
               "          ");
}

void TerminalReporter::progress(std::string_view name, uint64_t done, uint64_t total) {
  if (!live_ || total == 0) return;
  auto now = std::chrono::steady_clock::now();
  if (done < total && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  std::fprintf(stderr, "  %-22.*s %5.1f%% of %.2f GiB\r", static_cast<int>(name.size()),
               name.data(), 100.0 * static_cast<double>(done) / static_cast<double>(total),
               static_cast<double>(total) / (1 << 30));
}

void TerminalReporter::note(std::string_view text) {
  std::fprintf(stderr, "gpusnap: %.*s\n", static_cast<int>(text.size()), text.data());
}

}  // namespace gpusnap
