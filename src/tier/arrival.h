// The drain files of an artifact still arriving, for a prefill (tier/prefill.h) that fills the
// copy's memory as the pull writes them (store/stream.h). gpusnap tells the prefill, on a
// descriptor of its own, how much of each file is written from its first byte, every byte
// checked against its digest: a line "NAME BYTES" each time a prefix grows. The prefill's
// workers wait for the bytes they read (FillHooks::before_read), so the fill keeps pace with the
// pull instead of starting after its last byte.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "common/fd.h"

namespace gpusnap::tier {

// The longest line gpusnap writes (a drain file's name and a number), with room to spare; a
// longer one is malformed.
inline constexpr std::size_t kMaxArrivalLine = 256;

// One line, without its newline: the index in `names` of the file it names and its prefix in
// bytes; nothing when the line is malformed, names another file, or says more bytes than
// `sizes` gives that file.
std::optional<std::pair<std::size_t, std::uint64_t>> parse_arrival_line(
    std::string_view line, const std::vector<std::string>& names,
    const std::vector<std::uint64_t>& sizes);

class ArrivingFiles {
 public:
  // Reads `feed` on a thread of its own until its end. `names` the drain files (PID-wK.img),
  // `sizes` their sizes in bytes.
  ArrivingFiles(common::UniqueFd feed, std::vector<std::string> names,
                std::vector<std::uint64_t> sizes);
  // Stops reading (shuts the feed down) and joins the thread.
  ~ArrivingFiles();
  ArrivingFiles(const ArrivingFiles&) = delete;
  ArrivingFiles& operator=(const ArrivingFiles&) = delete;

  // Blocks until the first `end` bytes of file `file` are written. Throws Error(kBadArtifact)
  // when the feed ended or sent a malformed line first: the pull stopped (its restore fails) or
  // gpusnap is gone, and the fill must not read bytes that never came.
  void wait(std::size_t file, std::uint64_t end);

 private:
  void read_feed();

  common::UniqueFd feed_;
  const std::vector<std::string> names_;
  const std::vector<std::uint64_t> sizes_;
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<std::uint64_t> written_;
  std::string ended_;   // why the feed ended; empty while it goes on
  std::thread reader_;  // last: starts once everything above is built
};

}  // namespace gpusnap::tier
