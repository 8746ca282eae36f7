// RAII for file descriptors: every fd gpusnap opens is owned by exactly one UniqueFd.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <utility>

namespace gpusnap::common {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.fd_, -1));
    return *this;
  }
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // Closes now and returns the errno of a failed close (0 when it succeeded): on some file
  // systems a failed write shows only there, so a writer that must know checks it.
  int close_checked() {
    if (fd_ < 0) return 0;
    return ::close(std::exchange(fd_, -1)) == 0 ? 0 : errno;
  }

 private:
  int fd_ = -1;
};

// A pipe as two owned ends; O_CLOEXEC so that children inherit only what they are given.
struct Pipe {
  UniqueFd read;
  UniqueFd write;
  static Pipe make();
};

}  // namespace gpusnap::common
