#include "engine/host_images.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>

#include "artifact/chunk_hash.h"
#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "engine/preload.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

constexpr uint64_t kCopyBuffer = 8ull << 20;  // read from the process at once
constexpr uint64_t kHoleBlock = 64ull << 10;  // zero blocks of this size become holes
// A PMD-sized (x86-64) page. A private file mapping can map the file's 2 MiB pages (a tmpfs
// mounted with huge=) with one entry each only where its address and its file offset agree
// modulo this size; the driver's region need not start on such a boundary, so its file
// starts with a hole that makes them agree.
constexpr uint64_t kHugePage = 2ull << 20;

bool private_anonymous_rw(const common::Mapping& m) {
  return m.path.empty() && m.perms.size() == 4 && m.perms[0] == 'r' && m.perms[1] == 'w' &&
         m.perms[3] == 'p';
}

std::string ns_of(const std::string& pid, const char* ns) {
  std::error_code ec;
  auto target = std::filesystem::read_symlink("/proc/" + pid + "/ns/" + ns, ec);
  return ec ? std::string() : target.string();
}

// The VmFlags line of the smaps entry starting at `start`.
std::vector<std::string> vm_flags(pid_t pid, uint64_t start) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps");
  std::string line;
  bool in_entry = false;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    // An entry's header starts with its hex range; its fields start with a capitalised name.
    if (std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos &&
        line.find(':') > line.find(' ')) {
      in_entry = std::stoull(line.substr(0, line.find('-')), nullptr, 16) == start;
      continue;
    }
    if (in_entry && line.rfind("VmFlags:", 0) == 0) {
      std::istringstream fields(line.substr(8));
      std::vector<std::string> flags;
      for (std::string f; fields >> f;) flags.push_back(f);
      return flags;
    }
  }
  return {};
}

int prot_of(const std::string& perms) {
  int prot = PROT_NONE;
  if (perms[0] == 'r') prot |= PROT_READ;
  if (perms[1] == 'w') prot |= PROT_WRITE;
  if (perms[2] == 'x') prot |= PROT_EXEC;
  return prot;
}

// CRIU's name for a file it is told is external: "file[MNT_ID:INODE]", both in hex, the mount
// id as /proc/*/fdinfo shows it (the one CRIU reads).
std::string criu_file_key(int fd) {
  std::ifstream in("/proc/self/fdinfo/" + std::to_string(fd));
  std::string line;
  unsigned long mnt_id = 0;
  bool found = false;
  while (std::getline(in, line)) {
    if (line.rfind("mnt_id:", 0) == 0) {
      mnt_id = std::stoul(line.substr(7));
      found = true;
    }
  }
  struct stat st {};
  if (!found || ::fstat(fd, &st) != 0) {
    throw Error(ErrorKind::kInternal, "cannot read the mount id and inode of a host image");
  }
  std::ostringstream key;
  key << "file[" << std::hex << mnt_id << ":" << static_cast<uint64_t>(st.st_ino) << "]";
  return key.str();
}

