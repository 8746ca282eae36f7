#include "kube/heartbeat.h"

#include <fcntl.h>
#include <sys/stat.h>

#include "common/fd.h"

namespace gpusnap::kube {

void Heartbeat::beat() const noexcept {
  if (file_.empty()) return;
  // Opened (created 0644, readable by the probe whatever user it runs as) and stamped through
  // the fd: one path lookup, and no window in which the file exists with an old time.
  common::UniqueFd fd(::open(file_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd) ::futimens(fd.get(), nullptr);
}

}  // namespace gpusnap::kube
