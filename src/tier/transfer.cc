// The tier's drain and fill: every live block to files and back, through pinned buffers on
// several streams.
//
// The order is the guarantee (docs/memory-tier.md):
//   drain: synchronise -> trim the cache -> copy every live byte into files -> close them and
//          write the index -> only then release the physical memory (the reservations stay)
//   fill:  check the GPU map -> create and map every segment at its address -> copy the files
//          back -> synchronise
// A failed drain releases nothing; a failed fill releases what it mapped. The files are the only
// copy of the contents between a drain's release and the next fill, so nothing here removes a
// file that a release has made the only copy.
//
// Each worker owns one stream per device, two pinned buffers and, in a drain, one file: writes to
// one file serialise on its inode lock, so sharing a file would make the workers take turns. A
// worker takes a piece at a time and moves it a buffer's worth at a time, overlapping its two
// buffers: while the copy engine moves one, the CPU writes (drain) or reads (fill) the other.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/fd.h"
#include "common/worker_pool.h"
#include "gpusnap/error.h"
#include "tier/folder_format.h"
#include "tier/handover.h"
#include "tier/in_place.h"
#include "tier/memory_tier.h"

namespace gpusnap::tier {
namespace {

using Clock = std::chrono::steady_clock;

Error file_error(const std::string& what, const std::filesystem::path& path, int err) {
  return Error(ErrorKind::kInternal,
               "memory tier: " + what + " " + path.string() + ": " + errno_text(err));
}

// What one worker holds: pinned buffers and a stream per device, all given back by its
// destructor (they must not outlive the drain or fill: pinned memory would enter the snapshot).
class WorkerResources {
 public:
  WorkerResources(TierDriver& driver, std::size_t buffer_bytes)
      : driver_(driver), bytes_(buffer_bytes) {}
  WorkerResources(const WorkerResources&) = delete;
  WorkerResources& operator=(const WorkerResources&) = delete;
  ~WorkerResources() {
    for (auto& [device, stream] : streams_) {
      try {
        driver_.use_device(device);
      } catch (...) {  // NOLINT(bugprone-empty-catch): the stream goes with its context anyway
      }
      driver_.stream_destroy(stream);
    }
    if (pinned_ != nullptr) driver_.host_free(pinned_);
  }

  // Makes `device` current and returns this worker's stream on it.
  Stream on(int device) {
    driver_.use_device(device);
    auto it = streams_.find(device);
    if (it == streams_.end()) it = streams_.emplace(device, driver_.stream_create()).first;
    return it->second;
  }
  // Allocates both pinned buffers now, on `device`'s context, and returns how long it took:
  // pinning is the fixed cost of every drain and fill, and the benchmarks want it apart.
  double prepare(int device) {
    const auto t0 = std::chrono::steady_clock::now();
    (void)on(device);
    (void)buffer(1);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // Pinned buffer 0 or 1, the two halves of one allocation made at first use (with a context
  // current): one allocation pins both at once, and small buffers share one 2 MiB page.
  void* buffer(int i) {
    if (pinned_ == nullptr) pinned_ = driver_.host_alloc(2 * bytes_);
    return static_cast<unsigned char*>(pinned_) + (i == 0 ? 0 : bytes_);
  }
  std::size_t buffer_bytes() const { return bytes_; }

 private:
  TierDriver& driver_;
  std::size_t bytes_;
  std::map<int, Stream> streams_;
  void* pinned_ = nullptr;
};

// The first device of the tier made current in the calling thread for one drain or fill, and
// what was current put back after it.
class DeviceScope {
 public:
  DeviceScope(TierDriver& driver, const std::map<int, std::string>& devices) {
    if (!devices.empty()) entered_.emplace(driver, devices.begin()->first);
  }

