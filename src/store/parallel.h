// Runs many independent store tasks (chunk, upload, fetch, write) on a few threads, with the
// calling thread left free to report progress. The first error stops the others from taking
// new tasks and is rethrown once every thread has finished.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace gpusnap::store {

// Calls task(i) for every i in [0, count) from `threads` threads (at least one), and tick()
// from the calling thread about every 100 ms and once at the end. Rethrows the first exception a
// task threw, after all threads have joined.
inline void run_parallel(
    size_t count, int threads, const std::function<void(size_t)>& task,
    const std::function<void()>& tick = [] {}) {
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr first;
  size_t running = 0;
  const size_t n = std::max<size_t>(1, std::min<size_t>(static_cast<size_t>(threads), count));
  {
    std::vector<std::jthread> pool;
    pool.reserve(n);
    running = n;
    for (size_t t = 0; t < n; ++t) {
      pool.emplace_back([&] {
        for (size_t i; !stop.load() && (i = next.fetch_add(1)) < count;) {
          try {
            task(i);
          } catch (...) {
            std::lock_guard lock(mu);
            if (!first) first = std::current_exception();
            stop = true;
          }
        }
        std::lock_guard lock(mu);
        --running;
        cv.notify_all();
      });
    }
    std::unique_lock lock(mu);
    while (running > 0) {
      cv.wait_for(lock, std::chrono::milliseconds(100));
      lock.unlock();
      tick();
      lock.lock();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace gpusnap::store
