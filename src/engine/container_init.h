// gpusnap as a container's PID 1 (`gpusnap init`), the counterpart of a copy's init for
// containers that a runtime (runc, a kubelet through containerd) starts:
//
// - the shim, `gpusnap init [--memory-tier] -- CMD ARGS...`: runs CMD in its own session (so
//   that CMD's tree is a whole session CRIU can capture), reaps orphans, passes SIGTERM, SIGINT
//   and SIGHUP on to CMD and exits with CMD's status. A container started this way can be
//   captured: the snapshot is CMD's tree.
// - the placeholder, `gpusnap init --placeholder`: waits until gpusnap has restored a snapshot
//   into its namespaces and hands it the restored root (a queued real-time signal carrying the
//   root's pid: the placeholder shares no file with the host and may lack the capabilities to
//   mount one), then reaps and forwards for that root and exits with its status. Until then it
//   reaps whatever a failed restore leaves to it and goes on waiting; SIGTERM ends it (0).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace gpusnap::engine {

struct ShimOptions {
  // CMD's Python installs the memory tier when it imports torch: gpusnap's Python site folder
  // first on its PYTHONPATH, as `gpusnap run --memory-tier` does (engine/python_site.h). Found
  // beside this gpusnap (the node's /opt/gpusnap/bin/python, mounted into the pod) before CMD
  // starts: none found is a usage error, and CMD does not start without the tier it was asked
  // to have.
  bool memory_tier = false;
};

int shim_main(const std::vector<std::string>& command, const ShimOptions& options = {});
int placeholder_main();

// The signal that hands a restored root (sigval: its pid in the placeholder's namespace) to
// the placeholder.
int adopt_signal();
// Hands the restored root over; false when the placeholder cannot be signalled.
bool hand_over(pid_t placeholder, pid_t ns_root) noexcept;
// Kills a restored tree that was not handed over; the placeholder reaps it. Never throws.
void kill_restored_tree(pid_t placeholder, pid_t ns_root) noexcept;

}  // namespace gpusnap::engine
