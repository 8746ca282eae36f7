// libgpusnap-preload.so in the workloads gpusnap starts (src/preload/populate.cc says what it
// does and why): where to find it, and how to put it into a workload's environment.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/syscall_injection.h"

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

// Where the library looks for gpusnap's requests (src/preload/populate.cc), read once when it
// loads; its default is /run/gpusnap/preload, gpusnap's own under its default --run-dir.
inline constexpr const char* kPreloadRequestsEnv = "GPUSNAP_PRELOAD_REQUESTS";
// A container's workload sees its own mounts only: `gpusnap init` starts it with its requests
// here, and a capture mounts a folder of its own there, read-only, holding that workload's
// request alone (docs/containers.md).
inline constexpr const char* kContainerPreloadRequests = "/tmp/.gpusnap-preload";

// Whether a process's mappings include the library (it was started with it).
bool maps_preload_library(const std::vector<common::Mapping>& maps);

// The thread name of the library's helpers, which may still be populating the driver's region
// when the driver's checkpoint call returns (they work ahead of its copy).
inline constexpr const char* kFillThreadName = "gpusnap-fill";

// Waits up to `limit` until no process of `pids` has a helper thread left; returns those that
// still have one. Before the region is moved or dumped, nothing may still be faulting it in.
std::vector<pid_t> wait_for_fill_threads(const std::vector<pid_t>& pids,
                                         std::chrono::milliseconds limit);

// Whether process `pid` has a thread of that name now.
bool has_thread_named(pid_t pid, const char* name);

// Writes `text` to `path` as a request the library accepts: root's only (0600), whole (renamed
// into place). Throws Error on failure.
void write_preload_request(const std::filesystem::path& path, const std::string& text);

// --- The region made private from inside the process -------------------------------------------
//
// The library's thread that makes the driver's region, mapped from the artifact's file, a private
// mapping of that file on request (src/preload/populate.cc says why it is done from inside).
inline constexpr const char* kRemapThreadName = "gpusnap-remap";

// The remap request beside a preload request ("PIDNS-PID" -> "PIDNS-PID.remap").
std::filesystem::path remap_request_path(const std::filesystem::path& preload_request);

// The request's ADVICE bits: the madvise flags a range had (smaps' "dc", "dd", "hg", "nh").
inline constexpr int kAdviceDontFork = 1;
inline constexpr int kAdviceDontDump = 2;
inline constexpr int kAdviceHugePage = 4;
inline constexpr int kAdviceNoHugePage = 8;

struct RemapRequest {
  uint64_t start = 0;  // page-aligned, inside the region the library mapped
  uint64_t end = 0;
  uint64_t offset = 0;  // the file offset of `start`, as the region maps it
  int prot = 0;
  int advice = 0;
};

// Asks process `pid`'s watcher to make the range private and waits up to `limit` for it to be
// gone (it leaves when done). False when it is still there then: it was told to cancel, and the
// caller must find the range as it was. The outcome is the caller's to check in the process's
// maps.
bool remap_in_process(pid_t pid, const std::filesystem::path& preload_request,
                      const RemapRequest& range, std::chrono::milliseconds limit);

// Tells the watchers of `requests` (preload requests) to leave without remapping, when one of
// `pids` still has one, and waits for that up to `limit`; removes any remap request nobody took.
// For rollbacks: never throws.
void cancel_remap_watchers(const std::vector<pid_t>& pids,
                           const std::vector<std::filesystem::path>& requests,
                           std::chrono::milliseconds limit) noexcept;

}  // namespace gpusnap::engine
