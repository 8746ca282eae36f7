// Helpers for the tests that run real runc containers (tests/container, tests/kube): a busybox
// root filesystem holding the test workloads, an OCI bundle around it, a container run
// detached by runc and deleted at the end, and a request to a workload in a container's
// network namespace. Nothing here fakes the runtime; it only drives runc as a shim would.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "testing/harness.h"

namespace gpusnap::testing {

// The port the workloads listen on inside their containers (each has its own network
// namespace, so every container uses the same one).
inline constexpr uint16_t kContainerPort = 7000;

// Why real containers cannot run here (no root, no CRIU, no runc, no busybox); nullopt if
// they can.
std::optional<std::string> runc_blocker();
#define SKIP_WITHOUT_RUNC() GPUSNAP_SKIP_IF_BLOCKED(::gpusnap::testing::runc_blocker())

// Copies `binary` and the shared libraries it loads (as ldd lists them) into `rootfs` at `as`.
void install_binary(const std::filesystem::path& rootfs, const std::filesystem::path& binary,
                    const std::string& as);

// A busybox root filesystem in `rootfs` with the test workloads and their libraries, and empty
// files at /bin/gpusnap and /bin/libgpusnap-preload.so for the built ones to be bind-mounted on.
void make_rootfs(const std::filesystem::path& rootfs);

// An OCI bundle in `dir`: make_rootfs()'s root filesystem, and runc's default
// config.json edited for `args`: no terminal, the built gpusnap and libgpusnap-preload.so
// bind-mounted read-only in /bin, a tmpfs /tmp, a handshake directory
// (GPUSNAP_CONTROL_DIR=/control) on a tmpfs of its own. Returns `dir`.
std::filesystem::path make_bundle(const std::filesystem::path& dir,
                                  const std::vector<std::string>& args);

// Why a container of the host's programs (make_python_bundle) cannot run here: no root, no CRIU,
// no runc on the PATH (the GPU machine has none of its own: a carried one will do).
std::optional<std::string> host_container_blocker();

// An OCI bundle in `dir` for a Python workload: the host's /usr and /etc as its root filesystem
// (read-only binds, /bin, /lib, /lib64 and /sbin linked into /usr as on a merged-/usr system),
// the built tests folder read-only at /tests (PYTHONPATH), gpusnap, its libraries
// (libgpusnap-preload.so, libgpusnap-tier.so) and its Python site folder (python/) read-only in
// /gpusnap, as a node's /opt/gpusnap/bin (/bin is the host's), a tmpfs
// /tmp, the handshake directory /control on a tmpfs of its own, and `data` (when given)
// writable at /data. With `gpu`: the host's /opt too (where a Python environment may live), the
// NVIDIA device files, every device allowed, and the host's PATH and LD_LIBRARY_PATH, as a GPU
// pod's runtime gives them. Returns `dir`.
std::filesystem::path make_python_bundle(const std::filesystem::path& dir,
                                         const std::vector<std::string>& args, bool gpu = false,
                                         const std::filesystem::path& data = {});
inline constexpr const char* kPythonBundleGpusnap = "/gpusnap/gpusnap";

// A container run detached by runc, deleted (runc delete -f) whatever the test's outcome. Its
// output goes into a pipe this object holds, as a runtime's shim would.
class Container {
 public:
  Container(const std::filesystem::path& runtime_root, std::string id,
            const std::filesystem::path& bundle);
  Container(const Container&) = delete;
  Container& operator=(const Container&) = delete;
  ~Container();

  bool started() const { return started_; }
  pid_t pid() const { return pid_; }  // its PID 1, as the host sees it
  const std::string& id() const { return id_; }
  // `runc state` as JSON; null when runc does not know the container.
  nlohmann::json state() const;

 private:
  std::filesystem::path root_;
  std::string id_;
  common::UniqueFd output_;
  bool started_ = false;
  pid_t pid_ = 0;
};

// One request/reply line to the workload's port in the network namespace of process `pid`;
// "" when nothing answers.
std::string ask_in(pid_t pid, const std::string& line,
                   std::chrono::milliseconds timeout = std::chrono::seconds(10));

// The link /proc/PID/ns/NS names (e.g. "net:[4026532]"); "" when the process is gone.
std::string namespace_of(pid_t pid, const char* ns);

// From `gpusnap restore --into-container --json`'s output: the restored workload's root, after
// checking (gtest expectations) that it runs in the placeholder's (PID 1 `placeholder_pid`)
// namespaces, as the placeholder's child; 0 when the output names no copy.
pid_t restored_into(const std::string& restore_json, pid_t placeholder_pid);

// The test workload under the shim, as a source container runs it, and the placeholder. Its 48
// threads (as many as a PyTorch process has) make a restore into the placeholder need thread ids
// that CRIU's helpers would otherwise take (container::EnterSpec::last_pid).
std::vector<std::string> shimmed_workload();
std::vector<std::string> placeholder_args();

}  // namespace gpusnap::testing
