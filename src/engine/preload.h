// libgpusnap-preload.so in the workloads gpusnap starts (src/preload/populate.cc says what it
// does and why): where to find it, and how to put it into a workload's environment.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/remote.h"

namespace gpusnap::engine {

inline constexpr const char* kPreloadFileName = "libgpusnap-preload.so";
// Names the library to use instead of the one found next to gpusnap; empty: none at all.
inline constexpr const char* kPreloadEnv = "GPUSNAP_PRELOAD_LIBRARY";

// The library for the workloads this gpusnap starts: $GPUSNAP_PRELOAD_LIBRARY when set (empty
// means none), else next to the running binary (the build tree, /opt/gpusnap/bin on a node),
// else ../lib/gpusnap/ from it (an installed tree). nullopt when there is none. Throws
// Error(kUsage) when the variable names a file that cannot be read.
std::optional<std::filesystem::path> find_preload_library();

// The LD_PRELOAD entry for a workload's environment ("LD_PRELOAD=..."), the library first and
// any LD_PRELOAD already in ours kept after it; nullopt when there is no library.
std::optional<std::string> preload_environment();

// Whether a process's mappings include the library (it was started with it).
bool maps_preload_library(const std::vector<common::Mapping>& maps);

// The thread name of the library's helpers, which may still be populating the driver's region
// when the driver's checkpoint call returns (they work ahead of its copy).
inline constexpr const char* kFillThreadName = "gpusnap-fill";

// Waits up to `limit` until no process of `pids` has a helper thread left; returns those that
// still have one. Before the region is moved or dumped, nothing may still be faulting it in.
std::vector<pid_t> wait_for_fill_threads(const std::vector<pid_t>& pids,
                                         std::chrono::milliseconds limit);

}  // namespace gpusnap::engine