// The CRIU key of the file mapped at `range.start` in `pid`, as that process reaches it:
// /proc/PID/map_files opens the mapping's own file, mount included.
std::string mapped_file_key(pid_t pid, const Range& range) {
  for (const auto& m : common::read_mappings(pid)) {
    if (m.start != range.start) continue;
    std::ostringstream link;
    link << "/proc/" << pid << "/map_files/" << std::hex << m.start << "-" << m.end;
    common::UniqueFd fd(::open(link.str().c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) throw sys_error("open " + link.str(), errno);
    return criu_file_key(fd.get());
  }
  throw Error(ErrorKind::kInternal,
              "no mapping at the start of a host image of process " + std::to_string(pid));
}

// The key CRIU records for a host image file mapped at `range.start` in `pid`, opened here as
// `fd`. CRIU names a file by the mount the process reached it through: a folder mounted into a
// container (`through_mount`) is another mount than gpusnap's, so the key is read from the
// mapping itself there.
std::string image_criu_key(pid_t pid, const Range& range, int fd, bool through_mount) {
  return through_mount ? mapped_file_key(pid, range) : criu_file_key(fd);
}

struct ImageFile {
  Range range;
  uint64_t pad = 0;  // the hole before the range's first byte in the file
  std::filesystem::path path;
  std::filesystem::path seen;  // the path as the process opens it ("": `path`)
  const std::filesystem::path& as_seen() const { return seen.empty() ? path : seen; }
  common::UniqueFd fd;
  unsigned char* map = nullptr;  // the file, mapped shared for writing
  std::atomic<uint64_t> stored{0};
  std::vector<std::string> chunks;  // checksum of each chunk, written by the copying threads
  ImageFile() = default;
  ImageFile(const ImageFile&) = delete;
  ImageFile& operator=(const ImageFile&) = delete;
  ~ImageFile() { unmap(); }
  uint64_t file_size() const { return pad + range.size(); }
  void unmap() {
    if (map != nullptr) ::munmap(map, file_size());
    map = nullptr;
  }
};

// Copies every range of `pid` into its file with `threads` threads, 64 MiB at a time, blocks
// of zeros left as holes. The files are written through shared mappings, not write(): a
// tmpfs or ext4 write() holds the file's inode lock, which would serialise the threads on the
// one file of a region; page faults on a mapping do not. Throws on the first failure.
void copy_out(pid_t pid, std::vector<ImageFile>& files, int threads, uint64_t chunk_bytes) {
  struct Job {
    ImageFile* file;
    size_t chunk;
    uint64_t offset;  // in the file
    uint64_t size;
  };
  // Chunk by chunk across the files, so that threads working at once write different files.
  std::vector<Job> jobs;
  for (size_t c = 0;; ++c) {
    size_t before = jobs.size();
    for (auto& f : files) {
      uint64_t off = c * chunk_bytes;
      if (off < f.file_size())
        jobs.push_back({&f, c, off, std::min(chunk_bytes, f.file_size() - off)});
    }
    if (jobs.size() == before) break;
  }
  for (auto& f : files) f.chunks.resize((f.file_size() + chunk_bytes - 1) / chunk_bytes);
  std::atomic<size_t> next{0};
  const auto worker = [&](size_t, const std::atomic<bool>& failed) {
    // Small enough to stay in the core's cache between the read and the copy into the file.
    std::vector<unsigned char> buf(kCopyBuffer);
    artifact::ChunkHash hash;
    for (size_t j; !failed && (j = next.fetch_add(1)) < jobs.size();) {
      const Job& job = jobs[j];
      hash.reset();
      uint64_t done = 0;
      if (job.offset < job.file->pad) {  // the leading hole: zeros to the checksum, no copy
        done = std::min(job.file->pad - job.offset, job.size);
        std::memset(buf.data(), 0, done);
        hash.update(buf.data(), done);
      }
      while (done < job.size) {
        uint64_t len = std::min(kCopyBuffer, job.size - done);
        uint64_t at = job.file->range.start + (job.offset + done - job.file->pad);
        iovec local{buf.data(), len};
        // An address in the other process: an integer by nature, never dereferenced here.
        iovec remote{reinterpret_cast<void*>(at), len};  // NOLINT(performance-no-int-to-ptr)
        ssize_t got = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
        if (got != static_cast<ssize_t>(len)) {
          std::ostringstream where;
          where << std::hex << at;
          throw Error(ErrorKind::kEnvironment, "cannot read process " + std::to_string(pid) +
                                                   " memory at 0x" + where.str() + ": " +
                                                   (got < 0 ? errno_text(errno) : "short read"));
        }
        hash.update(buf.data(), len);
        unsigned char* dest = job.file->map + job.offset + done;
        for (uint64_t b = 0; b < len; b += kHoleBlock) {
          uint64_t block = std::min(kHoleBlock, len - b);
          if (all_zero(buf.data() + b, block)) continue;
          std::memcpy(dest + b, buf.data() + b, block);
          job.file->stored += block;
        }
        done += len;
      }
      job.file->chunks[job.chunk] = hash.hex();
    }
  };
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(jobs.size())));
  common::run_workers(static_cast<size_t>(n), worker);
}

