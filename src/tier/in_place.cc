#include "tier/in_place.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>

#include "gpusnap/error.h"

namespace gpusnap::tier {

InPlaceFiles::InPlaceFiles(TierDriver& driver, const std::vector<std::filesystem::path>& paths,
                           const std::vector<common::UniqueFd>& fds)
    : driver_(driver), paths_(paths) {
  try {
    for (std::size_t k = 0; k < fds.size(); ++k) {
      struct stat st {};
      if (::fstat(fds[k].get(), &st) != 0) throw sys_error("stat " + paths.at(k).string(), errno);
      Mapped m;
      m.size = static_cast<std::uint64_t>(st.st_size);
      if (m.size > 0) {
        void* p = ::mmap(nullptr, m.size, PROT_READ, MAP_SHARED, fds[k].get(), 0);
        if (p == MAP_FAILED) throw sys_error("map " + paths.at(k).string(), errno);
        m.base = static_cast<unsigned char*>(p);
      }
      files_.push_back(m);
    }
  } catch (...) {
    for (const auto& m : files_) {
      if (m.base != nullptr) ::munmap(m.base, m.size);
    }
    throw;
  }
}

InPlaceFiles::~InPlaceFiles() {
  // Every Hold went with its worker; a window still here is a bug's, and is let go all the same:
  // the mapping must not outlive its registration.
  for (const auto& [key, window] : windows_) {
    if (window.state == WindowState::kRegistered)
      driver_.host_unregister(range(key.first, key.second).first);
  }
  for (const auto& m : files_) {
    if (m.base != nullptr) ::munmap(m.base, m.size);
  }
}

const unsigned char* InPlaceFiles::at(std::size_t file, std::uint64_t offset) const {
  return files_.at(file).base + offset;
}

std::uint64_t InPlaceFiles::window_end(std::size_t file, std::uint64_t end) const {
  const std::uint64_t size = files_.at(file).size;
  if (end == 0) return 0;
  return std::min(size, ((end - 1) / kWindowBytes + 1) * kWindowBytes);
}

std::pair<void*, std::size_t> InPlaceFiles::range(std::size_t file, std::uint64_t window) const {
  const Mapped& m = files_.at(file);
  const std::uint64_t from = window * kWindowBytes;
  return {m.base + from,
          static_cast<std::size_t>(std::min<std::uint64_t>(kWindowBytes, m.size - from))};
}

std::vector<std::pair<std::uint64_t, std::size_t>> InPlaceFiles::split(std::uint64_t offset,
                                                                       std::size_t size) {
  std::vector<std::pair<std::uint64_t, std::size_t>> parts;
  while (size > 0) {
    const std::uint64_t room = kWindowBytes - offset % kWindowBytes;
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(room, size));
    parts.emplace_back(offset, n);
    offset += n;
    size -= n;
  }
  return parts;
}

bool InPlaceFiles::refused() const {
  std::lock_guard lock(mu_);
  return refused_;
}

bool InPlaceFiles::acquire(std::size_t file, std::uint64_t window) {
  const Key key{file, window};
  std::unique_lock lock(mu_);
  for (;;) {
    if (refused_) return false;
    auto it = windows_.find(key);
    if (it == windows_.end()) break;
    if (it->second.state == WindowState::kRegistered) {
      ++it->second.users;
      return true;
    }
    // Being registered by another worker, or let go: wait for either to finish.
    changed_.wait(lock);
  }
  windows_[key] = Window{WindowState::kRegistering, 1};
  lock.unlock();
  // Outside the lock: registering pins the window's pages, the slow part, and the other
  // workers register their own windows meanwhile.
  const auto [p, n] = range(file, window);
  const bool ok = driver_.host_register(p, n);
  lock.lock();
  if (ok) {
    windows_[key].state = WindowState::kRegistered;
  } else {
    windows_.erase(key);
    refused_ = true;
  }
  changed_.notify_all();
  return ok;
}

void InPlaceFiles::release(std::size_t file, std::uint64_t window) noexcept {
  const Key key{file, window};
  std::unique_lock lock(mu_);
  auto it = windows_.find(key);
  if (it == windows_.end() || --it->second.users > 0) return;
  it->second.state = WindowState::kLettingGo;
  lock.unlock();
  driver_.host_unregister(range(file, window).first);
  lock.lock();
  windows_.erase(key);
  changed_.notify_all();
}

InPlaceFiles::Hold InPlaceFiles::hold(std::size_t file, std::uint64_t offset, std::size_t size) {
  if (file >= files_.size() || size == 0) {
    throw Error(ErrorKind::kBadArtifact,
                "memory tier: a piece names file " + std::to_string(file) + " of " +
                    std::to_string(files_.size()),
                "the artifact is damaged: capture it again");
  }
  if (offset > files_[file].size || size > files_[file].size - offset) {
    // As a read past its end says it (transfer.cc): the mapping ends where the file does.
    throw Error(ErrorKind::kBadArtifact,
                "memory tier: " + paths_[file].string() + " ends at byte " +
                    std::to_string(files_[file].size) +
                    ", before the contents the drain wrote there",
                "the artifact is damaged: run `gpusnap verify` on it, or capture it again");
  }
  Hold h;
  const std::uint64_t first = offset / kWindowBytes;
  const std::uint64_t last = (offset + size - 1) / kWindowBytes;
  for (std::uint64_t w = first; w <= last; ++w) {
    if (!acquire(file, w)) {
      for (std::uint64_t v = first; v < w; ++v) release(file, v);
      return h;
    }
  }
  h.owner_ = this;
  h.file_ = file;
  h.first_ = first;
  h.last_ = last;
  return h;
}

InPlaceFiles::Hold::Hold(Hold&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      file_(other.file_),
      first_(other.first_),
      last_(other.last_) {}

InPlaceFiles::Hold& InPlaceFiles::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = std::exchange(other.owner_, nullptr);
    file_ = other.file_;
    first_ = other.first_;
    last_ = other.last_;
  }
  return *this;
}

void InPlaceFiles::Hold::reset() noexcept {
  if (owner_ == nullptr) return;
  for (std::uint64_t w = first_; w <= last_; ++w) owner_->release(file_, w);
  owner_ = nullptr;
}

}  // namespace gpusnap::tier
