// The driver-independent pieces of the GPU seam: state names and GPU UUID text <-> bytes.
#include "gpu/driver.h"

#include "gpu/uuid.h"

namespace gpusnap::gpu {

const char* state_name(ProcessState state) {
  // The driver's own names (CU_PROCESS_STATE_*), so messages match cuda-checkpoint's output.
  switch (state) {
    case ProcessState::kRunning: return "RUNNING";
    case ProcessState::kLocked: return "LOCKED";
    case ProcessState::kCheckpointed: return "CHECKPOINTED";
    case ProcessState::kFailed: return "FAILED";
  }
  return "UNKNOWN";
}

Driver& given_or_nvidia(Driver* given, std::unique_ptr<Driver>& owned) {
  if (given != nullptr) return *given;
  owned = open_nvidia_driver();
  return *owned;
}

namespace {

constexpr std::string_view kUuidPrefix = "GPU-";
// Hex digits per dash-separated group after the prefix: 8-4-4-4-12 = 32 digits = 16 bytes.
constexpr int kGroups[] = {8, 4, 4, 4, 12};

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::optional<GpuUuidBytes> parse_gpu_uuid(std::string_view text) {
  if (!text.starts_with(kUuidPrefix)) return std::nullopt;
  text.remove_prefix(kUuidPrefix.size());

  GpuUuidBytes bytes{};
  size_t pos = 0;     // in text
  size_t nibble = 0;  // hex digits consumed so far
  for (size_t group = 0; group < std::size(kGroups); ++group) {
    if (group > 0) {
      if (pos >= text.size() || text[pos] != '-') return std::nullopt;
      ++pos;
    }
    for (int i = 0; i < kGroups[group]; ++i, ++pos, ++nibble) {
      if (pos >= text.size()) return std::nullopt;
      const int v = hex_value(text[pos]);
      if (v < 0) return std::nullopt;
      // Even nibbles are the high half of a byte: the text is the bytes in order.
      bytes[nibble / 2] |= static_cast<unsigned char>(nibble % 2 == 0 ? v << 4 : v);
    }
  }
  if (pos != text.size()) return std::nullopt;  // trailing characters
  return bytes;
}

std::string format_gpu_uuid(const GpuUuidBytes& bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kUuidPrefix);
  size_t nibble = 0;
  for (size_t group = 0; group < std::size(kGroups); ++group) {
    if (group > 0) out += '-';
    for (int i = 0; i < kGroups[group]; ++i, ++nibble) {
      const unsigned char b = bytes[nibble / 2];
      out += kHex[nibble % 2 == 0 ? b >> 4 : b & 0xf];
    }
  }
  return out;
}

}  // namespace gpusnap::gpu
