#include "container/runc.h"

#include <unistd.h>

#include <cstdlib>

#include <nlohmann/json.hpp>

#include "common/subprocess.h"
#include "container/runtime_root.h"
#include "gpusnap/error.h"

namespace gpusnap::container {

namespace {

using nlohmann::json;

std::string find_runc() {
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/sbin:/usr/bin:/sbin:/bin";
  for (size_t start = 0; start <= dirs.size();) {
    size_t end = std::min(dirs.find(':', start), dirs.size());
    std::string candidate = dirs.substr(start, end - start) + "/runc";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  throw Error(ErrorKind::kEnvironment, "runc was not found on PATH",
              "install runc (Debian: apt-get install runc), the runtime of the container");
}

std::string describe_ref(const ContainerRef& ref) {
  return "container " + ref.id + " (runc root " + ref.runtime_root.string() + ")";
}
std::string describe_ref(const State& state) {
  return describe_ref(ContainerRef{state.id, state.runtime_root});
}

}  // namespace

State read_state(const ContainerRef& given) {
  if (given.id.empty()) throw Error(ErrorKind::kUsage, "no container id given");
  ContainerRef ref = given;
  if (ref.runtime_root.empty()) ref.runtime_root = find_runtime_root(ref.id);
  auto runc = find_runc();
  auto r = common::run_capture({runc, "--root", ref.runtime_root.string(), "state", ref.id},
                               std::chrono::seconds(30));
  if (!r.status.ok()) {
    if (r.output.find("does not exist") != std::string::npos ||
        r.output.find("no such file") != std::string::npos) {
      throw Error(ErrorKind::kNotFound, describe_ref(ref) + " does not exist",
                  "check the id with `runc --root " + ref.runtime_root.string() +
                      " list`, or pass the runtime's state directory with --runtime-root");
    }
    auto line = r.output.substr(0, r.output.find('\n'));
    throw Error(ErrorKind::kEnvironment, "runc state " + ref.id + " failed: " + line,
                "check that runc works and that --runtime-root is runc's state directory");
  }
  try {
    auto doc = json::parse(r.output);
    State s;
    s.id = doc.at("id").get<std::string>();
    s.status = doc.at("status").get<std::string>();
    s.pid = doc.at("pid").get<pid_t>();
    s.bundle = doc.at("bundle").get<std::string>();
    s.rootfs = doc.at("rootfs").get<std::string>();
    s.runtime_root = ref.runtime_root;
    return s;
  } catch (const json::exception& e) {
    throw Error(ErrorKind::kEnvironment, "cannot read runc's state of " + ref.id + ": " + e.what(),
                "use runc 1.x, whose `state` prints JSON");
  }
}

namespace {

// The container's state, refused as unusable or when, running, its PID 1 is not `role` (named
// `what` in the error, of `kind`, with `hint`).
State state_run_by(const ContainerRef& ref, Role role, ErrorKind kind, const std::string& what,
                   const std::string& hint) {
  State state = read_state(ref);
  if (state.status == "running" && role_of(state.pid) != role) {
    throw Error(
        kind,
        describe_ref(state) + ": its PID 1 (pid " + std::to_string(state.pid) + ") is not " + what,
        hint);
  }
  refuse_unusable(state.pid, state.status, describe_ref(state));
  return state;
}

}  // namespace

CaptureTarget capture_target(const ContainerRef& ref) {
  CaptureTarget t;
  t.state = state_run_by(ref, Role::kShim, ErrorKind::kNotCapturable, "the gpusnap shim",
                         "start the container's process as `gpusnap init -- CMD ARGS...`");
  auto children = proc::children(t.state.pid);
  if (children.size() != 1) {
    throw Error(ErrorKind::kNotCapturable,
                describe_ref(t.state) + ": the shim has " + std::to_string(children.size()) +
                    " children; the capture takes exactly one tree, the command it started",
                children.empty() ? "wait until the container's command runs"
                                 : "keep the workload in one process tree (no daemonized "
                                   "processes left to PID 1)");
  }
  t.root = children.front();
  return t;
}

ContainerRecord describe(const CaptureTarget& target, const std::vector<proc::Process>& tree) {
  return {"runc",
          target.state.id,
          target.state.bundle.string(),
          target.state.rootfs.string(),
          identify_mapped_files(target.root, tree),
          target.state.runtime_root.string()};
}

Placeholder placeholder_target(const ContainerRef& ref, const Manifest& manifest) {
  if (!manifest.container) {
    throw Error(ErrorKind::kUsage, "artifact " + manifest.id + " was not captured from a container",
                "restore it without --into-container, or capture the workload with "
                "`gpusnap checkpoint --container ID`");
  }
  Placeholder p;
  p.state = state_run_by(ref, Role::kPlaceholder, ErrorKind::kUsage, "a gpusnap placeholder",
                         "start the target container with `gpusnap init --placeholder` as its "
                         "process");
  if (!proc::children(p.state.pid).empty()) {
    throw Error(ErrorKind::kUsage,
                describe_ref(p.state) + ": the placeholder is not waiting, it already runs a "
                                        "restored workload",
                "start a new placeholder container for this restore");
  }
  refuse_other_rootfs(p.state.pid, manifest.container->rootfs_files, describe_ref(p.state),
                      manifest.container->id);
  return p;
}

}  // namespace gpusnap::container
