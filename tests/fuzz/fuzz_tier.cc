// The memory tier's readers of bytes gpusnap did not write itself, on arbitrary bytes: the
// drain's layout (PID.layout, read from an artifact by gpusnap-tier-prefill, src/tier/layout.h),
// the checksums a prefill writes on its SUMS-FD (engine::parse_prefill_sums) and the drain's index
// (PID.json, tier::folder::parse_index, src/tier/folder_format.h). The first byte picks the
// reader (even: the layout; odd: the sums, or the index for 3 mod 4); the rest is its input. An
// index the reader accepts must come out of the writer and back the same.
//
// A layout the reader accepts is also filled, as gpusnap-tier-prefill fills it, against the fake
// driver (small layouts only) from a folder of small files: every copy must stay inside its
// pinned buffer and the mapped memory. The fake reports a copy that does not as its misuse, and
// that aborts here; any other refusal is the fill's to make.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "engine/tier_files.h"
#include "gpusnap/error.h"
#include "tier/fake_tier_driver.h"
#include "tier/folder_format.h"
#include "tier/layout.h"
#include "tier/prefill.h"

namespace {

namespace tier = gpusnap::tier;

constexpr std::size_t kFiles = 4;
constexpr std::size_t kFileBytes = std::size_t{96} << 10;
constexpr std::size_t kGranularity = std::size_t{2} << 20;  // the fake's
constexpr std::size_t kMaxFilled = std::size_t{16} << 20;

// kFiles files of kFileBytes, made once and removed at exit (the corpus replay runs in every
// suite run).
const std::filesystem::path& files_folder() {
  struct Folder {
    std::filesystem::path path;
    Folder() {
      char name[] = "/tmp/gpusnap-fuzz-tier-XXXXXX";
      if (::mkdtemp(name) == nullptr) std::abort();
      path = name;
      const std::vector<char> bytes(kFileBytes, 'x');
      for (std::size_t k = 0; k < kFiles; ++k) {
        std::ofstream(path / ("f" + std::to_string(k)), std::ios::binary)
            .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      }
    }
    Folder(const Folder&) = delete;
    Folder& operator=(const Folder&) = delete;
    ~Folder() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Folder folder;
  return folder.path;
}

void fill(const tier::TierLayout& layout) {
  std::size_t total = 0;
  for (const auto& s : layout.segments) {
    if (s.size % kGranularity != 0 || s.size > kMaxFilled) return;
    total += s.size;
  }
  if (total == 0 || total > kMaxFilled || layout.files > kFiles) return;
  std::vector<std::string> names;
  for (std::size_t k = 0; k < layout.files; ++k) names.push_back("f" + std::to_string(k));
  tier::FakeTierDriver driver(1, 2 * kMaxFilled);
  tier::TierSettings settings;
  settings.streams = 2;
  settings.buffer_bytes = std::size_t{64} << 10;
  try {
    tier::Prefill prefill(driver, settings, layout, files_folder(), names, 0, 4096);
    (void)prefill.fill();
  } catch (const gpusnap::Error& e) {
    if (std::string(e.what()).find("(fake driver)") != std::string::npos) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    // read_layout opens a regular file without following links: a file of the folder, written
    // again for each input.
    const auto path = files_folder() / "fuzz.layout";
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(text.data(), static_cast<std::streamsize>(text.size()));
    try {
      fill(gpusnap::tier::read_layout(path));
    } catch (const gpusnap::Error&) {  // NOLINT(bugprone-empty-catch): refusing is the point
    }
  } else if (data[0] % 4 == 3) {
    namespace folder = gpusnap::tier::folder;
    const auto index = folder::parse_index(text);
    if (index) {
      const auto again = folder::parse_index(folder::index_text(*index));
      if (!again || folder::index_text(*again) != folder::index_text(*index)) std::abort();
    }
  } else {
    for (uint64_t chunk : {uint64_t{1}, uint64_t{4096}, uint64_t{64} << 20}) {
      (void)gpusnap::engine::parse_prefill_sums(text, "7", chunk);
    }
  }
  return 0;
}
