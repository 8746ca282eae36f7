#include "tier/layout.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "common/fd.h"
#include "gpusnap/error.h"
#include "tier/folder_format.h"

namespace gpusnap::tier {
namespace {

constexpr char kMagic[8] = {'G', 'S', 'T', 'L', 'A', 'Y', '0', '1'};
constexpr std::size_t kHeaderWords = 4;
constexpr std::size_t kSegmentWords = 3;
constexpr std::size_t kPieceWords = 4;

Error bad_layout(const std::filesystem::path& path, const std::string& why) {
  return Error(ErrorKind::kBadArtifact, "memory tier layout " + path.string() + ": " + why,
               "the artifact is damaged: run `gpusnap verify` on it, or capture it again");
}

}  // namespace

void write_layout(const std::filesystem::path& path, const TierLayout& layout) {
  std::vector<std::uint64_t> words(kHeaderWords);
  std::memcpy(words.data(), kMagic, sizeof kMagic);
  words[1] = layout.segments.size();
  words[2] = layout.pieces.size();
  words[3] = layout.files;
  for (const auto& s : layout.segments) {
    words.insert(words.end(), {s.va, s.size, static_cast<std::uint64_t>(s.device)});
  }
  for (const auto& p : layout.pieces) {
    words.insert(words.end(), {p.va, p.size, p.file, p.offset});
  }
  const auto tmp = std::filesystem::path(path.string() + ".tmp");
  common::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd.get() < 0) {
    throw Error(ErrorKind::kInternal,
                "memory tier: cannot create " + tmp.string() + ": " + errno_text(errno));
  }
  const auto* data = reinterpret_cast<const char*>(words.data());
  std::size_t left = words.size() * sizeof(std::uint64_t);
  while (left > 0) {
    const ssize_t n = ::write(fd.get(), data, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      ::unlink(tmp.c_str());
      throw Error(ErrorKind::kInternal,
                  "memory tier: cannot write " + tmp.string() + ": " + errno_text(err));
    }
    data += n;
    left -= static_cast<std::size_t>(n);
  }
  if (::close(fd.release()) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error(ErrorKind::kInternal,
                "memory tier: cannot write " + path.string() + ": " + errno_text(err));
  }
}

TierLayout read_layout(const std::filesystem::path& path) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  struct stat st {};
  if (fd.get() < 0 || ::fstat(fd.get(), &st) != 0) {
    throw bad_layout(path, "cannot open it: " + errno_text(errno));
  }
  if (!S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) > folder::kMaxLayoutBytes ||
      st.st_size % sizeof(std::uint64_t) != 0 ||
      static_cast<std::size_t>(st.st_size) < kHeaderWords * sizeof(std::uint64_t)) {
    throw bad_layout(path, "not a layout file of at most 64 MiB");
  }
  std::vector<std::uint64_t> words(static_cast<std::size_t>(st.st_size) / sizeof(std::uint64_t));
  auto* data = reinterpret_cast<char*>(words.data());
  std::size_t got = 0;
  const auto total = static_cast<std::size_t>(st.st_size);
  while (got < total) {
    const ssize_t n = ::pread(fd.get(), data + got, total - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw bad_layout(path, "shorter than it was");
    got += static_cast<std::size_t>(n);
  }
  if (std::memcmp(words.data(), kMagic, sizeof kMagic) != 0) throw bad_layout(path, "no magic");
  const std::uint64_t segments = words[1];
  const std::uint64_t pieces = words[2];
  TierLayout layout;
  layout.files = static_cast<std::size_t>(words[3]);
  if (layout.files > folder::kMaxDrainFiles || segments > words.size() || pieces > words.size() ||
      kHeaderWords + segments * kSegmentWords + pieces * kPieceWords != words.size()) {
    throw bad_layout(path, "counts that do not match its size");
  }
  std::size_t w = kHeaderWords;
  for (std::uint64_t i = 0; i < segments; ++i, w += kSegmentWords) {
    if (words[w + 1] == 0 || words[w] + words[w + 1] < words[w] || words[w + 2] > 1024) {
      throw bad_layout(path, "a segment out of range");
    }
    layout.segments.push_back(
        {words[w], static_cast<std::size_t>(words[w + 1]), static_cast<int>(words[w + 2])});
  }
  std::sort(layout.segments.begin(), layout.segments.end(),
            [](const auto& a, const auto& b) { return a.va < b.va; });
  for (std::size_t i = 1; i < layout.segments.size(); ++i) {
    const auto& prev = layout.segments[i - 1];
    if (prev.va + prev.size > layout.segments[i].va) throw bad_layout(path, "segments overlap");
  }
  for (std::uint64_t i = 0; i < pieces; ++i, w += kPieceWords) {
    FilePiece p{words[w], static_cast<std::size_t>(words[w + 1]), 0,
                static_cast<std::size_t>(words[w + 2]), words[w + 3]};
    // The segment holding it, whole: a piece never crosses segments.
    auto s = std::upper_bound(layout.segments.begin(), layout.segments.end(), p.va,
                              [](DevicePtr va, const LayoutSegment& seg) { return va < seg.va; });
    if (p.size == 0 || p.file >= layout.files || s == layout.segments.begin() ||
        p.offset + p.size < p.offset) {
      throw bad_layout(path, "a piece out of range");
    }
    --s;
    if (p.va + p.size < p.va || p.va + p.size > s->va + s->size) {
      throw bad_layout(path, "a piece outside its segment");
    }
    p.device = s->device;
    layout.pieces.push_back(p);
  }
  return layout;
}

}  // namespace gpusnap::tier
