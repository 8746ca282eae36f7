#include "engine/tier_files.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "common/fd.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/subprocess.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {
namespace {

namespace stdfs = std::filesystem;
namespace folder = tier::folder;
using nlohmann::json;

Error bad_entry(const stdfs::path& dir, const std::string& name, const std::string& why) {
  return Error(
      ErrorKind::kHandshake,
      "the workload left " + (dir / name).string() + " in its memory tier's folder: " + why,
      "only libgpusnap-tier.so writes there; check what else the workload does at "
      "its pause");
}

// The effective uid and gid of `pid` (the second field of the Uid: and Gid: lines).
std::pair<uid_t, gid_t> owner_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  uid_t uid = 0;
  gid_t gid = 0;
  bool got_uid = false;
  bool got_gid = false;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string key;
    unsigned long real = 0;
    unsigned long effective = 0;
    fields >> key >> real >> effective;
    if (!fields) continue;
    if (key == "Uid:") {
      uid = static_cast<uid_t>(effective);
      got_uid = true;
    } else if (key == "Gid:") {
      gid = static_cast<gid_t>(effective);
      got_gid = true;
    }
  }
  if (!got_uid || !got_gid) {
    throw Error(ErrorKind::kNotFound,
                "process " + std::to_string(pid) + " is gone (no Uid/Gid in its status)",
                "capture a running workload");
  }
  return {uid, gid};
}

}  // namespace

stdfs::path make_tier_dir(const stdfs::path& staging, pid_t pid) {
  const auto [uid, gid] = owner_of(pid);
  stdfs::path dir = staging / kTierDirName;
  if (::mkdir(dir.c_str(), 0700) != 0) throw sys_error("cannot create " + dir.string(), errno);
  if (::chown(dir.c_str(), uid, gid) != 0) {
    throw sys_error("cannot hand " + dir.string() + " to the workload's user", errno);
  }
  return dir;
}

TierContents check_tier_dir(const stdfs::path& dir) {
  TierContents contents;
  std::vector<stdfs::path> indexes;
  std::error_code ec;
  for (stdfs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (++contents.files > folder::kMaxEntries) {
      throw bad_entry(dir, name, "more than " + std::to_string(folder::kMaxEntries) + " entries");
    }
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      throw bad_entry(dir, name, "not a regular file");
    }
    const folder::EntryKind kind = folder::classify(name).kind;
    if (kind == folder::EntryKind::kIndex) {
      if (static_cast<uintmax_t>(st.st_size) > folder::kMaxIndexBytes) {
        throw bad_entry(dir, name, "an index larger than 1 MiB");
      }
      indexes.push_back(it->path());
    } else if (kind == folder::EntryKind::kLayout) {
      if (static_cast<uintmax_t>(st.st_size) > folder::kMaxLayoutBytes) {
        throw bad_entry(dir, name, "a layout larger than 64 MiB");
      }
    } else if (kind != folder::EntryKind::kDrainFile) {
      throw bad_entry(dir, name, "not a file of the tier (PID-wN.img, PID.json or PID.layout)");
    }
  }
  if (ec) throw sys_error("cannot list " + dir.string(), ec.value());
  for (const auto& path : indexes) {
    // Bounded again as it is read: the workload may have grown the file since the listing.
    std::string text;
    if (!fs::try_read_regular_file(path, &text, folder::kMaxIndexBytes)) {
      throw bad_entry(dir, path.filename().string(),
                      errno == EFBIG ? "an index larger than 1 MiB"
                                     : "an index that cannot be read (" + errno_text(errno) + ")");
    }
    std::string why;
    const std::optional<folder::TierIndex> index = folder::parse_index(text, &why);
    if (!index) throw bad_entry(dir, path.filename().string(), "a malformed index (" + why + ")");
    for (const auto& f : index->files) {
      if (stdfs::file_size(dir / f.path, ec) != f.size || ec) {
        throw bad_entry(dir, path.filename().string(),
                        "an index naming " + f.path + ", which is not there at " +
                            std::to_string(f.size) + " bytes");
      }
    }
    for (const auto& g : index->gpus) {
      contents.gpu_bytes[g.uuid] += g.bytes;
      contents.bytes += g.bytes;
    }
  }
  if (contents.files == 0) stdfs::remove(dir, ec);
  return contents;
}