 private:
  std::optional<EnteredDevice> entered_;
};

// Runs `work(k, resources, stop)` on n workers (common/worker_pool.h: the first error is
// rethrown once all have finished, and sets `stop`, so that the others take no more pieces),
// each with its pinned buffers and stream made first, on the device of the piece of its own index
// (there are at least n pieces); returns the slowest worker's pinning time.
template <typename Pieces, typename Work>
double run_with_buffers(TierDriver& driver, std::size_t buffer_bytes, std::size_t n,
                        const Pieces& pieces, Work work) {
  std::vector<double> pinning(n, 0.0);
  common::run_workers(n, [&](std::size_t k, const std::atomic<bool>& stop) {
    WorkerResources r(driver, buffer_bytes);
    pinning[k] = r.prepare(pieces[k].device);
    work(k, r, stop);
  });
  return pinning.empty() ? 0.0 : *std::max_element(pinning.begin(), pinning.end());
}

// Bytes [from, from + size) of piece `piece`: what one copy moves through one pinned buffer.
struct Slice {
  std::size_t piece = 0;
  std::size_t from = 0;
  std::size_t size = 0;
};

// A worker's pieces a slice at a time, each piece in slices of at most one buffer. The buffers'
// size is a setting of its own (docs/memory-tier.md, "Measured: workers, buffers and pinning"),
// not the pieces': a piece of any size, as a prefill reads them from an artifact, goes through them
// and never past them.
class Slices {
 public:
  Slices(const std::vector<FilePiece>& pieces, std::size_t slice_bytes)
      : pieces_(pieces), slice_(slice_bytes), piece_(pieces.size()) {}

  // The next slice; none once `take_piece()` gives no more pieces (an index past the last).
  template <typename TakePiece>
  std::optional<Slice> next(TakePiece take_piece) {
    while (piece_ >= pieces_.size() || done_ == pieces_[piece_].size) {
      piece_ = take_piece();
      done_ = 0;
      if (piece_ >= pieces_.size()) return std::nullopt;
    }
    const Slice s{piece_, done_, std::min(slice_, pieces_[piece_].size - done_)};
    done_ += s.size;
    return s;
  }

