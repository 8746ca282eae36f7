#include "common/fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "common/fd.h"
#include "gpusnap/error.h"

namespace gpusnap {

namespace common {

Pipe Pipe::make() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw sys_error("pipe2", errno);
  return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

}  // namespace common

namespace fs {

std::string read_file(const std::filesystem::path& path) {
  std::string out;
  if (!try_read_file(path, &out)) throw sys_error("read " + path.string(), errno);
  return out;
}

// The rest of fd into *out; false (errno EFBIG) once it would pass max_bytes.
static bool read_all(int fd, std::string* out, size_t max_bytes) {
  out->clear();
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    if (n == 0) return true;
    if (out->size() + static_cast<size_t>(n) > max_bytes) {
      errno = EFBIG;
      return false;
    }
    out->append(buf, static_cast<size_t>(n));
  }
}

bool try_read_file(const std::filesystem::path& path, std::string* out) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  return fd && read_all(fd.get(), out, SIZE_MAX);
}

bool try_read_regular_file(const std::filesystem::path& path, std::string* out, size_t max_bytes) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd) return false;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return false;
  if (!S_ISREG(st.st_mode)) {
    errno = EINVAL;
    return false;
  }
  return read_all(fd.get(), out, max_bytes);
}

static void write_all(int fd, const std::string& data, const std::string& what) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw sys_error("write " + what, errno);
    off += static_cast<size_t>(n);
  }
}

void write_file(const std::filesystem::path& path, const std::string& data) {
  common::UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) throw sys_error("create " + path.string(), errno);
  write_all(fd.get(), data, path.string());
}

void fsync_path(const std::filesystem::path& path) {
  common::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw sys_error("open " + path.string(), errno);
  if (::fsync(fd.get()) != 0) throw sys_error("fsync " + path.string(), errno);
}

void write_file_durable(const std::filesystem::path& path, const std::string& data) {
  // A name of this writer's own (two gpusnap processes may write the same file at once), made
  // root's only from its first instant: what gpusnap records is nobody else's to read.
  auto tmp = path;
  tmp += ".tmp-" + std::to_string(::getpid()) + "-" + random_id().substr(0, 8);
  try {
    common::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) throw sys_error("create " + tmp.string(), errno);
    write_all(fd.get(), data, tmp.string());
    if (::fsync(fd.get()) != 0) throw sys_error("fsync " + tmp.string(), errno);
    if (::rename(tmp.c_str(), path.c_str()) != 0) throw sys_error("rename " + tmp.string(), errno);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_path(path.parent_path().empty() ? "." : path.parent_path());
}

void fsync_tree(const std::filesystem::path& root) {
  std::vector<std::filesystem::path> dirs{root};
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    if (entry.is_directory()) {
      dirs.push_back(entry.path());
    } else if (entry.is_regular_file()) {
      fsync_path(entry.path());
    }
  }
  std::for_each(dirs.rbegin(), dirs.rend(), [](const auto& dir) { fsync_path(dir); });
}

void restrict_tree(const std::filesystem::path& root, std::optional<gid_t> group) {
  auto restrict = [&](const std::filesystem::path& path, bool dir) {
    mode_t mode = dir ? (group ? 0750 : 0700) : (group ? 0640 : 0600);
    // A read-only file stays read-only and keeps exactly 0400: a host image is mapped by the
    // workload, so CRIU records its mode at the dump and refuses a restore where it differs.
    struct stat st {};
    if (!dir && ::lstat(path.c_str(), &st) == 0 && (st.st_mode & S_IWUSR) == 0) mode = 0400;
    if (group && ::lchown(path.c_str(), static_cast<uid_t>(-1), *group) != 0) {
      throw sys_error("give " + path.string() + " to group " + std::to_string(*group), errno);
    }
    if (::chmod(path.c_str(), mode) != 0) throw sys_error("chmod " + path.string(), errno);
  };
  restrict(root, true);
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    const auto status = entry.symlink_status();
    if (std::filesystem::is_directory(status)) {
      restrict(entry.path(), true);
    } else if (std::filesystem::is_regular_file(status)) {
      restrict(entry.path(), false);
    }
  }
}

void remove_tree_noexcept(const std::filesystem::path& path) noexcept {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::string read_token_file(const std::filesystem::path& file, const std::string& flag) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      throw Error(ErrorKind::kUsage, "token file " + file.string() + " does not exist",
                  "write the token there first (`openssl rand -hex 32 > FILE; chmod 600 FILE`), "
                  "or give the right " +
                      flag);
    }
    throw sys_error("read token file " + file.string(), errno);
  }
  if ((st.st_mode & S_IROTH) != 0) {
    throw Error(ErrorKind::kUsage, "token file " + file.string() + " is readable by everyone",
                "chmod o-r " + file.string());
  }
  std::string token = read_file(file);
  token = token.substr(0, token.find('\n'));
  while (!token.empty() && (token.back() == '\r' || token.back() == ' ' || token.back() == '\t')) {
    token.pop_back();
  }
  if (token.size() < 16) {
    throw Error(ErrorKind::kUsage, "token in " + file.string() + " is shorter than 16 characters",
                "write a long random token, e.g. `openssl rand -hex 32 > FILE`");
  }
  return token;
}

std::string random_id() {
  unsigned char bytes[16];
  common::UniqueFd fd(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
  if (!fd || ::read(fd.get(), bytes, sizeof bytes) != static_cast<ssize_t>(sizeof bytes)) {
    throw sys_error("read /dev/urandom", errno);
  }
  static const char* hex = "0123456789abcdef";
  std::string id;
  for (unsigned char b : bytes) {
    id += hex[b >> 4];
    id += hex[b & 15];
  }
  return id;
}

std::string human_bytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, unit == 0 ? "%.0f %s" : "%.1f %s", value, units[unit]);
  return buf;
}

}  // namespace fs
}  // namespace gpusnap
