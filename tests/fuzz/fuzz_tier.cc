// The memory tier's readers of bytes gpusnap did not write itself, on arbitrary bytes: the
// drain's layout (PID.layout, read from an artifact by gpusnap-tier-prefill, src/tier/layout.h),
// the checksums a prefill writes on its SUMS-FD (engine::parse_prefill_sums), the drain's index
// (PID.json, tier::folder::parse_index, src/tier/folder_format.h) and the feed that tells a
// prefill what of an arriving artifact is written (tier/arrival.h). The first byte picks the
// reader (even: the layout; 3 mod 4: the index; 5 mod 8: the feed; else the sums); the rest is
// its input. An index the reader accepts must come out of the writer and back the same; a feed
// line accepted must name one of the files and stay within its size, and whatever the feed
// says, a wait for bytes it did not promise must fail, never hang.
//
// A layout the reader accepts is also filled, as gpusnap-tier-prefill fills it, against the fake
// driver (small layouts only) from a folder of small files: every copy must stay inside its
// pinned buffer and the mapped memory. The fake reports a copy that does not as its misuse, and
// that aborts here; any other refusal is the fill's to make.
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "common/fd.h"
#include "engine/tier_files.h"
#include "gpusnap/error.h"
#include "tier/arrival.h"
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

void feed(const std::string& whole) {
  // Within the socket's buffer: the writes below never wait for a reader that stopped.
  const std::string text = whole.substr(0, std::size_t{64} << 10);
  const std::vector<std::string> names = {"7-w0.img", "7-w1.img"};
  const std::vector<std::uint64_t> sizes = {4096, std::uint64_t{1} << 20};
  std::uint64_t promised = 0;  // of 7-w1.img, by the lines before the first bad one
  bool good = true;
  for (std::size_t at = 0; at < text.size();) {
    std::size_t nl = text.find('\n', at);
    if (nl == std::string::npos) break;  // an unfinished line is not read
    const auto got =
        tier::parse_arrival_line(std::string_view(text).substr(at, nl - at), names, sizes);
    if (got && (got->first >= names.size() || got->second > sizes[got->first])) std::abort();
    if (!got) good = false;
    if (got && good && got->first == 1) promised = std::max(promised, got->second);
    at = nl + 1;
  }
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) std::abort();
  gpusnap::common::UniqueFd ours(pair[0]);
  tier::ArrivingFiles arriving(gpusnap::common::UniqueFd(pair[1]), names, sizes);
  for (std::size_t at = 0; at < text.size();) {
    const ssize_t n = ::write(ours.get(), text.data() + at, text.size() - at);
    if (n <= 0) break;
    at += static_cast<std::size_t>(n);
  }
  ours.reset();  // the feed ends: every wait returns or throws
  try {
    arriving.wait(1, promised);  // what the lines before the first bad one promised is there
  } catch (const gpusnap::Error&) {
    std::abort();
  }
  try {
    arriving.wait(1, sizes[1] + 1);  // never promised: must throw
    std::abort();
  } catch (const gpusnap::Error&) {  // NOLINT(bugprone-empty-catch): refusing is the point
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
  } else if (data[0] % 8 == 5) {
    feed(text);
  } else {
    for (uint64_t chunk : {uint64_t{1}, uint64_t{4096}, uint64_t{64} << 20}) {
      (void)gpusnap::engine::parse_prefill_sums(text, "7", chunk);
    }
  }
  return 0;
}