// Replaces each range of `pid` by a private mapping of its file, with the range's protection
// and madvise flags. Ranges whose flags gpusnap cannot carry over are left alone.
void remap(pid_t pid, std::vector<ImageFile>& files, const std::vector<common::Mapping>& maps,
           Reporter& reporter) {
  // Each range's madvise flags, read before the thread is stopped: /proc/PID/smaps walks the
  // page tables, slow for tens of GiB, and the time the thread is held is the time a gpusnap
  // killed would leave it broken (docs/gpu-memory.md, "Host images").
  std::vector<std::vector<std::string>> range_flags;
  for (const auto& f : files) {
    auto mapping = std::find_if(maps.begin(), maps.end(), [&](const common::Mapping& m) {
      return m.start <= f.range.start && f.range.start < m.end;
    });
    range_flags.push_back(mapping == maps.end() ? std::vector<std::string>{}
                                                : vm_flags(pid, mapping->start));
  }
  common::RemoteThread thread(pid);
  long scratch = thread.syscall(SYS_mmap, 0, 4096, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, static_cast<uint64_t>(-1), 0);
  if (scratch < 0 && scratch > -4096) {
    throw Error(ErrorKind::kEnvironment, "cannot map a scratch page in process " +
                                             std::to_string(pid) + ": " +
                                             errno_text(static_cast<int>(-scratch)));
  }
  for (size_t i = 0; i < files.size(); ++i) {
    auto& f = files[i];
    auto mapping = std::find_if(maps.begin(), maps.end(), [&](const common::Mapping& m) {
      return m.start <= f.range.start && f.range.start < m.end;
    });
    if (mapping == maps.end()) continue;
    const auto& flags = range_flags[i];
    if (std::find(flags.begin(), flags.end(), "lo") != flags.end()) {
      // mlock on a private file mapping would copy every page: leave this one to CRIU.
      reporter.note("a locked (mlock) region of process " + std::to_string(pid) +
                    " is stored through CRIU");
      continue;
    }
    std::string path = std::filesystem::absolute(f.as_seen()).string();
    thread.write_memory(static_cast<uint64_t>(scratch), path.c_str(), path.size() + 1);
    long fd = thread.syscall(SYS_openat, static_cast<uint64_t>(AT_FDCWD),
                             static_cast<uint64_t>(scratch), O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) {
      reporter.note("process " + std::to_string(pid) + " cannot open its host image (" +
                    errno_text(static_cast<int>(-fd)) + "): stored through CRIU");
      continue;
    }
    long mapped = thread.syscall(SYS_mmap, f.range.start, f.range.size(), prot_of(mapping->perms),
                                 MAP_PRIVATE | MAP_FIXED, static_cast<uint64_t>(fd), f.pad);
    thread.syscall(SYS_close, static_cast<uint64_t>(fd));
    if (mapped != static_cast<long>(f.range.start)) continue;  // checked from the maps below
    const std::pair<const char*, int> advice[] = {{"dc", MADV_DONTFORK},
                                                  {"dd", MADV_DONTDUMP},
                                                  {"hg", MADV_HUGEPAGE},
                                                  {"nh", MADV_NOHUGEPAGE}};
    for (const auto& [flag, advise] : advice) {
      if (std::find(flags.begin(), flags.end(), flag) != flags.end()) {
        thread.syscall(SYS_madvise, f.range.start, f.range.size(), static_cast<uint64_t>(advise));
      }
    }
  }
  thread.syscall(SYS_munmap, static_cast<uint64_t>(scratch), 4096);
}

// Whether [range) of `pid` is now mapped privately from `file` only, the range's first byte at
// `offset`.
bool mapped_from(const std::vector<common::Mapping>& maps, const Range& range,
                 const std::filesystem::path& file, uint64_t offset) {
  auto want = std::filesystem::absolute(file).string();
  uint64_t covered = range.start;
  for (const auto& m : maps) {
    if (m.end <= range.start || m.start >= range.end) continue;
    if (m.path != want || m.start > covered || m.start < range.start ||
        m.offset != offset + (m.start - range.start) || m.perms.size() != 4 || m.perms[3] != 'p') {
      return false;
    }
    covered = m.end;
  }
  return covered >= range.end;
}

}  // namespace

