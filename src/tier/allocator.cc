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
// Why blocks allocated during a graph capture are never reused: the graph replays into them
// after the capture ends and PyTorch has freed the tensors; PyTorch's caching allocator keeps
// them in the graph's private pool, which a pluggable allocator is not told about.
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "gpusnap/error.h"
#include "tier/tier.h"

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
  // Below 64 KiB each copy's fixed cost would dominate (on the H200 already below 1 MiB, exp42).
  s.buffer_bytes = static_cast<std::size_t>(std::max(kib, 64L)) << 10;
  const char* log = std::getenv("GPUSNAP_TIER_LOG");  // NOLINT(concurrency-mt-unsafe): at load
  s.log = log != nullptr && std::string(log) == "1";
  const char* stack = std::getenv("GPUSNAP_TIER_STACK");  // NOLINT(concurrency-mt-unsafe): at load
  s.free_stacks = stack == nullptr || std::string(stack) != "keep";
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
    if (b.graph) s.graph_bytes += b.size;
    if (!b.allocated) s.cached_bytes += b.size;
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
  // NOLINTNEXTLINE(performance-no-int-to-ptr): a device address is what the caller gets
  return reinterpret_cast<void*>(allocate_locked(size, device, stream));
}

DevicePtr Tier::allocate_locked(std::size_t size, int device, Stream stream) {
  const std::size_t rounded = round_up(size, kRound);
  const bool small = rounded <= kSmallRequest;
  const bool graph = driver_.capturing(stream);
  auto it = free_.lower_bound({small, device, stream, rounded, 0});
  if (it == free_.end() || std::get<0>(*it) != small || std::get<1>(*it) != device ||
      std::get<2>(*it) != stream) {
    std::size_t want = small ? kSmallSegment : rounded <= kMediumRequest ? kMediumSegment : rounded;
    Segment& s = new_segment(want, device, stream, small);
    Block b{s.va, s.size, false, false};
    blocks_[s.va] = b;
    insert_free(s.va, b);
    it = free_.find({small, device, stream, s.size, s.va});
  }
  const DevicePtr addr = std::get<4>(*it);
  Block& b = blocks_.at(addr);
  erase_free(addr, b);
  // Split off the rest when it is worth a block of its own: in the large pool only above
  // kSmallRequest, so that large segments are not worn down into small pieces.
  const std::size_t rest = b.size - rounded;
  if (rest >= (small ? kRound : kSmallRequest + 1)) {
    Block tail{b.segment, rest, false, false};
    blocks_[addr + rounded] = tail;
    insert_free(addr + rounded, tail);
    b.size = rounded;
  }
  b.allocated = true;
  b.graph = graph;
  return addr;
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
    if (!driver_.capturing(stream)) {
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
  // A graph's block stays live: the graph writes into it on every replay.
  if (it->second.graph) return;
  it->second.allocated = false;
  const Segment& seg = segments_.at(it->second.segment);
  if (auto next = std::next(it); next != blocks_.end() &&
                                 next->second.segment == it->second.segment &&
                                 !next->second.allocated) {
    erase_free(next->first, next->second);
    it->second.size += next->second.size;
    blocks_.erase(next);
  }
  if (it->first != seg.va) {
    auto prev = std::prev(it);
    if (!prev->second.allocated) {
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
    const Block& b = blocks_.at(va);
    if (!b.allocated && b.size == seg.size) idle.push_back(va);
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
      free_.erase({s.small, s.device, s.stream, it->second.size, it->first});
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
  free_.insert({s.small, s.device, s.stream, b.size, addr});
}

void Tier::erase_free(DevicePtr addr, const Block& b) {
  const Segment& s = segments_.at(b.segment);
  free_.erase({s.small, s.device, s.stream, b.size, addr});
}

void Tier::synchronize_devices() {
  for (const auto& [device, uuid] : device_uuids_) {
    driver_.synchronize(device);
  }
}

}  // namespace gpusnap::tier
