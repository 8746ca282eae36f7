// Parallel chunked checksums. XXH3-128 was chosen by measurement (docs/benchmarks.md): it runs
// at memory speed on one core, so with one thread per core the checksum of a multi-GiB image
// costs a fraction of writing it. Files are cut into fixed chunks so that one large pages image
// spreads over every core, and so that verify can name the damaged byte range.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "artifact/chunk_hash.h"
#include "common/fd.h"
#include "common/worker_pool.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"

namespace gpusnap {

namespace {

struct ChunkTask {
  size_t file;
  size_t chunk;
};

}  // namespace

std::vector<FileRecord> checksum_tree(const std::filesystem::path& root, uint64_t chunk_bytes,
                                      const VerifyOptions& options,
                                      const std::vector<FileRecord>& known) {
  std::vector<FileRecord> files;
  // The walk reports a missing or unreadable tree as filesystem_error; callers expect an Error
  // that names the tree, like every other failure here.
  try {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
      if (!entry.is_regular_file()) continue;
      FileRecord rec;
      rec.path = std::filesystem::relative(entry.path(), root).string();
      rec.size = entry.file_size();
      rec.chunks.resize(std::max<uint64_t>(1, (rec.size + chunk_bytes - 1) / chunk_bytes));
      files.push_back(std::move(rec));
    }
  } catch (const std::filesystem::filesystem_error& e) {
    std::string where;
    if (!e.path1().empty() && e.path1() != root) where = " (at " + e.path1().string() + ")";
    throw Error(ErrorKind::kBadArtifact,
                "cannot list the files of " + root.string() + where + ": " + e.code().message(),
                "check that the directory exists and is readable");
  }
  std::sort(files.begin(), files.end(),
            [](const FileRecord& a, const FileRecord& b) { return a.path < b.path; });

  std::vector<ChunkTask> tasks;
  uint64_t total = 0;
  // By path: a verification scoped to a few files passes every other file's record here.
  std::map<std::string, const FileRecord*> known_by_path;
  for (const auto& k : known) known_by_path.emplace(k.path, &k);
  for (size_t f = 0; f < files.size(); ++f) {
    // A file whose checksums its writer already computed, at the size it has now, is not read.
    const auto same = known_by_path.find(files[f].path);
    if (same != known_by_path.end() && same->second->size == files[f].size &&
        same->second->chunks.size() == files[f].chunks.size()) {
      files[f].chunks = same->second->chunks;
      continue;
    }
    for (size_t c = 0; c < files[f].chunks.size(); ++c) tasks.push_back({f, c});
    total += files[f].size;
  }
  // Largest files first would not help: chunks are equal, so plain order balances well.
  std::atomic<size_t> next{0};
  uint64_t done = 0;  // guarded by report_mutex
  std::mutex report_mutex;

  // Each worker takes the next chunk until none is left, one failed or the caller stopped them.
  const auto worker = [&](std::size_t, const std::atomic<bool>& failed) {
    constexpr size_t kBuffer = 4 << 20;
    std::unique_ptr<char[]> buf(new char[kBuffer]);
    artifact::ChunkHash hash;
    for (size_t i;
         !failed && !options.stop.stop_requested() && (i = next.fetch_add(1)) < tasks.size();) {
      auto& rec = files[tasks[i].file];
      uint64_t begin = tasks[i].chunk * chunk_bytes;
      uint64_t end = std::min(rec.size, begin + chunk_bytes);
      common::UniqueFd fd(::open((root / rec.path).c_str(), O_RDONLY | O_CLOEXEC));
      if (!fd) throw sys_error("open " + rec.path, errno);
      hash.reset();
      for (uint64_t off = begin; off < end;) {
        ssize_t n = ::pread(fd.get(), buf.get(), std::min<uint64_t>(kBuffer, end - off),
                            static_cast<off_t>(off));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw sys_error("read " + rec.path, errno);
        if (n == 0) break;  // truncated under us: the checksum will not match
        hash.update(buf.get(), static_cast<size_t>(n));
        off += static_cast<uint64_t>(n);
        if (options.reporter != nullptr) {
          // Counted under the lock that orders the reports: a sum taken before it could be
          // reported after a larger one, and progress would go backwards.
          std::lock_guard lock(report_mutex);
          done += static_cast<uint64_t>(n);
          options.reporter->progress("checksum", done, total);
        }
      }
      rec.chunks[tasks[i].chunk] = hash.hex();
    }
  };
  unsigned threads = options.threads > 0 ? static_cast<unsigned>(options.threads)
                                         : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min<unsigned>(threads, std::max<size_t>(1, tasks.size()));
  common::run_workers(threads, worker);
  if (options.stop.stop_requested()) {
    throw Error(ErrorKind::kInternal, "the checksums of " + root.string() + " were stopped");
  }
  // Always end at total, even when there were no bytes to read (only empty files) or a file
  // shrank while it was read (verify reports that as a mismatch).
  if (options.reporter != nullptr) options.reporter->progress("checksum", total, total);
  return files;
}

}  // namespace gpusnap