bool all_zero(const unsigned char* data, size_t size) {
  // Word-wise OR: memory speed, and the common case (non-zero data) stops at the first word.
  size_t i = 0;
  for (; i + 64 <= size; i += 64) {
    uint64_t acc = 0;
    for (size_t k = 0; k < 64; k += 8) {
      uint64_t w;
      std::memcpy(&w, data + i + k, 8);
      acc |= w;
    }
    if (acc != 0) return false;
  }
  for (; i < size; ++i) {
    if (data[i] != 0) return false;
  }
  return true;
}

std::string mount_options_of(const std::filesystem::path& path, const std::string& mountinfo) {
  // mountinfo escapes blanks and backslashes in paths as \ooo (octal).
  auto unescape = [](const std::string& in) {
    std::string out;
    for (size_t i = 0; i < in.size(); ++i) {
      if (in[i] == '\\' && i + 3 < in.size() &&
          std::isdigit(static_cast<unsigned char>(in[i + 1])) != 0) {
        out += static_cast<char>(std::stoi(in.substr(i + 1, 3), nullptr, 8));
        i += 3;
      } else {
        out += in[i];
      }
    }
    return out;
  };
  const std::string target = path.string();
  size_t best = 0;
  std::string options;
  std::istringstream lines(mountinfo);
  for (std::string line; std::getline(lines, line);) {
    // "ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTS"
    std::istringstream fields(line);
    std::string id, parent, dev, root, point;
    fields >> id >> parent >> dev >> root >> point;
    point = unescape(point);
    auto dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::istringstream tail(line.substr(dash + 3));
    std::string type, source, super;
    tail >> type >> source >> super;
    const bool holds =
        target == point ||
        (target.rfind(point, 0) == 0 &&
         (point == "/" || (target.size() > point.size() && target[point.size()] == '/')));
    // The last of equally long mount points is the one on top.
    if (holds && point.size() >= best) {
      best = point.size();
      options = super;
    }
  }
  return options;
}

bool tmpfs_gives_huge_pages(const std::string& super_options) {
  std::istringstream items(super_options);
  for (std::string item; std::getline(items, item, ',');) {
    if (item == "huge=always" || item == "huge=within_size" || item == "huge=advise") return true;
  }
  return false;
}

bool on_tmpfs_without_huge_pages(const std::filesystem::path& dir) {
  struct statfs st {};
  if (::statfs(dir.c_str(), &st) != 0 || st.f_type != TMPFS_MAGIC) return false;
  std::error_code ec;
  auto canonical = std::filesystem::canonical(dir, ec);
  std::string mountinfo;
  if (ec || !fs::try_read_file("/proc/self/mountinfo", &mountinfo)) return false;
  return !tmpfs_gives_huge_pages(mount_options_of(canonical, mountinfo));
}

std::vector<Range> new_anonymous_ranges(const std::vector<common::Mapping>& before,
                                        const std::vector<common::Mapping>& after,
                                        uint64_t min_bytes) {
  std::vector<Range> out;
  for (const auto& m : after) {
    if (!private_anonymous_rw(m)) continue;
    // Subtract whatever was mapped before (a new region may have merged with an old one).
    std::vector<Range> pieces{{m.start, m.end}};
    for (const auto& old : before) {
      std::vector<Range> next;
      for (const auto& p : pieces) {
        if (old.end <= p.start || old.start >= p.end) {
          next.push_back(p);
          continue;
        }
        if (old.start > p.start) next.push_back({p.start, old.start});
        if (old.end < p.end) next.push_back({old.end, p.end});
      }
      pieces = std::move(next);
    }
    for (const auto& p : pieces) {
      if (p.size() >= min_bytes) out.push_back(p);
    }
  }
  std::sort(out.begin(), out.end(),
            [](const Range& a, const Range& b) { return a.start < b.start; });
  return out;
}