TierChecksums::TierChecksums(const stdfs::path& dir, uint64_t chunk_bytes, int threads)
    : thread_([this, dir, chunk_bytes, threads](const std::stop_token& stop) {
        try {
          VerifyOptions options;
          options.threads = threads;
          options.stop = stop;
          files_ = checksum_tree(dir, chunk_bytes, options);
          for (auto& f : files_) f.path = std::string(kTierDirName) + "/" + f.path;
        } catch (...) {
          failure_ = std::current_exception();
        }
      }) {}

std::vector<FileRecord> TierChecksums::join() {
  thread_.join();
  if (failure_) std::rethrow_exception(failure_);
  return std::move(files_);
}

void add_tier_memory(std::optional<GpuFacts>& gpu, pid_t pid, const TierContents& tier) {
  if (tier.bytes == 0 || !gpu || gpu->processes.empty()) return;
  GpuProcessRecord* entry = &gpu->processes.front();
  for (auto& p : gpu->processes) {
    if (p.pid == pid) entry = &p;
  }
  for (const auto& [uuid, bytes] : tier.gpu_bytes) {
    bool found = false;
    for (auto& g : entry->gpus) {
      if (g.uuid == uuid) {
        g.bytes += bytes;
        found = true;
      }
    }
    if (!found) entry->gpus.push_back({uuid, bytes});
  }
  entry->bytes += tier.bytes;
  // A GPU that holds tier memory is used, whatever NVML said after the drain.
  for (auto& g : gpu->gpus) {
    if (tier.gpu_bytes.count(g.uuid) != 0) g.used = true;
  }
}

json tier_member(const stdfs::path& dir) {
  std::error_code ec;
  return stdfs::is_directory(dir, ec) ? dir.string() : std::string();
}

json artifact_tier_dir(const stdfs::path& artifact, const Manifest& manifest) {
  const std::string prefix = std::string(kTierDirName) + "/";
  for (const auto& f : manifest.files) {
    if (f.path.rfind(prefix, 0) == 0) return (stdfs::absolute(artifact) / kTierDirName).string();
  }
  return std::string();
}

// ---- TierPrefills --------------------------------------------------------------------------

struct TierPrefills::Running {
  common::Subprocess process;
  std::filesystem::path log;
  std::string what;       // "copy N, process PID"
  common::UniqueFd done;  // read end: end of file once the prefill has said what it did
  std::string pid;
  common::UniqueFd sums;  // read end: the checksums of what it read, then end of file
};

namespace {

// The prefill program, or nothing.
std::optional<stdfs::path> prefill_program() {
  const char* given = std::getenv("GPUSNAP_TIER_PREFILL");
  if (given != nullptr && std::string(given) == "off") return std::nullopt;
  if (given != nullptr && *given != '\0') return stdfs::path(given);
  std::error_code ec;
  const auto exe = stdfs::read_symlink("/proc/self/exe", ec);
  if (ec) return std::nullopt;
  auto candidate = exe.parent_path() / "gpusnap-tier-prefill";
  if (::access(candidate.c_str(), X_OK) != 0) return std::nullopt;
  return candidate;
}

// The numbers the prefill's `done` and `sums` pipes have in it (tier/prefill_main.cc, DONE-FD
// and SUMS-FD).
constexpr int kPrefillDoneFd = 3;
constexpr int kPrefillSumsFd = 4;
// For an arriving artifact: the tier's folder (DIR is /proc/self/fd/5) and the socket that says
// how much of each drain file is there (ARRIVAL-FD).
constexpr int kPrefillDirFd = 5;
constexpr int kPrefillArrivalFd = 6;

// How reading a pipe to its end ended.
enum class PipeEnd { kEndOfFile, kStopped, kReadError };

// Reads `fd` until end of file, `deadline`, or `take` (given every byte read) answers false.
PipeEnd read_until_end(int fd, std::chrono::steady_clock::time_point deadline,
                       const std::function<bool(const char*, size_t)>& take) {
  char buf[16384];
  for (;;) {
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return PipeEnd::kStopped;
    const ssize_t got = ::read(fd, buf, sizeof buf);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got < 0) return PipeEnd::kReadError;
    if (got == 0) return PipeEnd::kEndOfFile;
    if (!take(buf, static_cast<size_t>(got))) return PipeEnd::kStopped;
  }
}

