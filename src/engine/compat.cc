#include "engine/compat.h"

#include <algorithm>

#include "criu/criu.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"

namespace gpusnap {

namespace {

// CPU flags that name instruction-set extensions: a process that used one at checkpoint time
// may execute it again after restore, so the target must have every one the source had. Other
// cpuinfo flags (hypervisor, constant_tsc, ...) describe the machine, not what code may run.
// ("pni", Prescott New Instructions, is how cpuinfo spells SSE3.)
bool is_instruction_set_flag(const std::string& flag) {
  static const char* kPrefixes[] = {"sse",   "pni",    "ssse3",  "avx",   "fma",        "f16c",
                                    "bmi",   "adx",    "aes",    "sha",   "pclmulqdq",  "popcnt",
                                    "movbe", "rdrand", "rdseed", "vaes",  "vpclmulqdq", "gfni",
                                    "amx",   "xsave",  "abm",    "lzcnt", "erms",       "fsrm",
                                    "cx16",  "mmx",    "sve",    "asimd"};
  return std::any_of(std::begin(kPrefixes), std::end(kPrefixes),
                     [&](const char* p) { return flag.rfind(p, 0) == 0; });
}

}  // namespace

void check_host_compatible(const Manifest& m, const HostFacts& here) {
  if (m.host.arch != here.arch) {
    throw Error(ErrorKind::kIncompatible,
                "artifact was taken on " + m.host.arch + ", this host is " + here.arch,
                "restore it on a " + m.host.arch + " host");
  }
  if (m.host.page_size != here.page_size) {
    throw Error(ErrorKind::kIncompatible,
                "artifact was taken with " + std::to_string(m.host.page_size) +
                    "-byte pages, this host uses " + std::to_string(here.page_size),
                "restore it on a host with the same page size");
  }
  // HostFacts::probe sorts cpu_flags, but a HostFacts may come from elsewhere (a caller, a
  // test): binary_search needs a sorted copy, not a promise.
  std::vector<std::string> here_flags = here.cpu_flags;
  std::sort(here_flags.begin(), here_flags.end());
  std::vector<std::string> missing;
  for (const auto& flag : m.host.cpu_flags) {
    if (is_instruction_set_flag(flag) &&
        !std::binary_search(here_flags.begin(), here_flags.end(), flag)) {
      missing.push_back(flag);
    }
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 8) list += ", ...";
    throw Error(ErrorKind::kIncompatible,
                "this host's CPU lacks instruction sets the source used: " + list,
                "restore it on a host with the source's CPU model (" + m.host.cpu_model + ")");
  }
  const auto wanted = criu::parse_version(m.host.criu_version).value_or(criu::Version{});
  if (!criu::version_at_least(here.criu_version, wanted.major, wanted.minor)) {
    throw Error(ErrorKind::kIncompatible,
                "artifact was written by CRIU " + m.host.criu_version + ", this host has CRIU " +
                    here.criu_version,
                "install CRIU " + m.host.criu_version + " or newer (scripts/install-criu)");
  }
}

namespace engine {

GpuPlan check_restorable(const Manifest& manifest, const std::string& criu_version,
                         gpu::Driver& driver, const std::vector<std::string>& gpu_map,
                         int replicas) {
  check_host_compatible(manifest, HostFacts::probe(criu_version));
  return plan_gpu_restore(manifest.gpu, driver, gpu_map, replicas);
}

}  // namespace engine

}  // namespace gpusnap