StoredHostImages store_host_images(pid_t pid, const std::vector<Range>& whole_ranges,
                                   const std::filesystem::path& artifact_root,
                                   const HostImageOptions& options, Reporter& reporter) {
  if (whole_ranges.empty()) return {};
  const uint64_t chunk_bytes = options.chunk_bytes;
  // Files are whole chunks, so that each chunk lies in one file.
  const uint64_t segment =
      options.file_bytes == 0
          ? UINT64_MAX
          : std::max(chunk_bytes, options.file_bytes / chunk_bytes * chunk_bytes);
  std::vector<Range> ranges;
  for (const auto& r : whole_ranges) {
    for (uint64_t at = r.start; at < r.end; at += segment) {
      ranges.push_back({at, r.end - at > segment ? at + segment : r.end});
      if (r.end - at <= segment) break;
    }
  }
  // The process opens the file by the path gpusnap sees, unless the caller made the folder
  // reachable from its mount namespace at another path.
  if (options.visible_dir.empty() && ns_of(std::to_string(pid), "mnt") != ns_of("self", "mnt")) {
    reporter.note("process " + std::to_string(pid) +
                  " lives in another mount namespace: its GPU memory is stored through CRIU");
    return {};
  }
  auto dir = artifact_root / kHostImageDir;
  std::filesystem::create_directories(dir);
  std::vector<ImageFile> files(ranges.size());
  try {
    for (size_t i = 0; i < ranges.size(); ++i) {
      auto& f = files[i];
      f.range = ranges[i];
      f.pad = f.range.start % kHugePage;
      std::ostringstream name;
      name << pid << "-" << std::hex << ranges[i].start << ".img";
      f.path = dir / name.str();
      if (!options.visible_dir.empty()) f.seen = options.visible_dir / name.str();
      f.fd.reset(::open(f.path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0400));
      if (!f.fd)
        throw Error(ErrorKind::kEnvironment,
                    "cannot create " + f.path.string() + ": " + errno_text(errno));
      if (::ftruncate(f.fd.get(), static_cast<off_t>(f.file_size())) != 0) {
        throw Error(ErrorKind::kEnvironment,
                    "cannot size " + f.path.string() + ": " + errno_text(errno));
      }
      void* map = ::mmap(nullptr, f.file_size(), PROT_READ | PROT_WRITE, MAP_SHARED, f.fd.get(), 0);
      if (map == MAP_FAILED) {
        throw Error(ErrorKind::kEnvironment,
                    "cannot map " + f.path.string() + ": " + errno_text(errno));
      }
      // On a tmpfs mounted with huge=advise this asks for 2 MiB pages (huge=within_size and
      // huge=always give them anyway): one page fault and one page-cache entry per 2 MiB
      // instead of 512, here and in every process that maps the file later. Only advice.
      ::madvise(map, f.file_size(), MADV_HUGEPAGE);
      f.map = static_cast<unsigned char*>(map);
    }
    copy_out(pid, files, options.threads, chunk_bytes);
    for (auto& f : files) f.unmap();
    remap(pid, files, common::read_mappings(pid), reporter);
  } catch (const Error& e) {
    // Before the remap nothing of the process changed; a remap that failed part-way is
    // sorted out below from what the process maps now.
    reporter.note("process " + std::to_string(pid) + ": " + e.what() +
                  "; its GPU memory is stored through CRIU");
  }
  StoredHostImages out;
  uint64_t total = 0, stored = 0;
  auto maps = common::read_mappings(pid);
  for (auto& f : files) {
    if (f.path.empty()) continue;
    if (!f.fd || !mapped_from(maps, f.range, f.as_seen(), f.pad)) {
      f.fd.reset();
      std::error_code ec;
      std::filesystem::remove(f.path, ec);
      continue;
    }
    HostImageRecord rec;
    rec.pid = pid;
    rec.start = f.range.start;
    rec.end = f.range.end;
    rec.file = std::filesystem::relative(f.path, artifact_root).string();
    rec.file_offset = f.pad;
    rec.criu_key = image_criu_key(pid, f.range, f.fd.get(), !f.seen.empty());
    rec.stored_bytes = f.stored;
    total += f.range.size();
    stored += rec.stored_bytes;
    out.files.push_back({rec.file, f.file_size(), f.chunks});
    out.images.push_back(std::move(rec));
  }
  if (!out.images.empty()) {
    reporter.note("process " + std::to_string(pid) + ": " + fs::human_bytes(total) +
                  " of host memory stored as " + std::to_string(out.images.size()) +
                  " host image file(s), " + fs::human_bytes(stored) + " of it not zero");
  }
  return out;
}

