#include "store/materialise.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>

#include "artifact/writer.h"
#include "common/fd.h"
#include "common/fs.h"
#include "common/worker_pool.h"
#include "gpusnap/error.h"
#include "store/blob_store.h"
#include "store/byte_split.h"
#include "tier/folder_format.h"

namespace gpusnap::store {

namespace {

namespace sfs = std::filesystem;
constexpr uint64_t kPage = 4096;

// This thread's CPU time, in nanoseconds.
uint64_t thread_cpu_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<uint64_t>(t.tv_sec) * 1000000000u + static_cast<uint64_t>(t.tv_nsec);
}

// Adds the CPU time this thread spends from here to the end of the scope to `total` (ns).
class CpuSpent {
 public:
  explicit CpuSpent(std::atomic<uint64_t>& total) : total_(total), start_(thread_cpu_ns()) {}
  CpuSpent(const CpuSpent&) = delete;
  CpuSpent& operator=(const CpuSpent&) = delete;
  ~CpuSpent() { total_.fetch_add(thread_cpu_ns() - start_, std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t>& total_;
  uint64_t start_;
};

bool is_zero(const char* p, size_t n) {
  return n == 0 || (p[0] == 0 && std::memcmp(p, p + 1, n - 1) == 0);
}

// Writes data at offset, leaving every all-zero 4 KiB page (of the file's grid) as a hole and
// coalescing the others into as few writes as possible: the materialised file is as sparse as
// the one captured, page for page.
void write_sparse(int fd, const char* data, uint64_t length, uint64_t offset,
                  const std::string& path) {
  auto page_end = [&](uint64_t pos) {
    return std::min(length, ((offset + pos) / kPage + 1) * kPage - offset);
  };
  uint64_t pos = 0;
  while (pos < length) {
    while (pos < length && is_zero(data + pos, page_end(pos) - pos)) pos = page_end(pos);
    uint64_t run_end = pos;
    while (run_end < length && !is_zero(data + run_end, page_end(run_end) - run_end)) {
      run_end = page_end(run_end);
    }
    for (uint64_t done = pos; done < run_end;) {
      ssize_t w = ::pwrite(fd, data + done, run_end - done, static_cast<off_t>(offset + done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throw sys_error("write " + path, errno);
      done += static_cast<uint64_t>(w);
    }
    pos = run_end;
  }
}

// Makes [offset, offset + length) of the file read as zeros again: a hole where the filesystem
// punches one, else zeros written. What a resumed staging directory holds there that the layout
// does not say (a byte flipped in a copy set aside) goes before the layout's bytes are written.
void clear_range(int fd, uint64_t offset, uint64_t length, const std::string& path) {
  if (length == 0) return;
  if (::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                  static_cast<off_t>(length)) == 0) {
    return;
  }
  const std::string zeros(std::min<uint64_t>(length, 1u << 20), '\0');
  for (uint64_t done = 0; done < length;) {
    const ssize_t w = ::pwrite(fd, zeros.data(), std::min<uint64_t>(zeros.size(), length - done),
                               static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw sys_error("write " + path, errno);
    done += static_cast<uint64_t>(w);
  }
}

// How much of each file is written from its first byte, for ArrivalHooks::prefix_written: a
// file's prefix ends at its first extent not yet written (the holes before it read as zeros
// already), or at its size. Extents are written out of order by many threads; one lock for all
// is enough, taken once per extent (megabytes).
class WrittenPrefixes {
 public:
  using Hook = std::function<void(const std::string& path, uint64_t bytes)>;
  WrittenPrefixes(const Layout& layout, const Hook& hook) : layout_(layout), hook_(hook) {
    if (!hook_) return;
    for (const auto& f : layout.files) written_.emplace_back(f.extents.size(), false);
    next_.assign(layout.files.size(), 0);
    prefix_.assign(layout.files.size(), 0);
  }
  // Once the files exist: what each has before any extent is written (a file that starts with a
  // hole, or is all holes).
  void announce() {
    if (!hook_) return;
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < layout_.files.size(); ++i) {
      const FileLayout& f = layout_.files[i];
      const uint64_t bytes = f.extents.empty() ? f.size : f.extents.front().offset;
      if (bytes > prefix_[i]) {
        prefix_[i] = bytes;
        hook_(f.path, bytes);
      }
    }
  }
  void written(size_t file, size_t extent) {
    if (!hook_) return;
    std::lock_guard lock(mu_);
    written_[file][extent] = true;
    const FileLayout& f = layout_.files[file];
    size_t& next = next_[file];
    while (next < f.extents.size() && written_[file][next]) ++next;
    const uint64_t bytes = next < f.extents.size() ? f.extents[next].offset : f.size;
    if (bytes > prefix_[file]) {
      prefix_[file] = bytes;
      hook_(f.path, bytes);
    }
  }

 private:
  const Layout& layout_;
  const Hook& hook_;
  std::mutex mu_;
  std::vector<std::vector<bool>> written_;
  std::vector<size_t> next_;
  std::vector<uint64_t> prefix_;
};

// Whether a failure was a full filesystem or quota (sys_error's text for ENOSPC and EDQUOT):
// what it staged is then removed, not kept to resume from.
bool out_of_space(const Error& e) {
  const std::string_view what = e.what();
  return e.kind() == ErrorKind::kEnvironment &&
         (what.ends_with(errno_text(ENOSPC)) || what.ends_with(errno_text(EDQUOT)));
}

// A buffer that grows to the largest size asked of it, never initialised: decoding overwrites it.
struct DecodeBuffer {
  std::unique_ptr<char[]> data;
  size_t size = 0;
  char* reserve(size_t n) {
    if (n > size) {
      data = std::make_unique_for_overwrite<char[]>(n);
      size = n;
    }
    return data.get();
  }
};

// The extent's bytes from its compressed blob, decoded into buffers of the calling thread's own,
// kept from chunk to chunk (a pull decodes gigabytes; fresh memory for each chunk would be zeroed
// and faulted in again) and freed when the writing thread ends. Valid until the thread's next
// call. Throws Error(kBadArtifact) for a blob that does not decode to the extent's length.
std::string_view decode_extent(const Extent& e, const std::string& blob, const std::string& path) {
  thread_local DecodeBuffer out;
  thread_local DecodeBuffer split;  // a split chunk's halves, before they are joined into `out`
  thread_local std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> dctx{ZSTD_createDCtx(),
                                                                         ZSTD_freeDCtx};
  char* const bytes = out.reserve(e.length);
  char* const into = e.encoding == Encoding::kZstdSplit2 ? split.reserve(e.length) : bytes;
  const size_t n = ZSTD_decompressDCtx(dctx.get(), into, e.length, blob.data(), blob.size());
  if (ZSTD_isError(n) || n != e.length) {
    throw Error(ErrorKind::kBadArtifact,
                "chunk " + e.digest + " of " + path + " does not decompress to its " +
                    std::to_string(e.length) + " bytes",
                "push the artifact again");
  }
  if (e.encoding == Encoding::kZstdSplit2) join_bytes(into, e.length, bytes);
  return {bytes, e.length};
}

// The files of `layout` written into the writer's staging directory, then committed.
MaterialiseResult write_into(artifact::ArtifactWriter& writer, const Manifest& manifest,
                             const Layout& layout, const BlobSource& source,
                             const MaterialiseOptions& options, Reporter& reporter) {
  // Root-only: the artifact holds a process's memory.
  sfs::permissions(writer.staging(), sfs::perms::owner_all, sfs::perm_options::replace);
  Phases phases(reporter);
  struct Job {
    size_t file;
    size_t extent;
  };
  std::vector<common::UniqueFd> fds;
  std::vector<Job> jobs;
  std::vector<Job> host_images;  // after CRIU's images: the driver's restore reads them later
  std::vector<Job> drain;        // the tier's drain files, last: the tier fills from them last
  uint64_t total = 0;
  for (size_t i = 0; i < layout.files.size(); ++i) {
    const auto& f = layout.files[i];
    const auto path = writer.staging() / f.path;
    sfs::create_directories(path.parent_path());
    for (auto dir = path.parent_path(); dir != writer.staging(); dir = dir.parent_path()) {
      sfs::permissions(dir, sfs::perms::owner_all, sfs::perm_options::replace);
    }
    // A resumed staging directory holds the files already, at their size, host images 0400.
    if (writer.resumed()) ::chmod(path.c_str(), 0600);
    common::UniqueFd fd(::open(
        path.c_str(), O_WRONLY | O_CREAT | (writer.resumed() ? 0 : O_EXCL) | O_CLOEXEC, 0600));
    if (!fd) throw sys_error("create " + path.string(), errno);
    if (::ftruncate(fd.get(), static_cast<off_t>(f.size)) != 0) {
      throw sys_error("truncate " + path.string(), errno);
    }
    const bool host_image = f.path.starts_with("host-images/");
    // A host image has the mode CRIU recorded at the capture (read-only, 0400): the open fd
    // still writes it.
    if (host_image && ::fchmod(fd.get(), 0400) != 0) {
      throw sys_error("chmod " + path.string(), errno);
    }
    if (writer.resumed()) {
      // What lies outside the extents reads as zeros, as the layout says.
      uint64_t at = 0;
      for (const Extent& e : f.extents) {
        clear_range(fd.get(), at, e.offset - at, f.path);
        at = e.offset + e.length;
      }
      clear_range(fd.get(), at, f.size - at, f.path);
    }
    fds.push_back(std::move(fd));
    auto& queue = host_image ? host_images : is_tier_drain_file(f.path) ? drain : jobs;
    for (size_t e = 0; e < f.extents.size(); ++e) {
      queue.push_back({i, e});
      total += f.extents[e].length;
    }
  }
  // The drain files by offset across the files, not one file after another: the tier's fill
  // reads every file at once (a worker each), so each worker gets its file's bytes as soon as
  // any arrive, and all of them keep pace with the pull instead of one at a time.
  std::stable_sort(drain.begin(), drain.end(), [&](const Job& a, const Job& b) {
    return layout.files[a.file].extents[a.extent].offset <
           layout.files[b.file].extents[b.extent].offset;
  });
  jobs.insert(jobs.end(), host_images.begin(), host_images.end());
  jobs.insert(jobs.end(), drain.begin(), drain.end());
  const ArrivalHooks& hooks = options.arrival;
  // Extents left to write, per file: the last one written tells file_written.
  std::vector<std::atomic<size_t>> left(layout.files.size());
  for (size_t i = 0; i < layout.files.size(); ++i) left[i] = layout.files[i].extents.size();
  WrittenPrefixes prefixes(layout, hooks.prefix_written);
  if (hooks.created) {
    fs::write_file(writer.staging() / kManifestName, manifest.to_json().dump(2) + "\n");
    hooks.created(writer.staging());
    if (hooks.file_written) {
      for (const auto& f : layout.files) {
        if (f.extents.empty()) hooks.file_written(f.path);  // all zeros: written already
      }
    }
    prefixes.announce();
  }

  std::atomic<uint64_t> done{0};
  std::atomic<uint64_t> kept{0}, bytes_kept{0};
  std::atomic<uint64_t> fetch_ns{0}, decode_ns{0}, write_ns{0};
  // An uncompressed extent that a resumed staging directory holds intact, verbatim at its place.
  const auto intact = [&](const FileLayout& f, const Extent& e) {
    return writer.resumed() && e.encoding == Encoding::kRaw &&
           read_located({writer.staging() / f.path, e.offset, e.length}, e.digest).has_value();
  };
  phases.run("write", [&] {
    common::for_each_index(
        jobs.size(), options.threads,
        [&](size_t j) {
          const auto& f = layout.files[jobs[j].file];
          const Extent& e = f.extents[jobs[j].extent];
          if (hooks.before_chunk) hooks.before_chunk();
          if (intact(f, e)) {
            ++kept;
            bytes_kept += e.length;
            done += e.length;
            prefixes.written(jobs[j].file, jobs[j].extent);
            if (left[jobs[j].file].fetch_sub(1) == 1 && hooks.file_written) {
              hooks.file_written(f.path);
            }
            return;
          }
          std::string blob;
          {
            const CpuSpent spent(fetch_ns);
            blob = source({e.digest, e.stored, e.encoding});
          }
          if (blob.size() != e.stored) {
            throw Error(ErrorKind::kBadArtifact,
                        "chunk " + e.digest + " of " + f.path + " has " +
                            std::to_string(blob.size()) + " bytes, its layout says " +
                            std::to_string(e.stored),
                        "push the artifact again");
          }
          std::string_view bytes = blob;
          if (e.encoding != Encoding::kRaw) {
            const CpuSpent spent(decode_ns);
            bytes = decode_extent(e, blob, f.path);
          }
          {
            const CpuSpent spent(write_ns);
            // In a resumed staging directory the extent's pages that stay holes are made so.
            if (writer.resumed()) clear_range(fds[jobs[j].file].get(), e.offset, e.length, f.path);
            write_sparse(fds[jobs[j].file].get(), bytes.data(), e.length, e.offset, f.path);
          }
          done += e.length;
          prefixes.written(jobs[j].file, jobs[j].extent);
          if (left[jobs[j].file].fetch_sub(1) == 1 && hooks.file_written) {
            hooks.file_written(f.path);
          }
        },
        [&] { reporter.progress(options.progress_name, done.load(), total); });
  });
  for (auto& fd : fds) fd.reset();
  if (hooks.before_commit) hooks.before_commit();
  // The staging tree's directories are the writer's; the files are root-only as written.
  writer.commit(manifest, phases);
  if (hooks.committed) hooks.committed();
  const auto seconds = [](const std::atomic<uint64_t>& ns) {
    return static_cast<double>(ns) / 1e9;
  };
  return {
      kept.load(), bytes_kept.load(), {seconds(fetch_ns), seconds(decode_ns), seconds(write_ns)}};
}

}  // namespace

bool holds_gpu_memory(const std::string& path) {
  return path.starts_with("host-images/") || is_tier_drain_file(path);
}

bool is_tier_drain_file(const std::string& path) {
  return tier::folder::classify_in_artifact(path).kind == tier::folder::EntryKind::kDrainFile;
}

MaterialiseResult materialise(const Layout& layout, const sfs::path& dest, const BlobSource& source,
                              const MaterialiseOptions& options, Reporter& reporter) {
  const Manifest manifest = Manifest::from_json(layout.manifest);
  artifact::WriterOptions wo;
  wo.run_dir = options.run_dir;
  artifact::ArtifactWriter writer =
      options.resume != nullptr && !options.resume->dir.empty()
          ? artifact::ArtifactWriter(dest, wo, std::move(*options.resume))
          : artifact::ArtifactWriter(dest, wo);
  try {
    return write_into(writer, manifest, layout, source, options, reporter);
  } catch (const Error& e) {
    if (options.keep_partial && !out_of_space(e)) writer.keep_staging();
    throw;
  } catch (...) {
    if (options.keep_partial) writer.keep_staging();
    throw;
  }
}

}  // namespace gpusnap::store
