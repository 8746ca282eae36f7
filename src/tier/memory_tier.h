// The memory tier (docs/memory-tier.md): a caching allocator on the driver's
// virtual memory management that can move every live byte it handed out into files (drain) and
// back to the same addresses (fill), at the speed of pinned copies on several streams.
//
// One Tier owns, for its whole life, the address reservations and physical memory of its
// segments; the workload owns the blocks it was given until it frees them. A drain writes the
// live blocks into files and only then releases the physical memory, keeping every reservation;
// a fill creates and maps physical memory at the same addresses again and reads the files back.
//
// Thread-safety: every public method takes one internal mutex; allocate() and free() may be
// called from any thread (PyTorch calls them from the threads that create and drop tensors).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tier/layout.h"
#include "tier/tier_driver.h"

namespace gpusnap::tier {

struct TierSettings {
  // Many workers with small buffers: on the H200 (16 GiB, docs/benchmarks.md) 16 x 4 MiB filled
  // in 0.38 s (45.7 GB/s) where 8 x 32 MiB took 1.09 s; pinning the buffers is a fixed cost per
  // drain and fill that grows with their total, and several workers keep the copy engine busy
  // while others read or write their files.
  int streams = 16;  // drain and fill workers, one stream each
  // Each of a worker's two pinned buffers: the most one copy moves. Smaller was slower on the
  // H200 at every size tried below 1 MiB (docs/memory-tier.md, "Measured: workers, buffers and
  // pinning").
  std::size_t buffer_bytes = std::size_t{4} << 20;
  // The drain cuts live memory into pieces of at most this: the unit a worker takes, moved a
  // buffer at a time. A layout's pieces may be of any size; a fill takes them as they are.
  std::size_t piece_bytes = std::size_t{4} << 20;
  bool log = false;  // one line per drain and fill on stderr
  // Whether a fill copies each slice straight from its file's pages, registered for the copy,
  // instead of through a pinned buffer (tier/in_place.h): one copy of every byte less, but the
  // driver's registration caps the fill at 12.5-13.0 GB/s on the H100 against 22-26 GB/s through
  // the buffers (docs/memory-tier.md, "Read in place"). Unset: in place only where the files
  // still arrive (FillHooks::before_read: a prefill of an artifact a pull still writes), where
  // the bytes come slower than that and the CPU is busy with them.
  std::optional<bool> in_place;

  // GPUSNAP_TIER_STREAMS, GPUSNAP_TIER_BUFFER_KIB, GPUSNAP_TIER_LOG, GPUSNAP_TIER_IN_PLACE;
  // out-of-range values keep the default.
  static TierSettings from_environment();
};

enum class TierState {
  kServing,   // physical memory mapped; allocate() works
  kReleased,  // drained: contents in files, physical memory released, reservations kept
};

struct TierStats {
  std::size_t segments = 0;
  std::size_t reserved_bytes = 0;  // address space of all segments
  std::size_t live_bytes = 0;      // blocks handed out and not freed (graph blocks included)
  std::size_t cached_bytes = 0;    // free blocks any allocation may reuse
  // Blocks of graph captures' pools, live or free: only their capture reuses them (Tier::free).
  std::size_t graph_bytes = 0;
};

struct TransferReport {
  std::size_t bytes = 0;
  std::size_t pieces = 0;
  std::size_t files = 0;
  double seconds = 0;
  // Where the time went, for the log line and the benchmarks: the slowest worker's allocation
  // of its pinned buffers; creating and mapping (fill) or releasing (drain) physical memory.
  double buffer_seconds = 0;
  double map_seconds = 0;
  // Setting the devices' stack sizes: to 0 after a drain, back before a fill.
  double stack_seconds = 0;
  // A fill's bytes copied straight from its files' pages (TierSettings::in_place).
  std::size_t in_place_bytes = 0;
};

// What a prefill (tier/prefill.h) adds to a fill from files; the copy's own fill needs none.
struct FillHooks {
  // Called on a worker with piece i's bytes as they are read, a slice of at most kReadSlice at a
  // time (`offset` in its file), while the slice is still in the core's cache; before its copy.
  static constexpr std::size_t kReadSlice = std::size_t{1} << 20;
  std::function<void(std::size_t i, std::uint64_t offset, const void* data, std::size_t size)> read;
  // Called on a worker once piece i is read and before it is copied: a prefill waits there for
  // the piece's memory to be mapped. What it throws fails the fill.
  std::function<void(std::size_t i)> before_copy;
  // Called on a worker before it reads bytes of file `file` up to `end` (exclusive), at most
  // kReadSlice at a time through the buffers, a window's worth at a time in place
  // (tier/in_place.h): a prefill of an artifact still arriving waits there for those bytes
  // (tier/arrival.h). What it throws fails the fill.
  std::function<void(std::size_t file, std::uint64_t end)> before_read;
  // Each file's pieces go to one worker, in the order they are given, instead of every worker
  // taking the next piece: `read` then sees each file's pieces in that order.
  bool one_worker_per_file = false;
};

// Copies `pieces` from a drain's files in `dir` (files[piece.file]) to device memory already
// mapped at the pieces' addresses, on up to settings.streams workers with two pinned buffers
// each, and waits for every copy; in place (TierSettings::in_place), each slice straight from the
// file's pages where the driver registers them (tier/in_place.h), through the buffers where it
// does not.
// Sets report.buffer_seconds (the slowest worker's time to pin its buffers) and
// report.in_place_bytes. Used by Tier::fill and by a prefill (tier/prefill.h).
void fill_from_files(TierDriver& driver, const TierSettings& settings,
                     const std::filesystem::path& dir, const std::vector<std::string>& files,
                     const std::vector<FilePiece>& pieces, TransferReport& report,
                     const FillHooks& hooks = {});

class Tier {
 public:
  // `pid` names the files (PID-wK.img, PID.json): several processes may drain into one folder.
  Tier(TierDriver& driver, TierSettings settings, pid_t pid);
  // Returns every segment to the driver (unmaps, releases, frees the reservations). The library's
  // own instance is never destroyed: at process exit the driver may already be torn down.
  ~Tier();
  Tier(const Tier&) = delete;
  Tier& operator=(const Tier&) = delete;

