// containerd for the tests that run containers as a Kubernetes node does: Debian's containerd
// started by the test with its own root, state, socket and config (no system service), an image
// the test builds (scripts/build-image --rootfs) imported into the kubelet's namespace (k8s.io),
// and containers run from it by `ctr` with the runc v2 shim. The shim keeps its runc state
// where it does on a node (/run/containerd/runc/k8s.io), so gpusnap finds the containers by ID.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/subprocess.h"
#include "testing/harness.h"

namespace gpusnap::testing {

// Why containerd-managed containers cannot run here (what runc_blocker() says, or no
// containerd, ctr or runc v2 shim); nullopt if they can.
std::optional<std::string> containerd_blocker();

// A containerd of the test's own in `dir`, stopped (and its containers removed) at the end.
class Containerd {
 public:
  explicit Containerd(const std::filesystem::path& dir);
  Containerd(const Containerd&) = delete;
  Containerd& operator=(const Containerd&) = delete;
  ~Containerd();

  // Why it did not start (its log's last lines); nullopt when it serves.
  const std::optional<std::string>& failure() const { return failure_; }
  // `ctr -a SOCKET -n k8s.io ARGS...`, its output and status.
  common::RunResult ctr(const std::vector<std::string>& args) const;
  // The test image, built from make_rootfs() and imported once; its reference.
  const std::string& image();
  // Stops containerd with SIGKILL (its shims and containers go on, as on a node) and, when
  // `start_again`, starts it again on the same root and state.
  void kill(bool start_again);
  pid_t pid() const { return daemon_ ? daemon_->pid() : 0; }
  const std::filesystem::path& dir() const { return dir_; }

 private:
  void start();

  std::filesystem::path dir_;
  std::optional<common::Subprocess> daemon_;
  std::optional<std::string> failure_;
  std::string image_;
};

// A container run by containerd (`ctr run -d`, runc v2 shim) from the test image with `args`,
// mounted as make_bundle() mounts a runc bundle (gpusnap and the preload library read-only in
// /bin, a tmpfs /tmp, a handshake directory /control); its output goes to a log file, as the
// kubelet's containers' does. Killed and deleted at the end.
class ManagedContainer {
 public:
  ManagedContainer(Containerd& containerd, std::string id, const std::vector<std::string>& args);
  ManagedContainer(const ManagedContainer&) = delete;
  ManagedContainer& operator=(const ManagedContainer&) = delete;
  ~ManagedContainer();

  bool started() const { return pid_ > 0; }
  const std::string& id() const { return id_; }
  pid_t pid() const { return pid_; }  // its PID 1, as the host sees it
  std::string start_output() const { return start_output_; }
  // The task's status as `ctr task ls` reports it ("RUNNING", "STOPPED", ...); "" if absent.
  std::string status() const;
  // The task's pid as `ctr task ls` reports it; 0 if absent.
  pid_t listed_pid() const;
  std::filesystem::path log() const { return log_; }

 private:
  // The `ctr task ls` line of this task, split in words.
  std::vector<std::string> listed() const;

  Containerd& containerd_;
  std::string id_;
  std::filesystem::path log_;
  std::string start_output_;
  pid_t pid_ = 0;
};

}  // namespace gpusnap::testing