bool direct_capture_possible(pid_t pid, const std::vector<common::Mapping>& maps,
                             bool in_container) {
#if defined(__x86_64__)
  const bool reaches = in_container ? proc::environment_value(pid, kPreloadRequestsEnv) ==
                                          std::string(kContainerPreloadRequests)
                                    : ns_of(std::to_string(pid), "mnt") == ns_of("self", "mnt");
  std::string status;
  if (!maps_preload_library(maps) || !reaches ||
      !fs::try_read_file("/proc/" + std::to_string(pid) + "/status", &status)) {
    return false;
  }
  auto at = status.find("TracerPid:");
  return at != std::string::npos && std::strtol(status.c_str() + at + 10, nullptr, 10) == 0;
#else
  (void)pid;
  (void)maps;
  (void)in_container;
  return false;
#endif
}

std::filesystem::path preload_request_path(const std::filesystem::path& requests_dir, pid_t pid) {
  // "pid:[4026531836]" -> 4026531836
  auto ns = ns_of(std::to_string(pid), "pid");
  auto open_bracket = ns.find('[');
  if (open_bracket == std::string::npos) {
    throw Error(ErrorKind::kNotFound,
                "cannot read the PID namespace of process " + std::to_string(pid));
  }
  auto inode = ns.substr(open_bracket + 1, ns.find(']') - open_bracket - 1);
  return requests_dir /
         (inode + "-" + std::to_string(proc::innermost_pid(proc::read_process(pid))));
}

DirectHostImage::DirectHostImage(pid_t pid, const std::filesystem::path& artifact_root,
                                 const std::filesystem::path& requests_dir, Reporter& reporter,
                                 const std::filesystem::path& seen_dir)
    : pid_(pid), seen_dir_(seen_dir) {
  try {
    auto dir = artifact_root / kHostImageDir;
    std::filesystem::create_directories(dir);
    auto file = std::filesystem::absolute(dir / (std::to_string(pid) + ".img"));
    common::UniqueFd fd(::open(file.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) throw sys_error("create " + file.string(), errno);
    // As /proc/PID/maps will name it.
    file_ = std::filesystem::canonical(file);
    // Root's only: the library takes no request anyone else could have written.
    if (::mkdir(requests_dir.c_str(), 0700) != 0 && errno != EEXIST) {
      throw sys_error("create " + requests_dir.string(), errno);
    }
    auto request = preload_request_path(requests_dir, pid);
    write_preload_request(request, as_seen().string() + "\n");
    request_ = request;
    remap_request_base_ = request;
  } catch (const std::exception& e) {
    reporter.note("process " + std::to_string(pid) + ": " + e.what() +
                  "; its GPU memory is copied into the artifact after the driver's checkpoint");
  }
}

void DirectHostImage::withdraw() noexcept {
  if (request_.empty()) return;
  ::unlink(request_.c_str());
  request_.clear();
}

std::optional<HostImageRecord> DirectHostImage::adopt(const std::filesystem::path& artifact_root,
                                                      Reporter& reporter) {
  withdraw();
  if (file_.empty()) return std::nullopt;
  auto maps = common::read_mappings(pid_);
  std::vector<const common::Mapping*> pieces;
  for (const auto& m : maps) {
    if (m.path == as_seen().string()) pieces.push_back(&m);
  }
  std::error_code ec;
  if (pieces.empty()) {  // the library did not take the request: the copying path
    std::filesystem::remove(file_, ec);
    file_.clear();
    return std::nullopt;
  }
  // One range at consecutive offsets of the file, as the library mapped it (the driver may
  // have split it by changing the advice or protection of parts).
  const Range range{pieces.front()->start, pieces.back()->end};
  const uint64_t offset = pieces.front()->offset;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if ((i > 0 && pieces[i]->start != pieces[i - 1]->end) ||
        pieces[i]->offset != offset + (pieces[i]->start - range.start)) {
      throw Error(ErrorKind::kEnvironment,
                  "process " + std::to_string(pid_) +
                      " maps its host image file in unexpected pieces; it cannot be captured",
                  "capture it with --no-direct-host-images");
    }
  }
  std::ostringstream name;
  name << pid_ << "-" << std::hex << range.start << ".img";
  auto named = file_.parent_path() / name.str();
  if (::rename(file_.c_str(), named.c_str()) != 0)
    throw sys_error("rename " + file_.string(), errno);
  file_ = named;
  common::UniqueFd fd(::open(file_.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) throw sys_error("open " + file_.string(), errno);
  // The file holds the range and nothing more, as its record says (a mapping ends on a page
  // boundary, the length the driver asked for need not: the last page's tail reads zero either
  // way; and a part the driver unmapped is no part of the image).
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 ||
      (static_cast<uint64_t>(st.st_size) != offset + range.size() &&
       ::ftruncate(fd.get(), static_cast<off_t>(offset + range.size())) != 0)) {
    throw sys_error("size " + file_.string(), errno);
  }
  range_ = range;
  offset_ = offset;
  HostImageRecord rec;
  rec.pid = pid_;
  rec.start = range.start;
  rec.end = range.end;
  rec.file = std::filesystem::relative(file_, artifact_root).string();
  rec.file_offset = offset;
  rec.criu_key = image_criu_key(pid_, range, fd.get(), !seen_dir_.empty());
  fd_ = std::move(fd);
  reporter.note("process " + std::to_string(pid_) + ": " + fs::human_bytes(range.size()) +
                " of host memory written into the artifact by the driver's checkpoint itself");
  return rec;
}

