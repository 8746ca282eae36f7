#include "tier/arrival.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>

#include "gpusnap/error.h"

namespace gpusnap::tier {

std::optional<std::pair<std::size_t, std::uint64_t>> parse_arrival_line(
    std::string_view line, const std::vector<std::string>& names,
    const std::vector<std::uint64_t>& sizes) {
  const std::size_t space = line.find(' ');
  if (space == std::string_view::npos || line.size() > kMaxArrivalLine) return std::nullopt;
  const std::string_view name = line.substr(0, space);
  const std::string_view number = line.substr(space + 1);
  std::uint64_t bytes = 0;
  const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), bytes);
  if (number.empty() || ec != std::errc() || end != number.data() + number.size()) {
    return std::nullopt;
  }
  const auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) return std::nullopt;
  const auto file = static_cast<std::size_t>(it - names.begin());
  if (file >= sizes.size() || bytes > sizes[file]) return std::nullopt;
  return std::make_pair(file, bytes);
}

ArrivingFiles::ArrivingFiles(common::UniqueFd feed, std::vector<std::string> names,
                             std::vector<std::uint64_t> sizes)
    : feed_(std::move(feed)),
      names_(std::move(names)),
      sizes_(std::move(sizes)),
      written_(names_.size(), 0),
      reader_([this] { read_feed(); }) {}

ArrivingFiles::~ArrivingFiles() {
  // The reader blocks in read(): a shutdown ends it (the feed is a socket).
  ::shutdown(feed_.get(), SHUT_RDWR);
  reader_.join();
}

void ArrivingFiles::read_feed() {
  std::string pending;
  char buffer[4096];
  std::string why = "gpusnap stopped sending the artifact's bytes before the last arrived";
  for (;;) {
    const ssize_t n = ::read(feed_.get(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buffer, static_cast<std::size_t>(n));
    std::size_t at = 0;
    bool bad = false;
    for (std::size_t nl; (nl = pending.find('\n', at)) != std::string::npos; at = nl + 1) {
      const auto got =
          parse_arrival_line(std::string_view(pending).substr(at, nl - at), names_, sizes_);
      if (!got) {
        bad = true;
        break;
      }
      std::lock_guard lock(mu_);
      written_[got->first] = std::max(written_[got->first], got->second);
      changed_.notify_all();
    }
    pending.erase(0, at);
    if (bad || pending.size() > kMaxArrivalLine) {
      why = "gpusnap sent a malformed line about the arriving artifact";
      break;
    }
  }
  std::lock_guard lock(mu_);
  ended_ = why;
  changed_.notify_all();
}

void ArrivingFiles::wait(std::size_t file, std::uint64_t end) {
  std::unique_lock lock(mu_);
  changed_.wait(
      lock, [&] { return file >= written_.size() || written_[file] >= end || !ended_.empty(); });
  if (file >= written_.size() || written_[file] < end) {
    throw Error(ErrorKind::kBadArtifact,
                "memory tier prefill: " +
                    (file < names_.size() ? names_[file] : "file " + std::to_string(file)) +
                    " did not arrive: " + ended_);
  }
}

}  // namespace gpusnap::tier