 private:
  const std::vector<FilePiece>& pieces_;
  std::size_t slice_;
  std::size_t piece_;  // the piece being sliced; pieces_.size() before the first
  std::size_t done_ = 0;
};

void write_all(int fd, const std::filesystem::path& path, const void* data, std::size_t size,
               std::uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw file_error("cannot write", path, errno);
    if (n == 0) throw file_error("cannot write", path, ENOSPC);
    p += n;
    size -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

void read_all(int fd, const std::filesystem::path& path, void* data, std::size_t size,
              std::uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw file_error("cannot read", path, errno);
    if (n == 0) {
      throw Error(ErrorKind::kBadArtifact,
                  "memory tier: " + path.string() + " ends at byte " + std::to_string(offset) +
                      ", before the contents the drain wrote there",
                  "the artifact is damaged: run `gpusnap verify` on it, or capture it again");
    }
    p += n;
    size -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void log_line(const char* what, const TransferReport& r) {
  std::fprintf(stderr,
               "gpusnap-tier: %s %zu bytes, %zu pieces, %zu files in %.3f s (%.1f GB/s; pinned "
               "buffers %.3f s, %s %.3f s, stacks %.3f s; %zu bytes read in place)\n",
               what, r.bytes, r.pieces, r.files, r.seconds,
               r.seconds > 0 ? static_cast<double>(r.bytes) / r.seconds / 1e9 : 0.0,
               r.buffer_seconds, std::strcmp(what, "drained") == 0 ? "release" : "map",
               r.map_seconds, r.stack_seconds, r.in_place_bytes);
}

}  // namespace

std::vector<Tier::Piece> Tier::live_pieces() const {
  // Runs of adjacent live blocks in one segment, cut at the piece size, in address order. A
  // block of kAloneBytes or more (a tensor of a megabyte or more) is a run of its own: the
  // store cuts its chunks at the pieces' starts (store/chunker.h), so a tensor that starts a
  // piece is stored as the same chunks whatever its neighbours, and a second capture that
  // allocated the same tensors in another order adds nothing for it. Merged with a neighbour,
  // its bytes would sit at an offset that depends on the allocation order (30 % of a capture
  // new again in StoreRegistry.ASecondCaptureOfTheSameTierInAnotherOrder..., 1-10 MiB tensors).
  // Only small blocks are merged: a piece each would cost more in copies than they weigh.
  constexpr std::size_t kAloneBytes = std::size_t{1} << 20;
  std::vector<Piece> pieces;
  const std::size_t max = settings_.piece_bytes;
  auto emit = [&](DevicePtr start, std::size_t size, int device) {
    for (std::size_t done = 0; done < size; done += max) {
      pieces.push_back({start + done, std::min(max, size - done), device, 0, 0});
    }
  };
  DevicePtr run_start = 0;
  std::size_t run_size = 0;
  DevicePtr run_segment = 0;
  int run_device = 0;
  bool run_alone = false;
  for (const auto& [addr, b] : blocks_) {
    const bool alone = b.size >= kAloneBytes;
    if (b.allocated && run_size > 0 && !alone && !run_alone && b.segment == run_segment &&
        addr == run_start + run_size) {
      run_size += b.size;
      continue;
    }
    if (run_size > 0) emit(run_start, run_size, run_device);
    run_size = 0;
    if (b.allocated) {
      run_start = addr;
      run_size = b.size;
      run_segment = b.segment;
      run_device = segments_.at(b.segment).device;
      run_alone = alone;
    }
  }
  if (run_size > 0) emit(run_start, run_size, run_device);
  return pieces;
}

TransferReport Tier::drain(const std::filesystem::path& dir) {
  std::lock_guard lock(mu_);
  if (state_ != TierState::kServing) {
    throw Error(ErrorKind::kInternal,
                "the memory tier is already drained into " + drained_dir_.string(),
                "resume the workload before the next capture");
  }
  const auto t0 = Clock::now();
  const DeviceScope scope(driver_, device_uuids_);
  // Nothing queued may still write a block while it is copied; then the cached free segments go
  // back to the driver: nobody holds an address in them, and they need not be saved.
  synchronize_devices();
  trim_locked();
  std::vector<Piece> pieces = live_pieces();
  std::vector<std::string> files;
  TransferReport report;
  try {
    report.buffer_seconds = run_drain_workers(pieces, dir, files);
    for (const Piece& p : pieces) report.bytes += p.size;
    write_layout_file(dir, pieces, files.size());
    write_index(dir, files, pieces, report.bytes);
  } catch (...) {
    std::error_code ec;
    for (const auto& f : files) std::filesystem::remove(dir / f, ec);
    std::filesystem::remove(layout_path(dir), ec);
    std::filesystem::remove(dir / folder::index_name(pid_), ec);
    throw;
  }
  files_ = files;
  pieces_ = pieces;
  drained_dir_ = dir;

  // Only now, with every byte in a closed file, is the physical memory released.
  std::vector<DevicePtr> released;
  const auto release_started = Clock::now();
  try {
    for (auto& [va, s] : segments_) {
      unmap_segment(s);
      released.push_back(va);
    }
  } catch (const Error& e) {
    // Put back what was released, from the files just written, and keep serving.
    try {
      TransferReport ignored;
      refill(released, dir, ignored);
    } catch (const Error& again) {
      // Some memory is only in the files now: stay drained, so that a fill can retry.
      state_ = TierState::kReleased;
      throw Error(ErrorKind::kGpu,
                  std::string("memory tier: releasing GPU memory failed (") + e.what() +
                      "), and mapping back what was released failed too (" + again.what() + ")",
                  "the contents are in " + dir.string() + ": resume the workload to fill them");
    }
    std::error_code ec;
    for (const auto& f : files) std::filesystem::remove(dir / f, ec);
    std::filesystem::remove(layout_path(dir), ec);
    std::filesystem::remove(dir / folder::index_name(pid_), ec);
    throw Error(e.kind(), std::string("memory tier: releasing GPU memory failed: ") + e.what(),
                "the workload keeps its memory and serves; see the driver's error");
  }
  state_ = TierState::kReleased;
  report.map_seconds = seconds_since(release_started);
  const auto stacks_started = Clock::now();
  free_stacks();
  report.stack_seconds = seconds_since(stacks_started);
  report.pieces = pieces.size();
  report.files = files.size();
  report.seconds = seconds_since(t0);
  if (settings_.log) log_line("drained", report);
  return report;
}

double Tier::run_drain_workers(std::vector<Piece>& pieces, const std::filesystem::path& dir,
                               std::vector<std::string>& files) {
  const std::size_t n =
      std::min(pieces.size(), static_cast<std::size_t>(std::max(1, settings_.streams)));
  // The files are created here, one by one, so that the caller knows every name to remove on
  // failure. O_EXCL: a file already there is somebody else's.
  std::vector<common::UniqueFd> fds;
  for (std::size_t k = 0; k < n; ++k) {
    std::string name = folder::drain_file_name(pid_, k);
    const auto path = dir / name;
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) throw file_error("cannot create", path, errno);
    files.push_back(std::move(name));
    fds.emplace_back(fd);
  }
  std::atomic<std::size_t> next{0};
  const double pinning = run_with_buffers(
      driver_, settings_.buffer_bytes, n, pieces,
      [&](std::size_t k, WorkerResources& r, const std::atomic<bool>& stop) {
        const auto path = dir / files[k];
        std::uint64_t offset = 0;
        Slices slices(pieces, r.buffer_bytes());
        std::optional<Slice> prev;
        int b = 0;
        for (;;) {
          const std::optional<Slice> s =
              slices.next([&] { return stop ? pieces.size() : next.fetch_add(1); });
          Stream stream = nullptr;
          if (s) {
            const Piece& p = pieces[s->piece];
            stream = r.on(p.device);
            driver_.copy_to_host(r.buffer(b), p.va + s->from, s->size, stream);
          }
          // While the copy engine fills one buffer, the other goes to the file. A piece's slices
          // follow each other in its worker's file.
          if (prev) {
            write_all(fds[k].get(), path, r.buffer(1 - b), prev->size, offset);
            if (prev->from == 0) {
              pieces[prev->piece].file = k;
              pieces[prev->piece].offset = offset;
            }
            offset += prev->size;
          }
          if (!s) break;
          driver_.stream_synchronize(stream);
          prev = s;
          b = 1 - b;
        }
      });
  for (std::size_t k = 0; k < n; ++k) {
    // Still the file at that path? gpusnap removes a staging directory it gave up on; the
    // memory must not be released into files nobody can find again.
    struct stat open_file {};
    struct stat by_path {};
    const auto path = dir / files[k];
    if (::fstat(fds[k].get(), &open_file) != 0 || ::stat(path.c_str(), &by_path) != 0 ||
        open_file.st_dev != by_path.st_dev || open_file.st_ino != by_path.st_ino) {
      throw Error(ErrorKind::kInternal,
                  "memory tier: " + path.string() + " was removed while it was written",
                  "gpusnap gave up on this capture; nothing was released");
    }
    if (const int err = fds[k].close_checked(); err != 0)
      throw file_error("cannot write", path, err);
  }
  return pinning;
}

std::filesystem::path Tier::layout_path(const std::filesystem::path& dir) const {
  return dir / folder::layout_name(pid_);
}

void Tier::write_layout_file(const std::filesystem::path& dir, const std::vector<Piece>& pieces,
                             std::size_t files) const {
  TierLayout layout;
  for (const auto& [va, s] : segments_) layout.segments.push_back({va, s.size, s.device});
  layout.pieces = pieces;
  layout.files = files;
  write_layout(layout_path(dir), layout);
}

void Tier::write_index(const std::filesystem::path& dir, const std::vector<std::string>& files,
                       const std::vector<Piece>& pieces, std::size_t bytes) const {
  // For gpusnap (src/engine/tier_files.h): what is in the folder and how much GPU memory it stands
  // for on each GPU, so that a restore can check free memory before it starts a copy.
  std::map<std::string, std::size_t> per_gpu;
  for (const Piece& p : pieces) {
    per_gpu[device_uuids_.at(p.device)] += p.size;
  }
  folder::TierIndex index;
  index.pid = static_cast<std::uint64_t>(pid_);
  index.bytes = bytes;
  // By name, as every drain listed them.
  std::set<std::string> names(files.begin(), files.end());
  for (const auto& f : names) {
    std::error_code ec;
    const std::uintmax_t size = std::filesystem::file_size(dir / f, ec);
    if (ec) throw file_error("cannot stat", dir / f, ec.value());
    index.files.push_back({f, size});
  }
  for (const auto& [uuid, n] : per_gpu) index.gpus.push_back({uuid, n});
  folder::write_index(dir, index);
}

TransferReport Tier::fill(const std::filesystem::path& dir,
                          const std::map<std::string, std::string>& gpu_map) {
  std::lock_guard lock(mu_);
  if (state_ == TierState::kServing) return {};
  const auto t0 = Clock::now();
  const DeviceScope scope(driver_, device_uuids_);
  const auto from = dir.empty() ? drained_dir_ : dir;
  check_gpu_map(gpu_map);
  TransferReport report;
  const auto stacks_started = Clock::now();
  restore_stacks();  // before anything is mapped: on failure the tier stays drained as it was
  report.stack_seconds = seconds_since(stacks_started);
  std::vector<DevicePtr> todo;
  for (const auto& [va, s] : segments_) {
    if (!s.mapped) todo.push_back(va);
  }
  refill(todo, from, report);
  // The next capture records the GPUs the memory is on now.
  for (auto& [device, uuid] : device_uuids_) {
    if (auto m = gpu_map.find(uuid); m != gpu_map.end()) uuid = m->second;
  }
  state_ = TierState::kServing;
  for (const Piece& p : pieces_) report.bytes += p.size;
  report.pieces = pieces_.size();
  report.files = files_.size();
  report.seconds = seconds_since(t0);
  if (settings_.log) log_line("filled", report);
  return report;
}

void Tier::check_gpu_map(const std::map<std::string, std::string>& gpu_map) {
  for (const auto& [device, recorded] : device_uuids_) {
    const auto m = gpu_map.find(recorded);
    const std::string& expected = m != gpu_map.end() ? m->second : recorded;
    const std::string now = driver_.device_uuid(device);
    if (now != expected) {
      std::string what = "memory tier: device " + std::to_string(device) + " is " + now;
      what += ", but its memory was captured on " + recorded;
      if (m != gpu_map.end()) what += " and mapped to " + expected;
      throw Error(ErrorKind::kIncompatible, what,
                  "restore with a --gpu-map that sends " + recorded +
                      " to the GPU the copy sees as device " + std::to_string(device));
    }
  }
}

// The driver keeps local memory for every thread the GPU can hold at once times the stack size
// (1 KiB by default, more once a kernel needed more: 264 MiB on the H200 at 1 KiB), and its
// checkpoint saves and restores it like any memory: a third of what it carries beside a drained
// tier. While drained nothing runs, so the stack can be 0; a kernel launched then still gets
// what it needs (the driver grows the stack at a launch), but a CUDA graph's replay does not,
// which is why the fill puts the size back before anything else.
void Tier::free_stacks() {
  for (const auto& [device, uuid] : device_uuids_) {
    try {
      const std::size_t bytes = driver_.stack_limit(device);
      driver_.set_stack_limit(device, 0);
      stacks_[device] = bytes;
    } catch (const Error& e) {
      // Only a smaller checkpoint is lost: the memory stays and the capture carries it.
      if (settings_.log) {
        std::fprintf(stderr, "gpusnap-tier: device %d keeps its stack: %s\n", device, e.what());
      }
    }
  }
}

void Tier::restore_stacks() {
  for (auto it = stacks_.begin(); it != stacks_.end(); it = stacks_.erase(it)) {
    const auto [device, bytes] = *it;
    std::string why;
    try {
      driver_.set_stack_limit(device, bytes);
      const std::size_t now = driver_.stack_limit(device);
      if (now < bytes) why = "the driver set " + std::to_string(now) + " bytes";
    } catch (const Error& e) {
      why = e.what();
    }
    if (!why.empty()) {
      throw Error(ErrorKind::kGpu,
                  "memory tier: putting back the " + std::to_string(bytes) +
                      "-byte stack of the GPU threads on device " + std::to_string(device) +
                      " failed: " + why,
                  "the workload stays paused and its memory in the files; see the driver's error "
                  "and resume again");
    }
  }
}

void Tier::refill(const std::vector<DevicePtr>& todo, const std::filesystem::path& dir,
                  TransferReport& report) {
  std::vector<DevicePtr> mapped;
  try {
    const auto map_started = Clock::now();
    for (DevicePtr va : todo) {
      map_segment(segments_.at(va));
      mapped.push_back(va);
    }
    report.map_seconds = seconds_since(map_started);
    const std::set<DevicePtr> wanted(todo.begin(), todo.end());
    std::vector<Piece> pieces;
    for (const Piece& p : pieces_) {
      if (wanted.count(std::prev(segments_.upper_bound(p.va))->first) != 0) pieces.push_back(p);
    }
    run_fill_workers(pieces, dir, report);
  } catch (...) {
    // A copy must never serve with memory it did not fill: give back what this fill mapped.
    for (DevicePtr va : mapped) {
      try {
        unmap_segment(segments_.at(va));
      } catch (...) {  // NOLINT(bugprone-empty-catch): the fill's own failure is reported
      }
    }
    throw;
  }
}

std::size_t Tier::adopt(const std::filesystem::path& socket, std::chrono::milliseconds timeout) {
  std::lock_guard lock(mu_);
  if (state_ == TierState::kServing) return 0;
  std::vector<DevicePtr> todo;
  for (const auto& [va, s] : segments_) {
    if (!s.mapped) todo.push_back(va);
  }
  const common::UniqueFd conn = connect_for_handover(socket, timeout);
  std::vector<OfferedSegment> offer = receive_offer(conn.get(), todo.size());
  // The offer must be these segments exactly: the prefill read the layout this tier wrote.
  if (offer.size() != todo.size()) {
    send_answer(conn.get(), false);
    throw Error(ErrorKind::kInternal,
                "memory tier: the prefill offers " + std::to_string(offer.size()) +
                    " segments, the tier has " + std::to_string(todo.size()) + " to fill");
  }
  const DeviceScope scope(driver_, device_uuids_);
  std::vector<DevicePtr> adopted;
  std::size_t bytes = 0;
  try {
    for (std::size_t i = 0; i < offer.size(); ++i) {
      Segment& s = segments_.at(todo[i]);
      if (offer[i].va != s.va || offer[i].size != s.size) {
        throw Error(ErrorKind::kInternal,
                    "memory tier: the prefill offers another segment at " + std::to_string(i));
      }
      map_handle(s, driver_.import_fd(offer[i].fd.get()), [&](Handle h) {
        // Memory on another GPU would be reached across the bus: not what the copy runs on.
        if (const int on = driver_.handle_device(h); on != s.device) {
          throw Error(ErrorKind::kInternal, "memory tier: the prefill's memory is on device " +
                                                std::to_string(on) + ", the segment's on " +
                                                std::to_string(s.device));
        }
      });
      adopted.push_back(s.va);
      bytes += s.size;
    }
  } catch (...) {
    for (DevicePtr va : adopted) {
      try {
        unmap_segment(segments_.at(va));
      } catch (...) {  // NOLINT(bugprone-empty-catch): the adoption's own failure is reported
      }
    }
    send_answer(conn.get(), false);
    throw;
  }
  send_answer(conn.get(), true);
  if (settings_.log) {
    std::fprintf(stderr, "gpusnap-tier: adopted %zu bytes in %zu segments from %s\n", bytes,
                 adopted.size(), socket.c_str());
  }
  return bytes;
}

namespace {

// Reads slice `s` of piece `p` into `buffer`; with a read hook, at most kReadSlice at a time,
// each given to the hook as soon as it is read (still in the cache: a prefill checksums it there).
void read_slice(int fd, const std::filesystem::path& path, const FilePiece& p, const Slice& s,
                void* buffer, const FillHooks& hooks) {
  const std::uint64_t offset = p.offset + s.from;
  if (!hooks.read && !hooks.before_read) {
    read_all(fd, path, buffer, s.size, offset);
    return;
  }
  auto* at = static_cast<unsigned char*>(buffer);
  for (std::size_t done = 0; done < s.size;) {
    const std::size_t n = std::min(FillHooks::kReadSlice, s.size - done);
    if (hooks.before_read) hooks.before_read(p.file, offset + done + n);
    read_all(fd, path, at + done, n, offset + done);
    if (hooks.read) hooks.read(s.piece, offset + done, at + done, n);
    done += n;
  }
}

// Slice `s` of piece `p` waited for (an arriving file) and its windows registered, then given
// to the read hook from the mapping (a prefill checksums it there): the copy reads it in place.
// An empty Hold when the driver refused the registration: the caller reads the slice through its
// buffer instead, hooks and all.
InPlaceFiles::Hold see_in_place(InPlaceFiles& files, const FilePiece& p, const Slice& s,
                                const FillHooks& hooks) {
  const std::uint64_t offset = p.offset + s.from;
  if (hooks.before_read) {
    // Every byte of the windows, not only the slice's: a registered page is the page as it is
    // now, and a pull that resumes a staging directory clears a range (a hole punched) before it
    // writes it, which would leave the registration holding the page it replaced.
    hooks.before_read(p.file, files.window_end(p.file, offset + s.size));
  }
  InPlaceFiles::Hold hold = files.hold(p.file, offset, s.size);
  if (hold && hooks.read) {
    for (std::size_t done = 0; done < s.size;) {
      const std::size_t n = std::min(FillHooks::kReadSlice, s.size - done);
      hooks.read(s.piece, offset + done, files.at(p.file, offset + done), n);
      done += n;
    }
  }
  return hold;
}

// The copy a fill's worker issued last, waited for before the memory it reads is reused or let
// go, and on the way out of a failed fill before anything is released.
class InFlight {
 public:
  explicit InFlight(TierDriver& driver) : driver_(driver) {}
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  ~InFlight() {
    try {
      wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the fill's own failure is reported
    }
  }
  void issued(Stream stream) { stream_ = stream; }
  void wait() {
    if (stream_ == nullptr) return;
    Stream s = std::exchange(stream_, nullptr);
    driver_.stream_synchronize(s);
  }