void DirectHostImage::make_private(Reporter& reporter) {
  if (!fd_) return;
  // A copy restored later, or the source, must never write into the artifact: private, or the
  // capture fails (and the source's GPU state goes back from the shared mapping as it is). The
  // library's watcher does it from inside the process; a library without one, through ptrace.
  if (has_thread_named(pid_, kRemapThreadName)) {
    remap_from_inside(range_, offset_);
  } else {
    std::vector<ImageFile> files(1);
    auto& f = files.front();
    f.range = range_;
    f.pad = offset_;
    f.path = file_;
    if (!seen_dir_.empty()) f.seen = as_seen();
    f.fd.reset(::dup(fd_.get()));
    remap(pid_, files, common::read_mappings(pid_), reporter);
  }
  if (!mapped_from(common::read_mappings(pid_), range_, as_seen(), offset_)) {
    throw Error(ErrorKind::kEnvironment,
                "process " + std::to_string(pid_) +
                    ": the driver's memory, written into the artifact, could not be made private",
                "capture it with --no-direct-host-images");
  }
  // Read-only and root-only: CRIU records this mode and a restore checks it (fs::restrict_tree).
  ::fchmod(fd_.get(), 0400);
  fd_.reset();
}

void DirectHostImage::remap_from_inside(const Range& range, uint64_t offset) {
  const auto maps = common::read_mappings(pid_);
  auto mapping = std::find_if(maps.begin(), maps.end(), [&](const common::Mapping& m) {
    return m.start <= range.start && range.start < m.end;
  });
  if (mapping == maps.end()) return;  // found out by the check that follows
  RemapRequest request{range.start, range.end, offset, prot_of(mapping->perms), 0};
  const auto flags = vm_flags(pid_, mapping->start);
  const auto has = [&](const char* flag) {
    return std::find(flags.begin(), flags.end(), flag) != flags.end();
  };
  // mlock on a private file mapping would copy every page; the check that follows refuses it.
  if (has("lo")) return;
  for (const auto& [flag, bit] :
       {std::pair{"dc", kAdviceDontFork}, std::pair{"dd", kAdviceDontDump},
        std::pair{"hg", kAdviceHugePage}, std::pair{"nh", kAdviceNoHugePage}}) {
    if (has(flag)) request.advice |= bit;
  }
  if (!remap_in_process(pid_, remap_request_base_, request, kRemapLimit)) {
    throw Error(ErrorKind::kTimeout,
                "process " + std::to_string(pid_) + ": " + kPreloadFileName +
                    " did not make the driver's memory private within " +
                    std::to_string(kRemapLimit.count()) + " ms",
                "try again on a less loaded machine, or with --no-direct-host-images");
  }
  remapped_ = true;
}

