// Huge pages for the driver's checkpoint.
//
// The driver's checkpoint copies a process's GPU memory into a fresh anonymous region that it
// maps in the process during the call. Where transparent huge pages are in `madvise` mode (a
// common default, and the H200 machine's), that region gets 4 KiB pages: one first-touch page
// fault per 4 KiB written. Measured there (driver 580.159.04, 4 GiB of GPU state): the driver's
// checkpoint takes 2.74 s on 4 KiB pages and 1.72 s on 2 MiB pages, and its restore from them
// 1.22 s against 0.88 s (docs/benchmarks.md).
//
// The region does not exist before the call, so it cannot be advised ahead. A HugePageAdvisor
// watches the processes' mappings while the call runs and, as soon as a new large anonymous
// region appears, runs madvise(MADV_HUGEPAGE) on it inside the process (common/remote.h). The
// pages the driver touched before the advice stay small; the rest fault in 2 MiB at a time.
// Advice only: the bytes are the same either way, and any failure just leaves small pages.
#pragma once

#include <sys/types.h>

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/remote.h"

namespace gpusnap::engine {

// Whether this host's THP mode is `madvise`, the one mode in which advice changes anything
// (`always` gives huge pages anyway, `never` refuses them).
bool transparent_huge_pages_need_advice();

class HugePageAdvisor {
 public:
  // Starts watching each process of `before` (its mappings before the driver's call) when
  // `active`; an inactive advisor does nothing.
  HugePageAdvisor(const std::map<pid_t, std::vector<Mapping>>& before, bool active);
  HugePageAdvisor(const HugePageAdvisor&) = delete;
  HugePageAdvisor& operator=(const HugePageAdvisor&) = delete;
  ~HugePageAdvisor();  // stops watching

  // Stops watching; returns what was done, as notes for the user.
  std::vector<std::string> stop();

 private:
  void watch(const std::stop_token& stop);
  // One pass over every process; returns once every process is done or was given up.
  void advise_new_regions();
  void note(std::string line);

  std::map<pid_t, std::vector<Mapping>> before_;
  std::map<pid_t, std::set<uint64_t>> advised_;  // region starts advised, per process
  std::map<pid_t, int> failures_;                // failed attempts to run the advice
  std::set<pid_t> given_up_;                     // left alone from then on
  std::mutex notes_mutex_;
  std::vector<std::string> notes_;
  std::jthread watcher_;  // last: it uses the members above
};

}  // namespace gpusnap::engine