// The text on `fd` up to its end, when it came before `deadline` and within `limit` bytes.
std::optional<std::string> read_to_end(int fd, std::chrono::steady_clock::time_point deadline,
                                       size_t limit) {
  std::string text;
  const PipeEnd end = read_until_end(fd, deadline, [&](const char* data, size_t size) {
    text.append(data, size);
    return text.size() <= limit;
  });
  if (end != PipeEnd::kEndOfFile) return std::nullopt;
  return text;
}

// Waits until `fd` reads end of file (its writer closed it or ended), or `deadline`. Anything
// written on it is read and ignored.
bool wait_for_end_of_file(int fd, std::chrono::steady_clock::time_point deadline) {
  return read_until_end(fd, deadline, [](const char*, size_t) { return true; }) !=
         PipeEnd::kStopped;
}

// Whether every folder from / down to `dir` may be traversed by any user.
bool searchable_by_all(const stdfs::path& dir) {
  for (stdfs::path p = dir; !p.empty(); p = p.parent_path()) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0 || (st.st_mode & S_IXOTH) == 0) return false;
    if (p == p.root_path()) break;
  }
  return true;
}

// The one GPU a process's tier is on (its index's "gpus"), or "" when it spans several or the
// index is not one gpusnap wrote: then no prefill starts and the copy fills by itself. Read from
// an artifact before its checksums are checked, so bounded in size and depth.
std::string tier_gpu(const stdfs::path& index) {
  std::string text;
  if (!fs::try_read_regular_file(index, &text, folder::kMaxIndexBytes)) return {};
  const std::optional<folder::TierIndex> parsed = folder::parse_index(text);
  if (!parsed || parsed->gpus.size() != 1) return {};
  return parsed->gpus.front().uuid;
}

}  // namespace

