// The tier's allocator: segments of VMM memory (an address reservation with one physical handle
// mapped over it), cut into blocks, and free blocks cached per device and stream, as PyTorch's
// own caching allocator does. A pluggable allocator replaces PyTorch's caching allocator whole,
// so without this cache every tensor would cost a cuMemCreate and a cuMemMap.
//
// Why blocks are kept per stream: a block freed on stream S may still be read by work queued on
// S; handing it out again for S is safe (stream order), for another stream it is not. PyTorch
// gives a pluggable allocator no record_stream, so this is the only safe rule without an event
// per block.
//
// Why each graph capture has a pool of its own: the graph replays into every block allocated
// while it was captured, also after PyTorch has freed the tensors. PyTorch's caching allocator
// keeps such blocks in the graph's private pool; a pluggable allocator is not told about those
// pools, so the tier makes one per capture from the driver's capture id. A block allocated and
// freed during the capture goes back to its pool, and later allocations of the same capture reuse
// it: the graph replays them in the order they were captured, so the memory a capture needs is
// its peak, not the sum of its temporaries. Nothing outside the capture ever gets such a block,
// and once the capture has ended a freed block stays live, because the graph still replays into
// it. A block freed inside its capture holds nothing between replays (the graph writes it before
// it reads it), so a drain need not save it; its segment is never given back.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <set>
#include <string>

#include "gpusnap/error.h"
#include "tier/memory_tier.h"

