// What gpusnap can see before it freezes anything and knows CRIU cannot capture. Refusing here
// costs the workload nothing; failing inside CRIU's dump costs a freeze and a thaw.
#pragma once

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
// Refuses a root that is gpusnap itself, one of its ancestors, the host's init or a kernel
// thread.
void refuse_bad_root(pid_t root);
// Whether pid is a kernel thread (PF_KTHREAD): nothing CRIU can dump.
bool is_kernel_thread(pid_t pid);

}  // namespace gpusnap::engine