  // A block of at least `size` bytes on `device`, for use on `stream`; nullptr for size 0.
  // Throws Error(kGpu) when the device is out of memory after the cache was trimmed, and
  // Error(kInternal) while drained (a paused workload must not allocate).
  void* allocate(std::size_t size, int device, Stream stream);
  // Returns a block. A block allocated during a graph capture goes back to that capture's pool
  // while the capture goes on, and stays live once it has ended: the graph replays into it.
  // Throws Error(kInternal) for a pointer the tier did not hand out.
  void free(void* ptr);

  // Writes every live block into `dir` (which must exist), then releases the physical memory.
  // On failure the files it made are removed, nothing is released, the tier keeps serving and
  // the Error says why. Throws Error(kInternal) unless serving. Once released, it also sets the
  // stack size of each device the tier uses to 0 (264 MiB of the ~760 MiB the driver's
  // checkpoint carries beside the tier on the H200), remembering the size to put back; where
  // the driver refuses, that device keeps its stack and the drain stands.
  TransferReport drain(const std::filesystem::path& dir);
  // Maps physical memory at every segment's address again and fills it from `dir` (empty: the
  // folder of the last drain). `gpu_map` maps the GPU UUIDs recorded at allocation to those the
  // same device ordinals must have now (absent: unchanged). First it puts back the stack sizes
  // the drain set to 0: a graph replayed with a smaller stack than its kernels need fails. On
  // failure what it mapped is released again and the tier stays drained, so that a later fill
  // may retry. Nothing to do (returns an empty report) while serving.
  TransferReport fill(const std::filesystem::path& dir,
                      const std::map<std::string, std::string>& gpu_map);

  // Takes over the physical memory a gpusnap-tier-prefill made and filled for this process
  // (tier/prefill.h), offered on the Unix socket `socket`: maps it at every segment's address.
  // Afterwards fill() finds nothing left to copy and only returns the tier to serving. Returns
  // the bytes taken over; 0 while serving. Throws Error when the offer does not match the
  // segments or the memory is on another device than the segment's, or the socket fails or
  // says nothing within `timeout`; then nothing it took stays mapped, and fill() does it all.
  std::size_t adopt(const std::filesystem::path& socket, std::chrono::milliseconds timeout);

  TierState state() const;
  TierStats stats() const;
  // The pid the tier's files are named by.
  pid_t pid() const { return pid_; }
  // The folder of the last drain.
  std::filesystem::path drained_to() const;