namespace gpusnap::tier {
namespace {

// PyTorch rounds every request to 512 bytes too: alignment for any element type.
constexpr std::size_t kRound = 512;
// Requests up to this size share small segments (PyTorch's kSmallSize).
constexpr std::size_t kSmallRequest = std::size_t{1} << 20;
constexpr std::size_t kSmallSegment = std::size_t{2} << 20;
// Requests up to this size share medium segments (PyTorch's kMinLargeAlloc and kLargeBuffer).
constexpr std::size_t kMediumRequest = std::size_t{10} << 20;
constexpr std::size_t kMediumSegment = std::size_t{20} << 20;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

std::string hex(DevicePtr p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIx64, p);
  return buf;
}

std::string mib(std::size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

// A positive integer from the environment, or `fallback` when unset or out of [1, max].
long env_int(const char* name, long fallback, long max) {
  const char* text = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read once, at load
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (*end != '\0' || v < 1 || v > max) return fallback;
  return v;
}

}  // namespace

TierSettings TierSettings::from_environment() {
  TierSettings s;
  s.streams = static_cast<int>(env_int("GPUSNAP_TIER_STREAMS", s.streams, 64));
  const long kib =
      env_int("GPUSNAP_TIER_BUFFER_KIB", static_cast<long>(s.buffer_bytes >> 10), long{1} << 20);
  // Below 64 KiB each copy's fixed cost would dominate (on the H200 already below 1 MiB:
  // docs/benchmarks.md).
  s.buffer_bytes = static_cast<std::size_t>(std::max(kib, 64L)) << 10;
  const char* log = std::getenv("GPUSNAP_TIER_LOG");  // NOLINT(concurrency-mt-unsafe): at load
  s.log = log != nullptr && std::string(log) == "1";
  const char* in_place = std::getenv("GPUSNAP_TIER_IN_PLACE");  // NOLINT(concurrency-mt-unsafe)
  const std::string chosen = in_place != nullptr ? in_place : "";
  if (chosen == "0" || chosen == "1") s.in_place = chosen == "1";
  return s;
}

Tier::Tier(TierDriver& driver, TierSettings settings, pid_t pid)
    : driver_(driver), settings_(settings), pid_(pid) {}

Tier::~Tier() {
  std::lock_guard lock(mu_);
  while (!segments_.empty()) destroy_segment(segments_.begin()->first);
}

TierState Tier::state() const {
  std::lock_guard lock(mu_);
  return state_;
}

std::filesystem::path Tier::drained_to() const {
  std::lock_guard lock(mu_);
  return drained_dir_;
}

TierStats Tier::stats() const {
  std::lock_guard lock(mu_);
  TierStats s;
  s.segments = segments_.size();
  for (const auto& [va, seg] : segments_) s.reserved_bytes += seg.size;
  for (const auto& [addr, b] : blocks_) {
    if (b.allocated) s.live_bytes += b.size;
    if (b.pool != kGeneral) s.graph_bytes += b.size;
    if (!b.allocated && b.pool == kGeneral) s.cached_bytes += b.size;
  }
  return s;
}

void* Tier::allocate(std::size_t size, int device, Stream stream) {
  std::lock_guard lock(mu_);
  if (state_ != TierState::kServing) {
    throw Error(ErrorKind::kInternal,
                "the memory tier is drained: no GPU memory until the workload is resumed",
                "allocate nothing between the pause and the resume");
  }
  if (size == 0) return nullptr;
  // A thread that never made a CUDA runtime call of its own (a serving thread whose first use
  // of the GPU is a tensor) has no context current, and the driver refuses the capture query
  // and the memory calls there: the device's primary context is entered for the allocation.
  const EnteredDevice entered(driver_, device);
  // NOLINTNEXTLINE(performance-no-int-to-ptr): a device address is what the caller gets
  return reinterpret_cast<void*>(allocate_locked(size, device, stream));
}

DevicePtr Tier::allocate_locked(std::size_t size, int device, Stream stream) {
  const std::size_t rounded = round_up(size, kRound);
  const bool small = rounded <= kSmallRequest;
  const Pool pool = pool_of(stream);
  // A capture first reuses what it freed itself, then takes from the general cache.
  auto it = find_free(pool, small, device, stream, rounded);
  if (it == free_.end() && pool != kGeneral)
    it = find_free(kGeneral, small, device, stream, rounded);
  if (it == free_.end()) {
    std::size_t want = small ? kSmallSegment : rounded <= kMediumRequest ? kMediumSegment : rounded;
    Segment& s = new_segment(want, device, stream, small);
    Block b{s.va, s.size, false, kGeneral};
    blocks_[s.va] = b;
    insert_free(s.va, b);
    it = free_.find({kGeneral, small, device, stream, s.size, s.va});
  }
  const DevicePtr addr = std::get<5>(*it);
  Block& b = blocks_.at(addr);
  erase_free(addr, b);
  // Split off the rest when it is worth a block of its own: in the large pool only above
  // kSmallRequest, so that large segments are not worn down into small pieces. The rest stays
  // in the pool it was in.
  const std::size_t rest = b.size - rounded;
  if (rest >= (small ? kRound : kSmallRequest + 1)) {
    Block tail{b.segment, rest, false, b.pool};
    blocks_[addr + rounded] = tail;
    insert_free(addr + rounded, tail);
    b.size = rounded;
  }
  b.allocated = true;
  b.pool = pool;
  return addr;
}

Tier::Pool Tier::pool_of(Stream stream) {
  const std::optional<std::uint64_t> capture = driver_.capture_id(stream);
  if (!capture) return kGeneral;
  auto [it, added] = pools_.try_emplace(*capture, next_pool_);
  if (added) ++next_pool_;
  return it->second;
}

std::set<Tier::FreeKey>::iterator Tier::find_free(Pool pool, bool small, int device, Stream stream,
                                                  std::size_t size) {
  auto it = free_.lower_bound({pool, small, device, stream, size, 0});
  if (it == free_.end() || std::get<0>(*it) != pool || std::get<1>(*it) != small ||
      std::get<2>(*it) != device || std::get<3>(*it) != stream) {
    return free_.end();
  }
  return it;
}

Tier::Segment& Tier::new_segment(std::size_t size, int device, Stream stream, bool small) {
  auto g = granularity_.find(device);
  if (g == granularity_.end()) g = granularity_.emplace(device, driver_.granularity(device)).first;
  size = round_up(size, g->second);
  if (device_uuids_.find(device) == device_uuids_.end()) {
    device_uuids_[device] = driver_.device_uuid(device);
  }
  Segment s;
  s.size = size;
  s.device = device;
  s.stream = stream;
  s.small = small;
  if (!driver_.create(device, size, &s.handle)) {
    // Out of memory: give the cached free segments back and try once more, as PyTorch does.
    // Not while a graph is being captured: synchronising would invalidate the capture.
    bool retried = false;
    if (!driver_.capture_id(stream)) {
      synchronize_devices();
      retried = trim_locked() && driver_.create(device, size, &s.handle);
    }
    if (!retried) {
      throw Error(ErrorKind::kGpu,
                  "out of GPU memory: the memory tier could not get " + mib(size) +
                      " more on device " + std::to_string(device),
                  "free tensors, or give the workload a GPU with more free memory");
    }
  }
  try {
    s.va = driver_.reserve(size, g->second);
  } catch (...) {
    try {
      driver_.release(s.handle);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the first failure is the one reported
    }
    throw;
  }
  try {
    driver_.map(s.va, size, s.handle);
    try {
      driver_.set_access(s.va, size, device);
    } catch (...) {
      driver_.unmap(s.va, size);
      throw;
    }
  } catch (...) {
    try {
      driver_.release(s.handle);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the first failure is the one reported
    }
    driver_.address_free(s.va, size);
    throw;
  }
  s.mapped = true;
  return segments_[s.va] = s;
}

void Tier::free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard lock(mu_);
  const auto addr = reinterpret_cast<DevicePtr>(ptr);
  auto it = blocks_.find(addr);
  if (it == blocks_.end() || !it->second.allocated) {
    throw Error(ErrorKind::kInternal,
                "the memory tier was asked to free " + hex(addr) + ", which it did not hand out",
                "free only what the tier allocated, once");
  }
  const Pool pool = it->second.pool;
  const Segment& seg = segments_.at(it->second.segment);
  // A graph's block is reused only within its capture; once that has ended it stays live, as
  // the graph writes into it on every replay.
  if (pool != kGeneral) {
    const EnteredDevice entered(driver_, seg.device);  // as in allocate()
    if (pool_of(seg.stream) != pool) return;
  }
  it->second.allocated = false;
  // Neighbours merge only within one pool: a capture's memory never returns to the cache.
  if (auto next = std::next(it); next != blocks_.end() &&
                                 next->second.segment == it->second.segment &&
                                 !next->second.allocated && next->second.pool == pool) {
    erase_free(next->first, next->second);
    it->second.size += next->second.size;
    blocks_.erase(next);
  }
  if (it->first != seg.va) {
    auto prev = std::prev(it);
    if (!prev->second.allocated && prev->second.pool == pool) {
      erase_free(prev->first, prev->second);
      prev->second.size += it->second.size;
      blocks_.erase(it);
      it = prev;
    }
  }
  insert_free(it->first, it->second);
}