 private:
  TierDriver& driver_;
  Stream stream_ = nullptr;
};

// Which piece a fill's worker copies next: the next of all (every worker takes from one counter),
// or the next of the files given to that worker alone (FillHooks::one_worker_per_file).
class PieceQueue {
 public:
  PieceQueue(const std::vector<FilePiece>& pieces, std::size_t workers, bool by_file)
      : size_(pieces.size()) {
    if (!by_file) return;
    own_.resize(workers);
    for (std::size_t i = 0; i < pieces.size(); ++i) own_[pieces[i].file % workers].push_back(i);
    taken_.assign(workers, 0);
  }
  // The index of worker k's next piece; size() when there is none left.
  std::size_t next(std::size_t k) {
    if (own_.empty()) return next_.fetch_add(1);
    return taken_[k] < own_[k].size() ? own_[k][taken_[k]++] : size_;
  }

 private:
  std::size_t size_;
  std::atomic<std::size_t> next_{0};
  std::vector<std::vector<std::size_t>> own_;  // by worker, when by file
  std::vector<std::size_t> taken_;             // each touched by its own worker only
};

}  // namespace

void fill_from_files(TierDriver& driver, const TierSettings& settings,
                     const std::filesystem::path& dir, const std::vector<std::string>& files,
                     const std::vector<FilePiece>& pieces, TransferReport& report,
                     const FillHooks& hooks) {
  std::vector<common::UniqueFd> fds;
  std::vector<std::filesystem::path> paths;
  for (const auto& name : files) {
    paths.push_back(dir / name);
    const int fd = ::open(paths.back().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw file_error("cannot open", paths.back(), errno);
    fds.emplace_back(fd);
  }
  std::optional<InPlaceFiles> in_place;
  if (settings.in_place.value_or(static_cast<bool>(hooks.before_read))) {
    in_place.emplace(driver, paths, fds);
  }
  std::atomic<std::size_t> in_place_bytes{0};
  const std::size_t n =
      std::min(pieces.size(), static_cast<std::size_t>(std::max(1, settings.streams)));
  PieceQueue queue(pieces, n, hooks.one_worker_per_file);
  report.buffer_seconds = run_with_buffers(
      driver, settings.buffer_bytes, n, pieces,
      [&](std::size_t k, WorkerResources& r, const std::atomic<bool>& stop) {
        InPlaceFiles::Hold held;     // the windows the copy in flight reads, if it reads in place
        InFlight in_flight(driver);  // before `held` goes: a window outlives its copy
        Slices slices(pieces, r.buffer_bytes());
        int b = 0;
        for (;;) {
          const std::optional<Slice> s =
              slices.next([&] { return stop ? pieces.size() : queue.next(k); });
          const FilePiece* p = s ? &pieces[s->piece] : nullptr;
          // While the copy engine moves the previous slice, this one is read from the file or
          // its window of the file registered.
          Stream stream = nullptr;
          InPlaceFiles::Hold hold;
          if (p != nullptr) {
            stream = r.on(p->device);  // a context first: pinned memory is allocated in one
            if (p->file >= fds.size()) {
              throw Error(ErrorKind::kBadArtifact,
                          "memory tier: a piece names file " + std::to_string(p->file) + " of " +
                              std::to_string(fds.size()),
                          "the artifact is damaged: capture it again");
            }
            if (in_place) hold = see_in_place(*in_place, *p, *s, hooks);
            if (!hold) read_slice(fds[p->file].get(), paths[p->file], *p, *s, r.buffer(b), hooks);
          }
          in_flight.wait();
          held.reset();  // its copy is done
          if (p == nullptr) break;
          if (s->from == 0 && hooks.before_copy) hooks.before_copy(s->piece);
          // Told first: a copy that fails half-issued is waited for before its memory goes.
          in_flight.issued(stream);
          if (hold) {
            held = std::move(hold);
            const std::uint64_t offset = p->offset + s->from;
            for (const auto& [at, size] : InPlaceFiles::split(offset, s->size)) {
              driver.copy_to_device(p->va + s->from + (at - offset), in_place->at(p->file, at),
                                    size, stream);
            }
            in_place_bytes += s->size;
          } else {
            driver.copy_to_device(p->va + s->from, r.buffer(b), s->size, stream);
            b = 1 - b;
          }
        }
      });
  // Each worker waited for its own last copy; nothing of the fill is in flight.
  report.in_place_bytes = in_place_bytes;
}

void Tier::run_fill_workers(const std::vector<Piece>& pieces, const std::filesystem::path& dir,
                            TransferReport& report) {
  fill_from_files(driver_, settings_, dir, files_, pieces, report);
}

}  // namespace gpusnap::tier
