// gpusnap's one worker pool: a few threads that share one piece of work, the first failure
// stopping the rest. Checksums, the host images' copies, the store's transfers, the driver's
// per-process calls and the memory tier's drains and fills all run on it.
//
// Header-only: the memory tier's library (libgpusnap-tier.so) links its own objects and none of
// gpusnap's, and uses it too. The preload library keeps its own threads: it uses libc alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace gpusnap::common {

// Runs work(k, stop) for k in [0, n) on n threads of its own, started by the constructor.
// `stop` is set by the first exception a worker throws, and by request_stop(): a worker that
// takes one item at a time looks at it before taking the next. The first exception is kept and
// rethrown by join() on the calling thread once every worker has returned; the others' are
// dropped. The destructor asks the workers to stop and waits for them (it rethrows nothing): a
// pool left by an exception stops before what its work refers to goes.
class WorkerPool {
 public:
  using Work = std::function<void(std::size_t k, const std::atomic<bool>& stop)>;

  WorkerPool(std::size_t n, Work work) : work_(std::move(work)) {
    threads_.reserve(n);
    try {
      for (std::size_t k = 0; k < n; ++k) {
        {
          std::lock_guard lock(mu_);
          ++running_;
        }
        try {
          threads_.emplace_back([this, k] { run(k); });
        } catch (...) {
          std::lock_guard lock(mu_);
          --running_;
          throw;
        }
      }
    } catch (...) {
      // No thread for the rest: the ones started stop, and the caller sees why.
      stop_ = true;
      wait();
      throw;
    }
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  ~WorkerPool() {
    stop_ = true;
    wait();
  }

  void request_stop() { stop_ = true; }
  bool stopping() const { return stop_; }

  // Waits for every worker, then rethrows the first failure. With `tick`, calls it from the
  // calling thread about every `every` while they run and once when all have returned (progress
  // reports: the workers never call them).
  void join(const std::function<void()>& tick = nullptr,
            std::chrono::milliseconds every = std::chrono::milliseconds(100)) {
    if (tick) {
      std::unique_lock lock(mu_);
      do {
        cv_.wait_for(lock, every, [this] { return running_ == 0; });
        lock.unlock();
        tick();
        lock.lock();
      } while (running_ > 0);
    }
    wait();
    if (first_) std::rethrow_exception(std::exchange(first_, nullptr));
  }

 private:
  void run(std::size_t k) {
    try {
      work_(k, stop_);
    } catch (...) {
      stop_ = true;
      std::lock_guard lock(mu_);
      if (!first_) first_ = std::current_exception();
    }
    std::lock_guard lock(mu_);
    --running_;
    cv_.notify_all();
  }
  void wait() {
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  Work work_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t running_ = 0;   // under mu_
  std::exception_ptr first_;  // under mu_ until the workers are joined
  std::vector<std::thread> threads_;
};

// Runs work(k, stop) on n threads and waits: WorkerPool(n, work).join().
inline void run_workers(std::size_t n, WorkerPool::Work work) {
  WorkerPool(n, std::move(work)).join();
}

// Calls task(i) for every i in [0, count) from `threads` threads (at most count, at least one),
// each taking the next index in turn, none after the first failure; tick() from the calling
// thread as WorkerPool::join calls it. Rethrows the first exception a task threw, after all
// threads have returned.
inline void for_each_index(std::size_t count, int threads,
                           const std::function<void(std::size_t)>& task,
                           const std::function<void()>& tick = nullptr) {
  std::atomic<std::size_t> next{0};
  const std::size_t n =
      std::max<std::size_t>(1, std::min(static_cast<std::size_t>(std::max(threads, 1)), count));
  WorkerPool pool(n, [&](std::size_t, const std::atomic<bool>& stop) {
    for (std::size_t i; !stop && (i = next.fetch_add(1)) < count;) task(i);
  });
  pool.join(tick);
}

}  // namespace gpusnap::common
