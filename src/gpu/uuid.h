// GPU UUIDs in their two spellings: the text NVML and nvidia-smi print ("GPU-" and 32 hex digits
// grouped 8-4-4-4-12, the identity gpusnap keeps in GPU maps and manifests) and the 16 raw bytes
// the CUDA driver takes (CUuuid, e.g. in the checkpoint API's restore GPU pairs). The bytes are
// the hex digits in the order printed, so the two convert without any byte swapping.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace gpusnap::gpu {

using GpuUuidBytes = std::array<unsigned char, 16>;

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (hex digits of either case) -> 16 bytes.
// Returns nullopt for anything else: a missing "GPU-" prefix, a MIG UUID ("MIG-..."), wrong
// grouping, a non-hex digit, surrounding whitespace. The caller picks the error kind, because the
// text comes from a flag (a usage error) or from an artifact (a bad artifact).
std::optional<GpuUuidBytes> parse_gpu_uuid(std::string_view text);

// 16 bytes -> "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" in lower case, as NVML prints it, so
// format_gpu_uuid(*parse_gpu_uuid(nvml_text)) == nvml_text.
std::string format_gpu_uuid(const GpuUuidBytes& bytes);

}  // namespace gpusnap::gpu
