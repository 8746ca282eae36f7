// cuda-checkpoint-tool: the CUDA driver's checkpoint API on one process, and nothing else, for
// the plain pipeline that gpusnap is measured against (bench/gpu_bench.sh):
//
//   cuda-checkpoint-tool lock|checkpoint|restore|unlock|state PID [TIMEOUT_MS]
//
// With CUDA_CHECKPOINT_TOOL_STAMPS=1 the driver is initialised first (a state query), and the
// call alone is then stamped on stderr as `stamp: VERB START_NS END_NS` (CLOCK_MONOTONIC), so
// that an experiment can place it against what it saw in the process meanwhile.
//
// Each call goes straight to libcuda through the same thin dlopen layer gpusnap uses, so the
// comparison measures the pipeline around the driver, not two ways of calling it.
#include <time.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gpu/driver.h"
#include "gpusnap/error.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: cuda-checkpoint-tool lock|checkpoint|restore|unlock|state PID\n");
    return 2;
  }
  std::string verb = argv[1];
  pid_t pid = static_cast<pid_t>(std::strtol(argv[2], nullptr, 10));
  auto driver = gpusnap::gpu::open_nvidia_driver();
  const char* stamps = std::getenv("CUDA_CHECKPOINT_TOOL_STAMPS");
  const bool stamped = stamps != nullptr && std::string(stamps) == "1";
  auto now_ns = [] {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
  };
  try {
    if (stamped) (void)driver->state(pid);
    const long long start = now_ns();
    if (verb == "lock") {
      driver->lock(pid,
                   std::chrono::milliseconds(argc > 3 ? std::strtol(argv[3], nullptr, 10) : 10000));
    } else if (verb == "checkpoint") {
      driver->checkpoint(pid);
    } else if (verb == "restore") {
      driver->restore(pid, {});
    } else if (verb == "unlock") {
      driver->unlock(pid);
    } else if (verb == "state") {
      std::printf("%s\n", gpusnap::gpu::state_name(driver->state(pid)));
    } else {
      std::fprintf(stderr, "unknown verb %s\n", verb.c_str());
      return 2;
    }
    if (stamped) std::fprintf(stderr, "stamp: %s %lld %lld\n", verb.c_str(), start, now_ns());
  } catch (const gpusnap::Error& e) {
    std::fprintf(stderr, "cuda-checkpoint-tool: %s\n", e.one_line().c_str());
    return e.exit_code();
  }
  return 0;
}
