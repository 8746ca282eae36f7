#include "engine/huge_pages.h"

#include <sys/mman.h>
#include <sys/syscall.h>

#include <chrono>
#include <fstream>

#include "common/fs.h"
#include "engine/host_images.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

// How often the mappings are read while the driver's call runs. The driver writes ~2 GB/s
// into its region, so a region is advised after its first few MiB at most.
constexpr auto kPollInterval = std::chrono::milliseconds(1);
// Attempts to run the advice in a process before leaving it alone: another tracer may hold it
// for a moment.
constexpr int kMaxAttempts = 50;

}  // namespace

bool transparent_huge_pages_need_advice() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  std::getline(in, modes);
  return modes.find("[madvise]") != std::string::npos;
}

HugePageAdvisor::HugePageAdvisor(const std::map<pid_t, std::vector<Mapping>>& before, bool active)
    : before_(before) {
  if (active && !before_.empty()) {
    watcher_ = std::jthread([this](const std::stop_token& stop) { watch(stop); });
  }
}

HugePageAdvisor::~HugePageAdvisor() { stop(); }

std::vector<std::string> HugePageAdvisor::stop() {
  if (watcher_.joinable()) {
    watcher_.request_stop();
    watcher_.join();
  }
  std::lock_guard<std::mutex> guard(notes_mutex_);
  return notes_;
}

void HugePageAdvisor::watch(const std::stop_token& stop) {
  while (!stop.stop_requested()) {
    advise_new_regions();
    std::this_thread::sleep_for(kPollInterval);
  }
}

void HugePageAdvisor::advise_new_regions() {
  for (const auto& [pid, maps] : before_) {
    if (given_up_.count(pid) != 0) continue;
    try {
      std::vector<Range> fresh;
      for (const auto& r : new_anonymous_ranges(maps, read_mappings(pid), kMinHostImageBytes)) {
        if (advised_[pid].count(r.start) == 0) fresh.push_back(r);
      }
      if (fresh.empty()) continue;
      RemoteThread thread(pid);
      for (const auto& r : fresh) {
        long rc = thread.syscall(SYS_madvise, r.start, r.size(), MADV_HUGEPAGE);
        advised_[pid].insert(r.start);
        note(rc == 0 ? "process " + std::to_string(pid) + ": asked for huge pages in the " +
                           fs::human_bytes(r.size()) + " the driver mapped"
                     : "process " + std::to_string(pid) +
                           ": huge pages refused for the driver's region (" +
                           errno_text(static_cast<int>(-rc)) + ")");
      }
    } catch (const Error& e) {
      // Gone, or traced by someone else for longer than a moment: small pages then, and
      // nothing else changes.
      if (e.kind() == ErrorKind::kNotFound || ++failures_[pid] >= kMaxAttempts) {
        given_up_.insert(pid);
        note("process " + std::to_string(pid) + ": no huge pages for the driver's region (" +
             e.what() + ")");
      }
    }
  }
}

void HugePageAdvisor::note(std::string line) {
  std::lock_guard<std::mutex> guard(notes_mutex_);
  notes_.push_back(std::move(line));
}

}  // namespace gpusnap::engine
