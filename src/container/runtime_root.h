// Which runc state directory ("runtime root") holds a container named by its ID alone. A node's
// runtime chooses the directory, not the user: containerd's runc v2 shim keeps each namespace's
// containers in /run/containerd/runc/NAMESPACE (the kubelet's are in k8s.io) unless the runtime's
// options name another root, CRI-O and a bare runc use /run/runc. gpusnap searches these, so that
// a container ID from the kubelet (or `ctr task ls`) is enough.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace gpusnap::container {

// Where to search. The defaults are the runtimes' own defaults; a test or a node with other
// paths passes its own.
struct RootSearch {
  // Directories that are runc roots themselves (runc's and CRI-O's /run/runc).
  std::vector<std::filesystem::path> runc_roots = {"/run/runc"};
  // Directories whose subdirectories are runc roots, one per namespace (containerd's shim).
  std::vector<std::filesystem::path> namespaced_roots = {"/run/containerd/runc"};
  // containerd state directories: each task's options.json there may name another runc root
  // (the `Root` runtime option), which is then searched as a namespaced root.
  std::vector<std::filesystem::path> containerd_states = {"/run/containerd", "/run/k3s/containerd"};
};

// The runc roots that exist now, in search order, without duplicates.
std::vector<std::filesystem::path> runtime_roots(const RootSearch& search = {});

// The one root that holds container `id` (a runc state directory `ROOT/ID` with state.json).
// Throws Error: kUsage for an id runc would not accept, kNotFound when no root holds it (the
// roots searched are named), kUsage when several do (they are named; --runtime-root picks one).
std::filesystem::path find_runtime_root(const std::string& id, const RootSearch& search = {});

}  // namespace gpusnap::container
