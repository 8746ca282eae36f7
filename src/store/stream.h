// A pull that a restore uses while it still runs: the snapshot's CRIU images arrive first
// (materialise writes them before the GPU memory's files), CRIU's restore starts on them, and the
// host images and the tier's drain files (the GPU memory, the bulk of a GPU snapshot) keep
// arriving meanwhile; the restore awaits the host images only before it hands GPU memory to the
// driver, and the drain files, which the tier's fill done ahead takes as they arrive, only
// before the copies resume (gpusnap/restore.h, ArrivingArtifact). Every chunk is still checked
// against its digest as it arrives; a bad one fails the pull, the restore's next wait rethrows it,
// and the restore unwinds (no copy left, nothing at the output: the staging directory goes with the
// pull).
#pragma once

#include <condition_variable>
#include <exception>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "gpusnap/phases.h"
#include "gpusnap/restore.h"
#include "store/transfer.h"

namespace gpusnap::store {

class StreamingPull final : public ArrivingArtifact {
 public:
  // Starts store::pull(ref, options) on a thread of its own (`reporter` is that thread's, for
  // the fetch's progress). options.output is the artifact's final path. `held` (the node copy's
  // lock, store/transfer.h lock_node_copy) is closed as soon as the pull ended, committed or not.
  StreamingPull(OciRef ref, PullOptions options, Reporter& reporter, common::UniqueFd held = {});
  StreamingPull(const StreamingPull&) = delete;
  StreamingPull& operator=(const StreamingPull&) = delete;
  // Stops the pull (a chunk in flight finishes, no other starts) and waits for it: a restore
  // that failed leaves nothing of the pull behind but the chunks in the node cache.
  ~StreamingPull() override;

  std::filesystem::path staging() override;
  void await_criu_images() override;
  void await_host_images() override;
  void watch(Progress progress) override;

  // Returns once the artifact is committed at its final path; the pull's last step, the node
  // cache's record, may still run (result() and ended() wait for it).
  std::filesystem::path complete() override;

  // The pull's result, waiting for its end; throws its error if it failed.
  const PullResult& result();
  // The pull's result once it ended well (waiting for its last step once committed); null
  // while it still fetches, or after it failed.
  const PullResult* ended();

 private:
  // Waits until `ready()` or the pull failed (then rethrows its error) or ended.
  template <typename Ready>
  void wait_for(std::unique_lock<std::mutex>& lock, Ready ready);

  const std::filesystem::path output_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::filesystem::path staging_;
  size_t criu_files_left_ = 0;               // known once the files are created
  size_t host_files_left_ = 0;               // every file but the tier's drain files: the same
  std::map<std::string, uint64_t> written_;  // each file's prefix written so far
  std::vector<Progress> watchers_;
  bool created_ = false;
  bool commit_allowed_ = false;
  bool committed_ = false;
  bool cancelled_ = false;
  bool finished_ = false;
  std::exception_ptr failure_;
  std::optional<PullResult> result_;
  std::thread thread_;  // last: starts once everything above is built
};

}  // namespace gpusnap::store
