// SIGTERM, SIGINT and SIGHUP as a request to stop, for a command that must remove what it wrote
// before it ends (a pull's hidden staging directory): mold removes its temporary output from a
// signal handler; a directory tree cannot be removed there, so the signals are taken by a thread
// of gpusnap's own (sigwait) instead, the command's flow looks at requested() between its steps
// and unwinds as on any failure, its destructors removing what it staged, and reraise() then
// ends the process by the signal, as if it had never been caught: its parent sees the status it
// expects (143 for SIGTERM in a shell).
#pragma once

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <thread>

namespace gpusnap::common {

class StopSignals {
 public:
  // Blocks the signals in this thread, and so in every thread started after it (made before
  // any other thread exists: one started earlier would take a signal with its default action).
  StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // Stops the waiting thread and puts the signal mask back. A signal that came is the caller's
  // to reraise(): one that came after the command's last look at requested() is let go.
  ~StopSignals();

  bool requested() const { return signal_ != 0; }
  int signal() const { return signal_; }
  // Ends the process by the signal that came (nothing when none came).
  void reraise() const;

 private:
  sigset_t set_{};
  sigset_t old_{};
  std::atomic<int> signal_{0};
  std::atomic<bool> closing_{false};
  std::thread thread_;
};

}  // namespace gpusnap::common