// The sockets on which the prefills of an arriving artifact learn what is written
// (tier/arrival.h): one per prefill, gpusnap's end, by the process whose drain files it fills.
class TierPrefills::Feeds {
 public:
  void add(std::string pid, common::UniqueFd fd) {
    std::lock_guard lock(mu_);
    feeds_.push_back({std::move(pid), std::move(fd)});
  }
  // A line "NAME BYTES" to each prefill of the drain file's process. The socket's buffer holds
  // every line of a pull (a line per chunk written, some 30 bytes each): a send never waits on
  // a prefill, and one that fails (the prefill ended) closes that socket alone.
  void send(const std::string& path, uint64_t bytes) {
    const std::string prefix = std::string(kTierDirName) + "/";
    if (!path.starts_with(prefix)) return;
    const std::string name = path.substr(prefix.size());
    const folder::Entry e = folder::classify(name);
    if (e.kind != folder::EntryKind::kDrainFile) return;
    const std::string line = name + " " + std::to_string(bytes) + "\n";
    std::lock_guard lock(mu_);
    for (auto& [pid, fd] : feeds_) {
      if (pid != e.pid || !fd) continue;
      const ssize_t n = ::send(fd.get(), line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n != static_cast<ssize_t>(line.size())) fd.reset();
    }
  }
  void close_all() {
    std::lock_guard lock(mu_);
    feeds_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::string, common::UniqueFd>> feeds_;
};

TierPrefills::TierPrefills(const stdfs::path& artifact,
                           const std::map<std::string, std::string>& gpu_map, int copies,
                           const stdfs::path& run_dir, uint64_t chunk_bytes, bool arriving)
    : chunk_bytes_(chunk_bytes) {
  const auto program = prefill_program();
  const stdfs::path tier = stdfs::absolute(artifact) / kTierDirName;
  std::error_code ec;
  if (!program || !stdfs::is_directory(tier, ec)) return;
  std::vector<std::string> pids;
  for (stdfs::directory_iterator it(tier, ec), end; !ec && it != end; it.increment(ec)) {
    const folder::Entry e = folder::classify(it->path().filename().string());
    if (e.kind == folder::EntryKind::kLayout) pids.push_back(e.pid);
  }
  if (pids.empty()) return;
  try {
    start(*program, tier, pids, gpu_map, copies, run_dir, chunk_bytes, arriving);
  } catch (...) {
    stop_all();  // no destructor runs for a constructor that throws
    throw;
  }
}

void TierPrefills::start(const stdfs::path& program, const stdfs::path& tier,
                         const std::vector<std::string>& pids,
                         const std::map<std::string, std::string>& gpu_map, int copies,
                         const stdfs::path& run_dir, uint64_t chunk_bytes, bool arriving) {
  std::error_code ec;
  if (arriving) {
    tier_dir_ = common::UniqueFd(::open(tier.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!tier_dir_) throw sys_error("cannot open " + tier.string(), errno);
    feeds_ = std::make_shared<Feeds>();
  }
  // A folder of its own for this restore: root's, traversable, a socket per copy and process
  // owned by the workload's user (who owns the tier's files).
  std::random_device rd;
  root_ =
      run_dir / "prefill" / ("restore-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
  stdfs::create_directories(root_.parent_path(), ec);
  if (::mkdir(root_.c_str(), 0711) != 0) {
    throw sys_error("cannot create " + root_.string(), errno);
  }
  for (int c = 0; c < copies; ++c) {
    const auto dir = root_ / ("copy-" + std::to_string(c));
    if (::mkdir(dir.c_str(), 0711) != 0) throw sys_error("cannot create " + dir.string(), errno);
    bool any = false;
    for (const auto& pid : pids) {
      const auto index = tier / folder::index_name(pid);
      const std::string recorded = tier_gpu(index);
      struct stat st {};
      // A workload that could not reach the socket would fill by itself beside the prefill's
      // memory, twice the GPU memory at once: not for a user other than root who cannot
      // traverse to the folder.
      if (recorded.empty() || ::stat(index.c_str(), &st) != 0 ||
          (st.st_uid != 0 && !searchable_by_all(dir))) {
        continue;
      }
      const auto mapped = gpu_map.find(recorded);
      const std::string gpu = mapped != gpu_map.end() ? mapped->second : recorded;
      const auto log = dir / (pid + ".log");
      common::UniqueFd log_fd(::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
      if (log_fd.get() < 0) throw sys_error("cannot create " + log.string(), errno);
      auto done = common::Pipe::make();
      // Only the first copy's prefills checksum what they read: every copy's prefill reads the
      // same files, and one check of their bytes is what gpusnap's own verify gave (it read each
      // file once for all copies). The others copy without hashing, so that copies restored at
      // once do not hash the same bytes once each (docs/memory-tier.md, "Measured: the prefill's
      // workers and checksums").
      const bool summing = c == 0 && chunk_bytes > 0;
      std::optional<common::Pipe> sums;
      if (summing) {
        sums = common::Pipe::make();
        // Room for every line at once (a few KiB per file): the prefill never waits on gpusnap.
        (void)::fcntl(sums->write.get(), F_SETPIPE_SZ, 1 << 20);
      }
      std::array<int, 2> feed{-1, -1};
      if (arriving) {
        if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, feed.data()) != 0) {
          throw sys_error("socketpair", errno);
        }
        // Room for thousands of lines (a line per chunk written), beyond the default limit
        // where root may: Feeds::send never waits, and the prefill reads from its start.
        const int room = 8 << 20;
        if (::setsockopt(feed[0], SOL_SOCKET, SO_SNDBUFFORCE, &room, sizeof room) != 0) {
          (void)::setsockopt(feed[0], SOL_SOCKET, SO_SNDBUF, &room, sizeof room);
        }
      }
      common::UniqueFd ours(feed[0]), theirs(feed[1]);
      common::SpawnOptions o;
      o.argv = {program.string(),
                arriving ? "/proc/self/fd/" + std::to_string(kPrefillDirFd) : tier.string(),
                pid,
                (dir / (pid + ".sock")).string(),
                gpu,
                std::to_string(st.st_uid),
                std::to_string(st.st_gid),
                "60000",
                std::to_string(kPrefillDoneFd),
                summing ? std::to_string(kPrefillSumsFd) : "-1",
                summing ? std::to_string(chunk_bytes) : "0",
                arriving ? std::to_string(kPrefillArrivalFd) : "-1"};
      o.stderr_fd = log_fd.get();
      o.keep_fds = {{done.write.get(), kPrefillDoneFd}};
      if (summing) o.keep_fds.emplace_back(sums->write.get(), kPrefillSumsFd);
      if (arriving) {
        o.keep_fds.emplace_back(tier_dir_.get(), kPrefillDirFd);
        o.keep_fds.emplace_back(theirs.get(), kPrefillArrivalFd);
      }
      auto run = std::make_unique<Running>(
          Running{common::Subprocess(o), log, "copy " + std::to_string(c) + ", process " + pid,
                  std::move(done.read), pid, summing ? std::move(sums->read) : common::UniqueFd()});
      running_.push_back(std::move(run));
      if (arriving) feeds_->add(pid, std::move(ours));
      any = true;
    }
    copy_dirs_.push_back(any ? dir : stdfs::path());
  }
}

TierPrefills::~TierPrefills() { stop_all(); }

std::function<void(const std::string&, uint64_t)> TierPrefills::arrival_feed() const {
  // Shared, not borrowed: the pull's threads call it until the pull ends, which may be after
  // this object is gone (the restore failed); by then the feeds are closed and it does nothing.
  return [feeds = feeds_](const std::string& path, uint64_t bytes) {
    if (feeds) feeds->send(path, bytes);
  };
}

void TierPrefills::stop_all() noexcept {
  if (feeds_) feeds_->close_all();
  running_.clear();  // each Subprocess kills and reaps a prefill still running
  copy_dirs_.clear();
  if (!root_.empty()) {
    std::error_code ec;
    stdfs::remove_all(root_, ec);
    root_.clear();
  }
}

json TierPrefills::context_dir(int copy) const {
  if (copy < 0 || static_cast<size_t>(copy) >= copy_dirs_.size()) return std::string();
  return copy_dirs_[static_cast<size_t>(copy)].string();
}

namespace {

// Calls `each(path, pid)` for every drain file the manifest lists.
template <typename Each>
void for_each_drain_file(const Manifest& manifest, Each each) {
  for (const auto& f : manifest.files) {
    const folder::Entry e = folder::classify_in_artifact(f.path);
    if (e.kind == folder::EntryKind::kDrainFile) each(f.path, e.pid);
  }
}

}  // namespace

std::set<std::string> drain_files(const Manifest& manifest) {
  std::set<std::string> files;
  for_each_drain_file(manifest,
                      [&](const std::string& path, const std::string&) { files.insert(path); });
  return files;
}

std::set<std::string> TierPrefills::files_read(const Manifest& manifest) const {
  if (chunk_bytes_ == 0) return {};  // no sums asked for: verify reads every file
  std::set<std::string> summing;     // processes whose files a prefill checksums
  for (const auto& r : running_) {
    if (r->sums) summing.insert(r->pid);
  }
  std::set<std::string> files;
  for_each_drain_file(manifest, [&](const std::string& path, const std::string& pid) {
    if (summing.count(pid) > 0) files.insert(path);
  });
  return files;
}

std::vector<TierPrefills::Sums> TierPrefills::checksums(
    std::chrono::steady_clock::time_point deadline) {
  std::vector<Sums> all;
  if (chunk_bytes_ == 0) return all;
  for (auto& r : running_) {
    if (!r->sums) continue;
    const auto text = read_to_end(r->sums.get(), deadline, kMaxPrefillSumsBytes);
    r->sums.reset();
    if (!text) continue;
    if (auto files = parse_prefill_sums(*text, r->pid, chunk_bytes_)) {
      all.push_back({r->what, std::move(*files)});
    }
  }
  return all;
}

std::vector<VerifyProblem> verify_prefilled(const Artifact& artifact, TierPrefills& prefills,
                                            const std::set<std::string>& files,
                                            std::chrono::steady_clock::time_point deadline) {
  std::vector<VerifyProblem> problems;
  std::set<std::string> summed;
  for (const auto& sums : prefills.checksums(deadline)) {
    for (const auto& f : sums.files) {
      if (files.count(f.path) == 0) continue;
      for (auto p : artifact.compare(f)) {
        p.problem += " (as the tier prefill of " + sums.what + " read it)";
        problems.push_back(std::move(p));
      }
      summed.insert(f.path);
    }
  }
  VerifyScope unread;
  for (const auto& f : files) {
    if (summed.count(f) == 0) unread.only.insert(f);
  }
  if (!unread.only.empty()) {
    for (auto& p : artifact.verify({}, unread)) problems.push_back(std::move(p));
  }
  return problems;
}

std::optional<std::vector<FileRecord>> parse_prefill_sums(const std::string& text,
                                                          const std::string& pid,
                                                          uint64_t chunk_bytes) {
  if (text.size() > kMaxPrefillSumsBytes || chunk_bytes == 0) return std::nullopt;
  static const std::regex kHex(R"([0-9a-f]{32})");
  std::vector<FileRecord> files;
  std::set<std::string> names;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string name;
    std::string size;
    words >> name >> size;
    const folder::Entry entry = folder::classify(name);
    if (entry.kind != folder::EntryKind::kDrainFile || entry.pid != pid ||
        !names.insert(name).second || size.empty() || size.size() > 15 ||
        size.find_first_not_of("0123456789") != std::string::npos) {
      return std::nullopt;
    }
    FileRecord rec{std::string(kTierDirName) + "/" + name, std::stoull(size), {}};
    const uint64_t chunks = std::max<uint64_t>(1, (rec.size + chunk_bytes - 1) / chunk_bytes);
    for (std::string hex; words >> hex;) {
      if (!std::regex_match(hex, kHex) || rec.chunks.size() >= chunks) return std::nullopt;
      rec.chunks.push_back(hex);
    }
    if (rec.chunks.size() != chunks) return std::nullopt;
    files.push_back(std::move(rec));
  }
  if (!text.empty() && text.back() != '\n') return std::nullopt;  // cut short
  return files;
}

std::vector<std::string> TierPrefills::finish() {
  std::vector<std::string> lines;
  // A prefill whose memory was taken says so at once and closes its end of `done`; one still
  // waiting was not taken. One short grace for all of them: this runs before the restore
  // returns. What follows the report is the prefill's exit, which tears down a CUDA context
  // and unmaps the memory it made: nobody waits for it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  for (auto& r : running_) {
    const bool said = wait_for_end_of_file(r->done.get(), deadline);
    auto status = r->process.poll();
    std::string text;
    (void)fs::try_read_file(r->log, &text);
    while (!text.empty() && text.back() == '\n') text.pop_back();
    if (const auto nl = text.rfind('\n'); nl != std::string::npos) text = text.substr(nl + 1);
    lines.push_back("tier prefill (" + r->what +
                    "): " + (text.empty() ? (status ? status->describe() : "stopped") : text));
    if (said) common::reap_in_background(std::move(r->process));
    // Otherwise its Subprocess, cleared below, kills and reaps it.
  }
  running_.clear();
  return lines;
}

}  // namespace gpusnap::engine
