// What gpusnap can see before it freezes anything and knows CRIU cannot capture. Refusing here
// costs the workload nothing; failing inside CRIU's dump costs a freeze and a thaw.
#pragma once

#include <string>
#include <vector>

#include "common/proc.h"

namespace gpusnap::engine {

// Throws Error(kNotCapturable) naming the process, the resource and the fix.
void refuse_uncapturable(const std::vector<proc::Process>& tree);
// Whether any process of the tree has a terminal on its standard descriptors (a shell job).
bool uses_terminal(const std::vector<proc::Process>& tree);
// Refuses CUDA processes that talk to each other through NCCL transports the driver cannot
// checkpoint (peer-to-peer, shared memory, NVLink SHARP, cuMem handles), naming the settings.
void refuse_unsafe_nccl(const std::vector<proc::Process>& tree, const std::vector<pid_t>& cuda);
// Refuses a CUDA process with JAX/XLA loaded (its libraries in /proc/PID/maps) whose environment
// keeps XLA's preallocation on, or picks an allocator under which the driver's checkpoint kills
// it too, naming the setting that works. Only the environment the process started with is seen.
void refuse_xla_preallocation(const std::vector<proc::Process>& tree,
                              const std::vector<pid_t>& cuda);
// "KEY=VALUE" settings that keep frameworks capturable, for the workloads gpusnap starts (`run`,
// `init`): each only where gpusnap's own environment does not set the variable, so a user's
// choice stands.
std::vector<std::string> capturable_environment();
// Refuses a root that is gpusnap itself, one of its ancestors, or the host's init.
void refuse_bad_root(pid_t root);

}  // namespace gpusnap::engine
