// cuda-checkpoint-tool: the CUDA driver's checkpoint API on one process, and nothing else, for
// the plain pipeline that gpusnap is measured against (bench/gpu_bench.sh):
//
//   cuda-checkpoint-tool lock|checkpoint|restore|unlock|state PID [TIMEOUT_MS]
//
// Each call goes straight to libcuda through the same thin dlopen layer gpusnap uses, so the
// comparison measures the pipeline around the driver, not two ways of calling it.
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
  pid_t pid = static_cast<pid_t>(std::atoi(argv[2]));
  auto driver = gpusnap::gpu::open_nvidia_driver();
  try {
    if (verb == "lock") {
      driver->lock(pid, std::chrono::milliseconds(argc > 3 ? std::atoi(argv[3]) : 10000));
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
  } catch (const gpusnap::Error& e) {
    std::fprintf(stderr, "cuda-checkpoint-tool: %s\n", e.one_line().c_str());
    return e.exit_code();
  }
  return 0;
}
