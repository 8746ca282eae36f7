#include "engine/capture_lock.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <system_error>

#include "gpusnap/error.h"

namespace gpusnap::engine {

CaptureLock::CaptureLock(const std::filesystem::path& run_dir, const std::vector<pid_t>& pids) {
  std::error_code ec;
  std::filesystem::create_directories(run_dir, ec);
  const auto path = run_dir / "captures.lock";
  fd_ = common::UniqueFd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd_) throw sys_error("open " + path.string(), errno);
  for (pid_t pid : pids) {
    struct flock lock {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    lock.l_start = pid;
    lock.l_len = 1;
    if (::fcntl(fd_.get(), F_OFD_SETLK, &lock) == 0) continue;
    if (errno != EAGAIN && errno != EACCES) throw sys_error("lock " + path.string(), errno);
    throw Error(ErrorKind::kUsage,
                "process " + std::to_string(pid) + " is being captured by another gpusnap",
                "wait for that capture to end, then try again");
  }
}

}  // namespace gpusnap::engine
