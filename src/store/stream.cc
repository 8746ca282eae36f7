#include "store/stream.h"

#include "gpusnap/error.h"
#include "store/materialise.h"

namespace gpusnap::store {

namespace {

// The files CRIU reads by path during criu-restore, and the tier's index and layout files that
// its fill done ahead starts from; the others (GPU memory) are mapped from descriptors, filled
// by the tier, or read by the driver's restore.
bool is_criu_image(const std::string& path) { return !holds_gpu_memory(path); }

}  // namespace

StreamingPull::StreamingPull(OciRef ref, PullOptions options, Reporter& reporter,
                             common::UniqueFd held)
    : output_(options.output) {
  PullOptions o = std::move(options);
  o.arrival.created = [this](const std::filesystem::path& staging) {
    std::lock_guard lock(mu_);
    staging_ = staging;
    created_ = true;
    cv_.notify_all();
  };
  o.arrival.file_written = [this](const std::string& path) {
    std::lock_guard lock(mu_);
    if (is_criu_image(path) && criu_files_left_ > 0) --criu_files_left_;
    if (!is_tier_drain_file(path) && host_files_left_ > 0) --host_files_left_;
    cv_.notify_all();
  };
  o.arrival.prefix_written = [this](const std::string& path, uint64_t bytes) {
    std::lock_guard lock(mu_);
    written_[path] = bytes;
    for (const auto& w : watchers_) w(path, bytes);
  };
  o.arrival.before_chunk = [this] {
    std::lock_guard lock(mu_);
    if (cancelled_) throw Error(ErrorKind::kInternal, "the pull was stopped: its restore failed");
  };
  o.arrival.before_commit = [this] {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return commit_allowed_ || cancelled_; });
    if (cancelled_) throw Error(ErrorKind::kInternal, "the pull was stopped: its restore failed");
  };
  o.arrival.committed = [this] {
    std::lock_guard lock(mu_);
    committed_ = true;
    cv_.notify_all();
  };
  // The manifest, read first, says how many of CRIU's files are to come.
  o.check = [this, check = o.check](const Manifest& m) {
    if (check) check(m);
    std::lock_guard lock(mu_);
    criu_files_left_ = 0;
    host_files_left_ = 0;
    for (const auto& f : m.files) {
      criu_files_left_ += is_criu_image(f.path) ? 1 : 0;
      host_files_left_ += is_tier_drain_file(f.path) ? 0 : 1;
    }
  };
  thread_ = std::thread(
      [this, ref = std::move(ref), o = std::move(o), &reporter, held = std::move(held)]() mutable {
        try {
          PullResult r = pull(ref, o, reporter);
          std::lock_guard lock(mu_);
          result_ = std::move(r);
        } catch (...) {
          std::lock_guard lock(mu_);
          failure_ = std::current_exception();
        }
        // The copy is committed (or nothing is): the next pull or restore of it may go on.
        held.reset();
        std::lock_guard lock(mu_);
        finished_ = true;
        cv_.notify_all();
      });
}

StreamingPull::~StreamingPull() {
  {
    std::lock_guard lock(mu_);
    cancelled_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

template <typename Ready>
void StreamingPull::wait_for(std::unique_lock<std::mutex>& lock, Ready ready) {
  cv_.wait(lock, [&] { return ready() || failure_ || finished_; });
  if (failure_) std::rethrow_exception(failure_);
}

std::filesystem::path StreamingPull::staging() {
  std::unique_lock lock(mu_);
  wait_for(lock, [&] { return created_; });
  if (!created_) throw Error(ErrorKind::kInternal, "the pull ended before writing any file");
  return staging_;
}

void StreamingPull::await_criu_images() {
  std::unique_lock lock(mu_);
  wait_for(lock, [&] { return created_ && criu_files_left_ == 0; });
}

void StreamingPull::await_host_images() {
  std::unique_lock lock(mu_);
  wait_for(lock, [&] { return created_ && host_files_left_ == 0; });
}

void StreamingPull::watch(Progress progress) {
  std::lock_guard lock(mu_);
  for (const auto& [path, bytes] : written_) progress(path, bytes);
  watchers_.push_back(std::move(progress));
}

std::filesystem::path StreamingPull::complete() {
  std::unique_lock lock(mu_);
  commit_allowed_ = true;
  cv_.notify_all();
  // The artifact is whole at its path once committed: the node cache's record of it (0.05 s of
  // a 16 GiB pull on the H100) goes on beside the copies' resume, and a failure of that record
  // is the pull's, not the restore's (result() reports it).
  cv_.wait(lock, [&] { return committed_ || failure_ || finished_; });
  if (committed_) return output_;
  if (failure_) std::rethrow_exception(failure_);
  throw Error(ErrorKind::kInternal, "the pull ended without committing");
}

const PullResult& StreamingPull::result() {
  std::unique_lock lock(mu_);
  wait_for(lock, [&] { return finished_; });
  if (!result_) throw Error(ErrorKind::kInternal, "the pull ended without a result");
  return *result_;
}

const PullResult* StreamingPull::ended() {
  std::unique_lock lock(mu_);
  // Once committed only the node cache's record is left: waited for, it is short. Before the
  // commit the pull may still be fetching: not waited for.
  if (committed_) cv_.wait(lock, [&] { return finished_; });
  return result_ ? &*result_ : nullptr;
}

}  // namespace gpusnap::store