bool Tier::trim_locked() {
  std::vector<DevicePtr> idle;
  for (const auto& [va, seg] : segments_) {
    // A segment whole in a capture's pool is not idle: its graph replays into it.
    const Block& b = blocks_.at(va);
    if (!b.allocated && b.size == seg.size && b.pool == kGeneral) idle.push_back(va);
  }
  for (DevicePtr va : idle) {
    Segment& s = segments_.at(va);
    if (s.mapped) unmap_segment(s);
    erase_free(va, blocks_.at(va));
    blocks_.erase(va);
    driver_.address_free(s.va, s.size);
    segments_.erase(va);
  }
  return !idle.empty();
}

void Tier::destroy_segment(DevicePtr key) noexcept {
  Segment& s = segments_.at(key);
  if (s.mapped) {
    try {
      unmap_segment(s);
    } catch (...) {  // NOLINT(bugprone-empty-catch): nothing left to report to
    }
  }
  driver_.address_free(s.va, s.size);
  for (auto it = blocks_.lower_bound(s.va); it != blocks_.end() && it->first < s.va + s.size;) {
    if (!it->second.allocated)
      free_.erase({it->second.pool, s.small, s.device, s.stream, it->second.size, it->first});
    it = blocks_.erase(it);
  }
  segments_.erase(key);
}

void Tier::map_segment(Segment& s) {
  Handle h = 0;
  if (!driver_.create(s.device, s.size, &h)) {
    throw Error(ErrorKind::kGpu,
                "out of GPU memory: the memory tier could not get back " + mib(s.size) +
                    " on device " + std::to_string(s.device) + " for " + hex(s.va),
                "restore onto a GPU with more free memory, or fewer copies onto one GPU");
  }
  map_handle(s, h, [](Handle) {});
}

void Tier::map_handle(Segment& s, Handle h, const std::function<void(Handle)>& check) {
  try {
    check(h);
    driver_.map(s.va, s.size, h);
    try {
      driver_.set_access(s.va, s.size, s.device);
    } catch (...) {
      driver_.unmap(s.va, s.size);
      throw;
    }
  } catch (...) {
    try {
      driver_.release(h);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the first failure is the one reported
    }
    throw;
  }
  s.handle = h;
  s.mapped = true;
}

void Tier::unmap_segment(Segment& s) {
  driver_.unmap(s.va, s.size);
  s.mapped = false;
  driver_.release(s.handle);
  s.handle = 0;
}

void Tier::insert_free(DevicePtr addr, const Block& b) {
  const Segment& s = segments_.at(b.segment);
  free_.insert({b.pool, s.small, s.device, s.stream, b.size, addr});
}

void Tier::erase_free(DevicePtr addr, const Block& b) {
  const Segment& s = segments_.at(b.segment);
  free_.erase({b.pool, s.small, s.device, s.stream, b.size, addr});
}

void Tier::synchronize_devices() {
  for (const auto& [device, uuid] : device_uuids_) {
    driver_.synchronize(device);
  }
}

}  // namespace gpusnap::tier
