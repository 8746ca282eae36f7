#include "container/mount.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <optional>
#include <string>
#include <utility>

#include "gpusnap/error.h"

namespace gpusnap::container {

namespace {

// What the child reports when a step fails: the step and its errno.
enum Step : int {
  kDone = 0,
  kJoin,
  kRoot,
  kMakeDir,
  kAttach,
};

const char* describe(int step) {
  switch (step) {
    case kJoin: return "join its mount namespace";
    case kRoot: return "enter its root";
    case kMakeDir: return "make the mount point";
    case kAttach: return "mount the folder there";
    default: return "an unknown step";
  }
}

struct Failure {
  int step = kDone;
  int err = 0;
};

// Runs `body` in a forked child that joined the mount namespace `ns` and the root directory
// `root`; `body` returns kDone or the step that failed, with errno set. The parent has threads,
// so the child makes plain system calls only (no allocation) and leaves with _exit.
template <typename Body>
std::optional<Failure> in_container(int ns, int root, Body body) {
  common::Pipe report = common::Pipe::make();
  const pid_t child = ::fork();
  if (child < 0) throw sys_error("fork", errno);
  if (child == 0) {
    int step = kDone;
    if (::setns(ns, CLONE_NEWNS) != 0) {
      step = kJoin;
    } else if (::fchdir(root) != 0 || ::chroot(".") != 0 || ::chdir("/") != 0) {
      step = kRoot;
    } else {
      step = body();
    }
    if (step != kDone) {
      const Failure f{step, errno};
      (void)::write(report.write.get(), &f, sizeof f);
      ::_exit(1);
    }
    ::_exit(0);
  }
  report.write.reset();
  Failure f;
  ssize_t n = 0;
  do {
    n = ::read(report.read.get(), &f, sizeof f);
  } while (n < 0 && errno == EINTR);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  if (n == static_cast<ssize_t>(sizeof f)) return f;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return Failure{kDone, ECHILD};
  return std::nullopt;
}

// Takes away what a killed gpusnap may have left at `path`: its mount (or several) and the
// empty folder under it. A folder that is not empty stays, and the mkdir after this says so.
void clear_stale(const char* path) {
  for (int i = 0; i < 8 && ::umount2(path, MNT_DETACH | UMOUNT_NOFOLLOW) == 0; ++i) {
  }
  (void)::rmdir(path);
}

}  // namespace

MountInside::MountInside(pid_t target, const std::filesystem::path& host_dir,
                         std::filesystem::path inside, bool read_only)
    : inside_(std::move(inside)) {
  const std::string where = inside_.string() + " in the container of pid " + std::to_string(target);
  auto fail = [&](const std::string& what, int err) {
    return Error(
        ErrorKind::kEnvironment,
        "cannot mount " + host_dir.string() + " at " + where + ": " + what + ": " + errno_text(err),
        "the container must share gpusnap's user namespace and have its handshake "
        "directory writable; or mount that folder into it at the same path");
  };
  if (!inside_.is_absolute() || inside_.parent_path() == inside_) {
    throw fail("not a path under the container's root", EINVAL);
  }
  const std::string proc = "/proc/" + std::to_string(target);
  mnt_ns_.reset(::open((proc + "/ns/mnt").c_str(), O_RDONLY | O_CLOEXEC));
  if (!mnt_ns_) throw fail("open its mount namespace", errno);
  root_.reset(::open((proc + "/root").c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!root_) throw fail("open its root", errno);
  // The bind, detached until the child attaches it: made here, where host_dir is visible.
  common::UniqueFd tree(
      ::open_tree(AT_FDCWD, host_dir.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
  if (!tree) throw fail("bind the folder", errno);
  mount_attr attr{};
  attr.attr_set = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC |
                  (read_only ? MOUNT_ATTR_RDONLY : 0);
  if (::mount_setattr(tree.get(), "", AT_EMPTY_PATH, &attr, sizeof attr) != 0) {
    throw fail("set the bind's options", errno);
  }
  const char* path = inside_.c_str();
  const int tree_fd = tree.get();
  auto failure = in_container(mnt_ns_.get(), root_.get(), [path, tree_fd] {
    clear_stale(path);
    if (::mkdir(path, 0700) != 0) return kMakeDir;
    if (::move_mount(tree_fd, "", AT_FDCWD, path, MOVE_MOUNT_F_EMPTY_PATH) != 0) {
      const int err = errno;
      (void)::rmdir(path);
      errno = err;
      return kAttach;
    }
    return kDone;
  });
  if (failure) {
    throw fail(failure->step == kDone ? std::string("the child that mounts died")
                                      : std::string(describe(failure->step)),
               failure->err);
  }
}

MountInside::~MountInside() {
  const char* path = inside_.c_str();
  try {
    (void)in_container(mnt_ns_.get(), root_.get(), [path] {
      clear_stale(path);
      return kDone;
    });
  } catch (const Error&) {
    // No child could be made: the mount stays until the container ends, and the next mount of
    // this name clears it.
  }
}

}  // namespace gpusnap::container
