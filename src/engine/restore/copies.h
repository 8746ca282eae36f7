// The copies a restore makes (engine/restore.cc): each a `gpusnap __copy-init` in fresh
// namespaces (or in a placeholder container's) that runs CRIU's restore, reports, and waits to
// be released. Phases: criu-restore (all copies at once), locate, resume (the handshake, every
// copy at once), release.
//
// Until release(), every copy's init dies with this object (and with gpusnap), so a failure or a
// kill at any point leaves no process and no namespace behind. A copy restored into a placeholder
// outlives its init: destroying it unreleased closes its control socket, on which the init kills
// the restored tree, and waits for that.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "criu/criu.h"
#include "gpusnap/artifact.h"
#include "gpusnap/restore.h"

namespace gpusnap::engine {

class Copy;

class Copies {
 public:
  Copies();
  ~Copies();
  Copies(const Copies&) = delete;
  Copies& operator=(const Copies&) = delete;

  // Phase criu-restore: starts options.replicas copies from CRIU's `images`, all at once, and
  // waits until each has reported (Error kTimeout after options.timeout, kCriu naming a copy's
  // log when one failed). `into`: the placeholder's PID 1 for a copy restored into one, else 0.
  void restore(const Manifest& manifest, const std::filesystem::path& images,
               const criu::Binary& criu, const RestoreOptions& options, pid_t into);
  // Phase locate: each copy's restored root by its host pid.
  void locate();
  size_t size() const { return copies_.size(); }
  // The host pids of these processes (pids inside a copy's namespace) in every copy, copy by
  // copy. Throws Error(kCriu) naming a process that is missing.
  std::vector<pid_t> host_pids(const std::vector<pid_t>& ns_pids) const;
  // Phase resume: every copy asked to resume with its own context (contexts[i]), all at once;
  // each must say RESUMED within `timeout`. Throws the first copy's failure, naming the copy.
  void resume(const Manifest& manifest, const std::vector<nlohmann::json>& contexts,
              std::chrono::milliseconds timeout);
  // Phase release: the copies are handed over and outlive gpusnap.
  std::vector<CopyInfo> release();

 private:
  std::vector<std::unique_ptr<Copy>> copies_;
};

}  // namespace gpusnap::engine