 private:
  struct Segment {
    DevicePtr va = 0;
    std::size_t size = 0;
    int device = 0;
    Stream stream = nullptr;  // every block of a segment is used on this stream
    bool small = false;       // the pool of requests up to kSmallRequest
    Handle handle = 0;
    bool mapped = false;
  };
  // A graph capture's pool: kGeneral, or a number the tier gives each capture (pools_).
  using Pool = std::uint64_t;
  static constexpr Pool kGeneral = 0;
  struct Block {
    DevicePtr segment = 0;  // key of its Segment
    std::size_t size = 0;
    bool allocated = false;
    Pool pool = kGeneral;  // the capture it was allocated in; a free block keeps it
  };
  // Free blocks, best fit first: (pool, small?, device, stream, size, address).
  using FreeKey = std::tuple<Pool, bool, int, Stream, std::size_t, DevicePtr>;
  // A piece of live memory and where the drain put it (file: an index into files_).
  using Piece = FilePiece;

  DevicePtr allocate_locked(std::size_t size, int device, Stream stream);
  // The pool of the capture `stream` takes part in; kGeneral when it captures nothing.
  Pool pool_of(Stream stream);
  // The best-fitting free block of `pool` for a request; free_.end() when there is none.
  std::set<FreeKey>::iterator find_free(Pool pool, bool small, int device, Stream stream,
                                        std::size_t size);
  Segment& new_segment(std::size_t size, int device, Stream stream, bool small);
  // Unmaps, releases and frees every segment with no block in use; false if none. Needs no
  // stream work pending on them: the caller synchronises first.
  bool trim_locked();
  void destroy_segment(DevicePtr key) noexcept;
  void map_segment(Segment& s);
  // Maps `h` whole at the segment's address for its device, after `check(h)`; on any failure
  // (the check's too) releases `h` and leaves the segment unmapped.
  void map_handle(Segment& s, Handle h, const std::function<void(Handle)>& check);
  void unmap_segment(Segment& s);
  void insert_free(DevicePtr addr, const Block& b);
  void erase_free(DevicePtr addr, const Block& b);
  void synchronize_devices();
  std::vector<Piece> live_pieces() const;
  // The workers of a drain (to_files) or fill; the first error is rethrown after all finished.
  // Both return the slowest worker's time to allocate its pinned buffers.
  double run_drain_workers(std::vector<Piece>& pieces, const std::filesystem::path& dir,
                           std::vector<std::string>& files);
  void run_fill_workers(const std::vector<Piece>& pieces, const std::filesystem::path& dir,
                        TransferReport& report);
  void write_index(const std::filesystem::path& dir, const std::vector<std::string>& files,
                   const std::vector<Piece>& pieces, std::size_t bytes) const;
  // PID.layout beside the index (tier/layout.h).
  void write_layout_file(const std::filesystem::path& dir, const std::vector<Piece>& pieces,
                         std::size_t files) const;
  std::filesystem::path layout_path(const std::filesystem::path& dir) const;
  void check_gpu_map(const std::map<std::string, std::string>& gpu_map);
  // Sets each device's stack to 0, remembering its size in stacks_ (best effort: see drain()).
  void free_stacks();
  // Puts back what free_stacks() remembered; throws Error(kGpu) when the driver refuses or
  // answers less, keeping stacks_ for a retry.
  void restore_stacks();
  // Maps the listed segments and fills the pieces that fall in them; on failure unmaps what it
  // mapped and rethrows.
  // Adds its times to `report`.
  void refill(const std::vector<DevicePtr>& todo, const std::filesystem::path& dir,
              TransferReport& report);

  TierDriver& driver_;
  const TierSettings settings_;
  const pid_t pid_;
  mutable std::mutex mu_;
  TierState state_ = TierState::kServing;
  std::map<DevicePtr, Segment> segments_;
  std::map<DevicePtr, Block> blocks_;  // every block of every segment, by address
  std::set<FreeKey> free_;
  std::map<std::uint64_t, Pool> pools_;  // the driver's capture id -> its pool
  Pool next_pool_ = kGeneral + 1;
  std::map<int, std::string> device_uuids_;  // recorded at the device's first segment
  std::map<int, std::size_t> granularity_;
  std::map<int, std::size_t> stacks_;  // device -> the stack size the last drain set to 0
  // What the last drain wrote.
  std::filesystem::path drained_dir_;
  std::vector<std::string> files_;
  std::vector<Piece> pieces_;
};

}  // namespace gpusnap::tier
