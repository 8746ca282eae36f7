// A fill's drain files read in place (docs/memory-tier.md, "Read in place"): each file mapped
// read-only, and the windows of it that a copy reads page-locked for that copy
// (cuMemHostRegister, read-only), so that the copy engine reads the page cache's own pages. A
// file's bytes then reach the GPU without a second copy through a pinned buffer: on a node that
// pulls a snapshot, the pull writes each byte once into the node's copy and the prefill's copy
// engine takes it from there. Registering caps a fill at 12.5-13 GB/s on the H100, under what the
// buffers move from a local file, so only a prefill of an arriving artifact reads in place by
// default (TierSettings::in_place).
//
// Windows are kWindowBytes-aligned ranges of a file: a copy never crosses one (the driver knows a
// registration by its range), and each window is registered once however many workers copy out
// of it at once (the driver refuses a second registration of the same pages), then let go when
// the last of them is done.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "tier/tier_driver.h"

namespace gpusnap::tier {

class InPlaceFiles {
 public:
  // The unit of registration: page-aligned, a few copies' worth of a worker's slices (4 MiB each
  // by default), so that most slices find their window registered already.
  static constexpr std::size_t kWindowBytes = std::size_t{16} << 20;

  // Maps each of `paths` read-only, from descriptors open for reading. Throws Error(kInternal).
  InPlaceFiles(TierDriver& driver, const std::vector<std::filesystem::path>& paths,
               const std::vector<common::UniqueFd>& fds);
  // Lets go of every window still registered (none after a fill that finished) and unmaps.
  ~InPlaceFiles();
  InPlaceFiles(const InPlaceFiles&) = delete;
  InPlaceFiles& operator=(const InPlaceFiles&) = delete;

  // Where byte `offset` of file `file` is mapped.
  const unsigned char* at(std::size_t file, std::uint64_t offset) const;
  std::uint64_t size(std::size_t file) const { return files_.at(file).size; }
  // Where the window holding byte `end - 1` of `file` ends (its last window ends with the file):
  // a range is registered only once every byte of its windows is final.
  std::uint64_t window_end(std::size_t file, std::uint64_t end) const;

  // The windows that bytes [offset, offset + size) of `file` lie in, registered while it lives.
  class Hold {
   public:
    Hold() = default;
    ~Hold() { reset(); }
    Hold(Hold&& other) noexcept;
    Hold& operator=(Hold&& other) noexcept;
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    explicit operator bool() const { return owner_ != nullptr; }
    void reset() noexcept;

   private:
    friend class InPlaceFiles;
    InPlaceFiles* owner_ = nullptr;
    std::size_t file_ = 0;
    std::uint64_t first_ = 0;  // windows [first_, last_]
    std::uint64_t last_ = 0;
  };
  // Registers the windows of the range (those not registered already) and holds them; an empty
  // Hold when the driver refused one (the caller copies through its pinned buffer instead; once
  // refused, never asked again in this fill). Throws Error(kBadArtifact) for a range past the
  // file's end: a file shorter than its layout says.
  Hold hold(std::size_t file, std::uint64_t offset, std::size_t size);
  // Bytes [offset, offset + size) of `file` cut at window boundaries: each piece is one copy.
  static std::vector<std::pair<std::uint64_t, std::size_t>> split(std::uint64_t offset,
                                                                  std::size_t size);
  // Whether the driver refused a registration in this fill.
  bool refused() const;

 private:
  struct Mapped {
    unsigned char* base = nullptr;
    std::uint64_t size = 0;
  };
  enum class WindowState { kRegistering, kRegistered, kLettingGo };
  struct Window {
    WindowState state = WindowState::kRegistering;
    std::size_t users = 0;
  };
  using Key = std::pair<std::size_t, std::uint64_t>;  // file, window index

  // One window: true once registered and counted as used.
  bool acquire(std::size_t file, std::uint64_t window);
  void release(std::size_t file, std::uint64_t window) noexcept;
  std::pair<void*, std::size_t> range(std::size_t file, std::uint64_t window) const;

  TierDriver& driver_;
  const std::vector<std::filesystem::path> paths_;
  std::vector<Mapped> files_;
  mutable std::mutex mu_;
  std::condition_variable changed_;
  std::map<Key, Window> windows_;
  bool refused_ = false;
};

}  // namespace gpusnap::tier
