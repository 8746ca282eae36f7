// CRIU's cache of what it learnt about the kernel. Each time CRIU starts it probes the kernel
// (namespaces, a veth pair, the vDSO, CPU features): 0.06-0.08 s of every dump and restore,
// unless it finds /run/criu.kdat, which it writes only where /run is a tmpfs (so that a reboot
// clears it). Where /run is not a tmpfs, gpusnap makes that cache for it.
#pragma once

#include "criu/criu.h"

namespace gpusnap::criu {

// Where CRIU reads its cache (fixed in CRIU), and gpusnap's stamp beside it: this boot's
// boot_id, and the CRIU that wrote the cache.
inline constexpr const char* kKernelCache = "/run/criu.kdat";
inline constexpr const char* kKernelCacheStamp = "/run/criu.kdat.gpusnap";

// Makes sure `criu` finds its kernel cache: nothing where /run is a tmpfs (CRIU keeps its own)
// or where the cache carries the stamp of this boot and this CRIU. Otherwise CRIU is run once
// (`criu check`, 0.1 s) in a mount namespace of its own, a fresh folder on /dev/shm (a tmpfs)
// bound over /run; the cache it writes there is put at kKernelCache (root's, 0600) and stamped.
// A cache from an earlier boot is thus replaced before gpusnap's CRIU runs again. Returns
// whether it made the cache. Never throws: without the cache CRIU only starts slower.
bool keep_kernel_cache(const Binary& criu);

}  // namespace gpusnap::criu
