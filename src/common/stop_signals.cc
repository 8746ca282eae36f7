#include "common/stop_signals.h"

#include <unistd.h>

namespace gpusnap::common {

StopSignals::StopSignals() {
  sigemptyset(&set_);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&set_, sig);
  pthread_sigmask(SIG_BLOCK, &set_, &old_);
  thread_ = std::thread([this] {
    for (;;) {
      siginfo_t info{};
      const int sig = sigwaitinfo(&set_, &info);
      if (sig < 0) continue;  // EINTR
      // The destructor's own signal to this thread, not one sent to the process.
      if (closing_ && info.si_code == SI_TKILL && info.si_pid == ::getpid()) return;
      signal_ = sig;
      return;
    }
  });
}

StopSignals::~StopSignals() {
  if (!requested()) {
    closing_ = true;
    // Blocked in that thread too: sigwaitinfo takes it, marked as ours (SI_TKILL, our pid).
    pthread_kill(thread_.native_handle(), SIGHUP);
  }
  thread_.join();
  pthread_sigmask(SIG_SETMASK, &old_, nullptr);
}

void StopSignals::reraise() const {
  const int sig = signal_;
  if (sig == 0) return;
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(sig, &dfl, nullptr);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  ::raise(sig);  // pending while blocked: delivered as the mask opens
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
}

}  // namespace gpusnap::common