DirectHostImage::~DirectHostImage() {
  withdraw();
  // A watcher left waiting would be dumped with the process by a later capture.
  if (!remapped_ && !remap_request_base_.empty()) {
    cancel_remap_watchers({pid_}, {remap_request_base_}, kRemapLimit);
  }
}

WriteBehind::WriteBehind(const std::vector<std::filesystem::path>& files) {
  for (const auto& f : files) {
    common::UniqueFd fd(::open(f.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd) fds_.push_back(std::move(fd));
  }
  if (fds_.empty()) return;
  thread_ = std::thread([this] {
    while (!stop_) {
      // Starts writing what is dirty now and does not wait for it (SYNC_FILE_RANGE_WRITE).
      for (const auto& fd : fds_) ::sync_file_range(fd.get(), 0, 0, SYNC_FILE_RANGE_WRITE);
      for (int i = 0; i < 20 && !stop_; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
}

WriteBehind::~WriteBehind() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

struct HashedFiles::File {
  std::string record;  // the image's file, relative to the artifact root
  std::filesystem::path path;
  uint64_t size = 0;
  unsigned char* map = nullptr;
  std::vector<std::string> chunks;
  std::atomic<uint64_t> stored{0};
  File() = default;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (map != nullptr) ::munmap(map, size);
  }
};

HashedFiles::HashedFiles(const std::filesystem::path& artifact_root,
                         const std::vector<HostImageRecord>& images, uint64_t chunk_bytes,
                         int threads)
    : chunk_bytes_(chunk_bytes) {
  for (const auto& image : images) {
    auto f = std::make_unique<File>();
    f->record = image.file;
    f->path = artifact_root / image.file;
    f->size = image.file_offset + (image.end - image.start);
    f->chunks.resize((f->size + chunk_bytes - 1) / chunk_bytes);
    common::UniqueFd fd(::open(f->path.c_str(), O_RDONLY | O_CLOEXEC));
    void* map = fd ? ::mmap(nullptr, f->size, PROT_READ, MAP_SHARED, fd.get(), 0) : MAP_FAILED;
    if (map == MAP_FAILED) {
      failure_ = "cannot read " + f->path.string() + ": " + errno_text(errno);
      return;
    }
    f->map = static_cast<unsigned char*>(map);
    files_.push_back(std::move(f));
  }
  size_t chunks = 0;
  for (const auto& f : files_) chunks += f->chunks.size();
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(chunks)));
  pool_.emplace(static_cast<size_t>(n),
                [this](size_t, const std::atomic<bool>& stop) { work(stop); });
}

void HashedFiles::work(const std::atomic<bool>& stop) {
  artifact::ChunkHash hash;
  while (!stop) {
    // The next chunk, counted across the files in order.
    size_t job = next_.fetch_add(1);
    File* file = nullptr;
    for (const auto& f : files_) {
      if (job < f->chunks.size()) {
        file = f.get();
        break;
      }
      job -= f->chunks.size();
    }
    if (file == nullptr) return;
    const uint64_t begin = job * chunk_bytes_;
    const uint64_t end = std::min(file->size, begin + chunk_bytes_);
    hash.reset();
    uint64_t stored = 0;
    for (uint64_t at = begin; at < end && !stop; at += kHoleBlock) {
      const uint64_t block = std::min(kHoleBlock, end - at);
      if (!all_zero(file->map + at, block)) stored += block;
      hash.update(file->map + at, block);
    }
    file->stored += stored;
    file->chunks[job] = hash.hex();
  }
}

HashedFiles::~HashedFiles() = default;

std::vector<FileRecord> HashedFiles::join(std::vector<HostImageRecord>& images) {
  if (pool_) pool_->join();
  if (!failure_.empty()) throw Error(ErrorKind::kEnvironment, failure_);
  std::vector<FileRecord> out;
  for (const auto& f : files_) {
    for (auto& image : images) {
      if (image.file == f->record) image.stored_bytes = f->stored;
    }
    out.push_back({f->record, f->size, f->chunks});
  }
  return out;
}

std::vector<std::string> criu_external_keys(const std::vector<HostImageRecord>& images) {
  std::vector<std::string> keys;
  keys.reserve(images.size());
  for (const auto& i : images) keys.push_back(i.criu_key);
  return keys;
}

}  // namespace gpusnap::engine
