// Parallel chunked checksums. XXH3-128 was chosen by measurement (docs/benchmarks.md): it runs
// at memory speed on one core, so with one thread per core the checksum of a multi-GiB image
// costs a fraction of writing it. Files are cut into fixed chunks so that one large pages image
// spreads over every core, and so that verify can name the damaged byte range.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>

#include "common/fd.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"

namespace gpusnap {

namespace {

std::string hex128(const XXH128_hash_t& h) {
  char buf[33];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return buf;
}

struct ChunkTask {
  size_t file;
  size_t chunk;
};

}  // namespace

std::vector<FileRecord> checksum_tree(const std::filesystem::path& root, uint64_t chunk_bytes,
                                      const VerifyOptions& options) {
  std::vector<FileRecord> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    if (!entry.is_regular_file()) continue;
    FileRecord rec;
    rec.path = std::filesystem::relative(entry.path(), root).string();
    rec.size = entry.file_size();
    rec.chunks.resize(std::max<uint64_t>(1, (rec.size + chunk_bytes - 1) / chunk_bytes));
    files.push_back(std::move(rec));
  }
  std::sort(files.begin(), files.end(),
            [](const FileRecord& a, const FileRecord& b) { return a.path < b.path; });

  std::vector<ChunkTask> tasks;
  uint64_t total = 0;
  for (size_t f = 0; f < files.size(); ++f) {
    for (size_t c = 0; c < files[f].chunks.size(); ++c) tasks.push_back({f, c});
    total += files[f].size;
  }
  // Largest files first would not help: chunks are equal, so plain order balances well.
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done{0};
  std::mutex error_mutex;
  std::optional<Error> first_error;
  std::mutex report_mutex;

  auto worker = [&] {
    constexpr size_t kBuffer = 4 << 20;
    std::unique_ptr<char[]> buf(new char[kBuffer]);
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                   XXH3_freeState);
    for (size_t i; (i = next.fetch_add(1)) < tasks.size();) {
      auto& rec = files[tasks[i].file];
      uint64_t begin = tasks[i].chunk * chunk_bytes;
      uint64_t end = std::min(rec.size, begin + chunk_bytes);
      try {
        UniqueFd fd(::open((root / rec.path).c_str(), O_RDONLY | O_CLOEXEC));
        if (!fd) throw sys_error("open " + rec.path, errno);
        XXH3_128bits_reset(state.get());
        for (uint64_t off = begin; off < end;) {
          ssize_t n = ::pread(fd.get(), buf.get(), std::min<uint64_t>(kBuffer, end - off),
                              static_cast<off_t>(off));
          if (n < 0 && errno == EINTR) continue;
          if (n < 0) throw sys_error("read " + rec.path, errno);
          if (n == 0) break;  // truncated under us: the checksum will not match
          XXH3_128bits_update(state.get(), buf.get(), static_cast<size_t>(n));
          off += static_cast<uint64_t>(n);
          uint64_t now = done.fetch_add(static_cast<uint64_t>(n)) + static_cast<uint64_t>(n);
          if (options.reporter != nullptr) {
            std::lock_guard lock(report_mutex);
            options.reporter->progress("checksum", now, total);
          }
        }
        rec.chunks[tasks[i].chunk] = hex128(XXH3_128bits_digest(state.get()));
      } catch (const Error& e) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = e;
      }
    }
  };
  unsigned threads = options.threads > 0 ? static_cast<unsigned>(options.threads)
                                         : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min<unsigned>(threads, std::max<size_t>(1, tasks.size()));
  std::vector<std::jthread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  pool.clear();
  if (first_error) throw *first_error;
  return files;
}

}  // namespace gpusnap
