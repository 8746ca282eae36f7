// The memory tier for Python workloads that `gpusnap run --memory-tier` starts, without the
// workload calling gpusnap_handshake.use_memory_tier() itself (docs/memory-tier.md).
// gpusnap's Python site folder holds a sitecustomize.py (clients/python/gpusnap_site/) and
// gpusnap_handshake.py; put first on the workload's PYTHONPATH, with GPUSNAP_MEMORY_TIER=1, its
// sitecustomize installs the tier as soon as the workload has imported torch. Without the
// variable it only imports the sitecustomize it hides: a PYTHONPATH that other programs inherit
// changes nothing for them.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace gpusnap::engine {

// Names the site folder to use instead of the one found beside gpusnap.
inline constexpr const char* kPythonSiteEnv = "GPUSNAP_PYTHON_SITE";
// "1" asks the site folder's sitecustomize to install the tier (clients/python/gpusnap_site/).
inline constexpr const char* kMemoryTierEnv = "GPUSNAP_MEMORY_TIER";
// A host-wide place for the folder, when there is none beside the gpusnap binary. A node's
// install (deploy/) puts it beside: /opt/gpusnap/bin/python, which pods mount with gpusnap.
inline constexpr const char* kInstalledPythonSite = "/opt/gpusnap/python";

// The site folder: $GPUSNAP_PYTHON_SITE when set and not empty, else python/ beside the running
// binary (the build tree: CMake copies the folder there), else /opt/gpusnap/python. A folder
// counts when it holds sitecustomize.py and gpusnap_handshake.py, both readable. Throws
// Error(kUsage) when the variable names a folder that does not, or when none is found: the
// workload would otherwise start without the tier it was asked to have.
std::filesystem::path find_python_site();

// The "KEY=VALUE" entries a Python workload's environment gets for the tier: PYTHONPATH with
// `site` (find_python_site()) first and any PYTHONPATH of gpusnap's own environment kept after
// it, and GPUSNAP_MEMORY_TIER=1.
std::vector<std::string> memory_tier_environment(const std::filesystem::path& site);

}  // namespace gpusnap::engine
