#include "tier/fake_tier_driver.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <set>
#include <utility>

#include "gpusnap/error.h"

namespace gpusnap::tier {

namespace {
// The calling thread's current context, as the real driver keeps it: entered (pushed) or made
// current for good (a worker's use_device). A thread with neither has none, as a new thread.
thread_local int thread_entered = 0;
thread_local bool thread_uses_device = false;

constexpr std::size_t kGranularity = std::size_t{2} << 20;
// What fresh physical memory holds: not zeros, so that a test sees a byte nobody filled.
constexpr unsigned char kUndefined = 0xA5;

std::string hex(DevicePtr p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIx64, p);
  return buf;
}

Error misuse(const std::string& what) {
  return Error(ErrorKind::kGpu, what + ": CUDA_ERROR_INVALID_VALUE (fake driver)");
}

}  // namespace

FakeTierDriver::FakeTierDriver(int devices, std::size_t memory) : memory_(memory) {
  for (int d = 0; d < devices; ++d) uuids_.push_back("GPU-fake-" + std::to_string(d));
  stacks_.assign(uuids_.size(), 1024);
}

void FakeTierDriver::set_uuid(int device, std::string uuid) {
  std::lock_guard lock(mu_);
  uuids_.at(static_cast<std::size_t>(device)) = std::move(uuid);
}

void FakeTierDriver::set_capturing(Stream stream, bool capturing) {
  std::lock_guard lock(mu_);
  streams_[stream] = capturing ? std::optional<std::uint64_t>(next_capture_++) : std::nullopt;
}

void FakeTierDriver::join_capture(Stream stream, Stream origin) {
  std::lock_guard lock(mu_);
  streams_[stream] = streams_[origin];
}

void FakeTierDriver::fail_next(std::string call, int nth) {
  std::lock_guard lock(mu_);
  faults_[std::move(call)] = nth;
}

std::vector<std::string> FakeTierDriver::calls() const {
  std::lock_guard lock(mu_);
  return calls_;
}

std::vector<std::string> FakeTierDriver::calls_named(const std::string& name) const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  for (const auto& c : calls_) {
    if (c.compare(0, name.size(), name) == 0 && (c.size() == name.size() || c[name.size()] == ' '))
      out.push_back(c);
  }
  return out;
}

void FakeTierDriver::clear_calls() {
  std::lock_guard lock(mu_);
  calls_.clear();
}

std::size_t FakeTierDriver::used(int device) const {
  std::lock_guard lock(mu_);
  return used_locked(device);
}

std::size_t FakeTierDriver::used_locked(int device) const {
  std::set<const Physical*> counted;  // memory imported under a second handle counts once
  std::size_t n = 0;
  for (const auto& [h, p] : physical_) {
    if (p->device == device && counted.insert(p.get()).second) n += p->bytes.size();
  }
  return n;
}

std::size_t FakeTierDriver::handles() const {
  std::lock_guard lock(mu_);
  return physical_.size();
}
std::size_t FakeTierDriver::reservations() const {
  std::lock_guard lock(mu_);
  return reservations_.size();
}
std::size_t FakeTierDriver::mappings() const {
  std::lock_guard lock(mu_);
  return mappings_.size();
}
std::size_t FakeTierDriver::host_allocations() const {
  std::lock_guard lock(mu_);
  return host_.size();
}
std::size_t FakeTierDriver::streams() const {
  std::lock_guard lock(mu_);
  return streams_.size();
}

void FakeTierDriver::write(DevicePtr va, const void* src, std::size_t size) {
  std::lock_guard lock(mu_);
  std::memcpy(at(va, size, "write"), src, size);
}

void FakeTierDriver::read(DevicePtr va, void* dst, std::size_t size) const {
  std::lock_guard lock(mu_);
  std::memcpy(dst, at(va, size, "read"), size);
}

bool FakeTierDriver::record(const std::string& name, const std::string& line) {
  auto f = faults_.find(name);
  const bool fail = f != faults_.end() && --f->second == 0;
  if (fail) faults_.erase(f);
  calls_.push_back(fail ? line + " failed" : line);
  if (fail && name != "create" && name != "create_shareable" && name != "host_register") {
    throw Error(ErrorKind::kGpu, name + " failed: CUDA_ERROR_UNKNOWN (fake driver)");
  }
  return fail;
}

unsigned char* FakeTierDriver::at(DevicePtr va, std::size_t size, const char* call) {
  return const_cast<unsigned char*>(std::as_const(*this).at(va, size, call));
}

const unsigned char* FakeTierDriver::at(DevicePtr va, std::size_t size, const char* call) const {
  auto m = mappings_.upper_bound(va);
  if (m == mappings_.begin()) throw misuse(std::string(call) + " of unmapped " + hex(va));
  m = std::prev(m);
  if (va + size > m->first + m->second.size) {
    throw misuse(std::string(call) + " of unmapped " + hex(va));
  }
  if (!m->second.accessible) throw misuse(std::string(call) + " without access at " + hex(va));
  const Physical& p = *physical_.at(m->second.handle);
  return p.bytes.data() + (va - m->first);
}

void FakeTierDriver::check_device(int device, const char* call) const {
  if (device < 0 || static_cast<std::size_t>(device) >= uuids_.size()) {
    throw misuse(std::string(call) + " on device " + std::to_string(device));
  }
}

std::size_t FakeTierDriver::granularity(int device) {
  std::lock_guard lock(mu_);
  record("granularity", "granularity " + std::to_string(device));
  check_device(device, "granularity");
  return kGranularity;
}

DevicePtr FakeTierDriver::reserve(std::size_t size, std::size_t alignment) {
  std::lock_guard lock(mu_);
  record("reserve", "reserve " + std::to_string(size));
  if (size == 0 || size % kGranularity != 0 || alignment % kGranularity != 0) {
    throw misuse("reserve of " + std::to_string(size));
  }
  const DevicePtr va = next_va_;
  // A gap after each reservation, so that an access past its end finds nothing.
  next_va_ += size + kGranularity;
  reservations_[va] = size;
  return va;
}

void FakeTierDriver::address_free(DevicePtr va, std::size_t size) noexcept {
  std::lock_guard lock(mu_);
  auto r = reservations_.find(va);
  bool ok = r != reservations_.end() && r->second == size;
  if (ok) {
    auto m = mappings_.lower_bound(va);
    ok = m == mappings_.end() || m->first >= va + size;
  }
  calls_.push_back("address_free " + hex(va) + (ok ? "" : " invalid"));
  if (ok) reservations_.erase(r);
}

bool FakeTierDriver::create(int device, std::size_t size, Handle* handle) {
  std::lock_guard lock(mu_);
  return create_locked(device, size, handle, false);
}

bool FakeTierDriver::create_shareable(int device, std::size_t size, Handle* handle) {
  std::lock_guard lock(mu_);
  return create_locked(device, size, handle, true);
}

bool FakeTierDriver::create_locked(int device, std::size_t size, Handle* handle, bool shareable) {
  const char* name = shareable ? "create_shareable" : "create";
  const std::string line =
      std::string(name) + " " + std::to_string(device) + " " + std::to_string(size);
  check_device(device, name);
  if (used_locked(device) + size > memory_) {
    calls_.push_back(line + " out-of-memory");
    return false;
  }
  if (record(name, line)) return false;  // a fault on create: out of memory
  *handle = next_handle_++;
  physical_[*handle] = std::make_shared<Physical>(
      Physical{device, std::vector<unsigned char>(size, kUndefined), shareable});
  return true;
}

void FakeTierDriver::release(Handle handle) {
  std::lock_guard lock(mu_);
  record("release", "release " + std::to_string(handle));
  if (physical_.erase(handle) == 0) throw misuse("release of handle " + std::to_string(handle));
}

void FakeTierDriver::map(DevicePtr va, std::size_t size, Handle handle) {
  std::lock_guard lock(mu_);
  record("map", "map " + hex(va));
  auto p = physical_.find(handle);
  if (p == physical_.end() || p->second->bytes.size() != size) throw misuse("map of " + hex(va));
  auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin()) throw misuse("map outside a reservation at " + hex(va));
  r = std::prev(r);
  if (va + size > r->first + r->second) throw misuse("map outside a reservation at " + hex(va));
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.end() && m->first < va + size)
    throw misuse("map over a mapping at " + hex(va));
  if (m != mappings_.begin() && std::prev(m)->first + std::prev(m)->second.size > va) {
    throw misuse("map over a mapping at " + hex(va));
  }
  mappings_[va] = Mapping{size, handle, false};
}

void FakeTierDriver::set_access(DevicePtr va, std::size_t size, int device) {
  std::lock_guard lock(mu_);
  record("set_access", "set_access " + hex(va) + " " + std::to_string(device));
  auto m = mappings_.find(va);
  if (m == mappings_.end() || m->second.size != size) throw misuse("set_access at " + hex(va));
  if (physical_.at(m->second.handle)->device != device) {
    throw misuse("set_access for device " + std::to_string(device) + " at " + hex(va));
  }
  m->second.accessible = true;
}

void FakeTierDriver::unmap(DevicePtr va, std::size_t size) {
  std::lock_guard lock(mu_);
  record("unmap", "unmap " + hex(va));
  auto m = mappings_.find(va);
  if (m == mappings_.end() || m->second.size != size) throw misuse("unmap at " + hex(va));
  mappings_.erase(m);
}

void FakeTierDriver::use_device(int device) {
  std::lock_guard lock(mu_);
  thread_uses_device = true;
  // Not recorded: every worker calls it per piece; what matters is that it is legal.
  check_device(device, "use_device");
}

void FakeTierDriver::enter_device(int device) {
  std::lock_guard lock(mu_);
  record("enter_device", "enter_device " + std::to_string(device));
  check_device(device, "enter_device");
  ++entered_;
  ++thread_entered;
}

void FakeTierDriver::leave_device() noexcept {
  std::lock_guard lock(mu_);
  calls_.emplace_back(entered_ > 0 ? "leave_device" : "leave_device invalid");
  if (entered_ > 0) --entered_;
  if (thread_entered > 0) --thread_entered;
}

int FakeTierDriver::entered() const {
  std::lock_guard lock(mu_);
  return entered_;
}

void FakeTierDriver::synchronize(int device) {
  std::lock_guard lock(mu_);
  record("synchronize", "synchronize " + std::to_string(device));
  check_device(device, "synchronize");
}

std::size_t FakeTierDriver::stack_limit(int device) {
  std::lock_guard lock(mu_);
  record("stack_limit", "stack_limit " + std::to_string(device));
  check_device(device, "stack_limit");
  return stacks_.at(static_cast<std::size_t>(device));
}

void FakeTierDriver::set_stack_limit(int device, std::size_t bytes) {
  std::lock_guard lock(mu_);
  record("set_stack_limit",
         "set_stack_limit " + std::to_string(device) + " " + std::to_string(bytes));
  check_device(device, "set_stack_limit");
  stacks_.at(static_cast<std::size_t>(device)) = bytes;
}

void* FakeTierDriver::host_alloc(std::size_t size) {
  std::lock_guard lock(mu_);
  record("host_alloc", "host_alloc " + std::to_string(size));
  std::vector<unsigned char> buffer(size);
  void* p = buffer.data();
  host_[p] = std::move(buffer);
  return p;
}

namespace {

// Whether [p, p + size) lies in the one range of `ranges` (start -> length) starting at or
// before p.
template <typename Ranges, typename Length>
bool inside_one(const Ranges& ranges, const void* p, std::size_t size, Length length) {
  auto it = ranges.upper_bound(const_cast<void*>(p));
  if (it == ranges.begin()) return false;
  --it;
  const auto* start = static_cast<const unsigned char*>(it->first);
  const auto* at = static_cast<const unsigned char*>(p);
  const std::size_t n = length(it->second);
  return at >= start && size <= n && static_cast<std::size_t>(at - start) <= n - size;
}

}  // namespace

bool FakeTierDriver::pinned(const void* p, std::size_t size) const {
  // One allocation or one registration must hold all of [p, p + size): a copy reading across
  // two registrations is the driver's undefined behaviour.
  return inside_one(host_, p, size, [](const auto& v) { return v.size(); }) ||
         inside_one(registered_, p, size, [](const auto& v) { return v.size(); });
}

const void* FakeTierDriver::registered_bytes(const void* p) const {
  auto it = registered_.upper_bound(const_cast<void*>(p));
  if (it == registered_.begin()) return p;
  --it;
  const auto* start = static_cast<const unsigned char*>(it->first);
  const auto* at = static_cast<const unsigned char*>(p);
  if (at < start || static_cast<std::size_t>(at - start) >= it->second.size()) return p;
  return it->second.data() + (at - start);
}

bool FakeTierDriver::host_register(const void* p, std::size_t size) {
  std::lock_guard lock(mu_);
  if (record("host_register", "host_register " + std::to_string(size))) return false;
  // The driver refuses pages registered already; the tier must never ask (tier/in_place.h).
  const auto* at = static_cast<const unsigned char*>(p);
  auto next = registered_.lower_bound(const_cast<void*>(p));
  if (next != registered_.end() && static_cast<const unsigned char*>(next->first) < at + size) {
    throw misuse("host_register over registered memory");
  }
  if (next != registered_.begin()) {
    const auto prev = std::prev(next);
    if (static_cast<const unsigned char*>(prev->first) + prev->second.size() > at) {
      throw misuse("host_register over registered memory");
    }
  }
  // What the pages hold now: a copy reads this, as the driver's does where a file's page is
  // replaced after its registration (a hole punched, a page evicted and read again): the tier
  // must register only bytes that are final (tier/in_place.h).
  const auto* bytes = static_cast<const unsigned char*>(p);
  registered_[const_cast<void*>(p)] = std::vector<unsigned char>(bytes, bytes + size);
  ++registrations_;
  return true;
}

void FakeTierDriver::host_unregister(const void* p) noexcept {
  std::lock_guard lock(mu_);
  calls_.emplace_back(registered_.erase(const_cast<void*>(p)) != 0 ? "host_unregister"
                                                                   : "host_unregister invalid");
}

std::size_t FakeTierDriver::registered() const {
  std::lock_guard lock(mu_);
  return registered_.size();
}

std::size_t FakeTierDriver::registrations() const {
  std::lock_guard lock(mu_);
  return registrations_;
}

void FakeTierDriver::host_free(void* p) noexcept {
  std::lock_guard lock(mu_);
  calls_.emplace_back(host_.erase(p) != 0 ? "host_free" : "host_free invalid");
}

Stream FakeTierDriver::stream_create() {
  std::lock_guard lock(mu_);
  record("stream_create", "stream_create");
  // NOLINTNEXTLINE(performance-no-int-to-ptr): a fake stream is only a distinct value
  auto s = reinterpret_cast<Stream>(next_stream_);
  next_stream_ += 0x10;
  streams_[s] = std::nullopt;
  return s;
}

void FakeTierDriver::stream_destroy(Stream stream) noexcept {
  std::lock_guard lock(mu_);
  calls_.emplace_back(streams_.erase(stream) != 0 ? "stream_destroy" : "stream_destroy invalid");
}

void FakeTierDriver::copy_to_host(void* dst, DevicePtr src, std::size_t size, Stream stream) {
  std::lock_guard lock(mu_);
  record("copy_to_host", "copy_to_host " + hex(src) + " " + std::to_string(size));
  if (!pinned(dst, size)) throw misuse("copy_to_host into unpinned memory");
  if (streams_.find(stream) == streams_.end()) throw misuse("copy_to_host on an unknown stream");
  std::memcpy(dst, at(src, size, "copy_to_host"), size);
}

void FakeTierDriver::copy_to_device(DevicePtr dst, const void* src, std::size_t size,
                                    Stream stream) {
  std::lock_guard lock(mu_);
  record("copy_to_device", "copy_to_device " + hex(dst) + " " + std::to_string(size));
  if (!pinned(src, size)) throw misuse("copy_to_device from unpinned memory");
  if (streams_.find(stream) == streams_.end()) throw misuse("copy_to_device on an unknown stream");
  std::memcpy(at(dst, size, "copy_to_device"), registered_bytes(src), size);
}

void FakeTierDriver::stream_synchronize(Stream stream) {
  std::lock_guard lock(mu_);
  record("stream_synchronize", "stream_synchronize");
  if (streams_.find(stream) == streams_.end())
    throw misuse("stream_synchronize of an unknown stream");
}

std::optional<std::uint64_t> FakeTierDriver::capture_id(Stream stream) {
  std::lock_guard lock(mu_);
  if (thread_entered == 0 && !thread_uses_device) {
    throw Error(
        ErrorKind::kGpu,
        "cuStreamGetCaptureInfo failed: CUDA_ERROR_INVALID_CONTEXT (fake driver: no context "
        "current in this thread)");
  }
  if (auto f = faults_.find("capture_id"); f != faults_.end() && --f->second == 0) {
    faults_.erase(f);
    throw Error(ErrorKind::kGpu, "capture_id failed: CUDA_ERROR_UNKNOWN (fake driver)");
  }
  auto s = streams_.find(stream);
  return s == streams_.end() ? std::nullopt : s->second;
}

int FakeTierDriver::device_count() {
  std::lock_guard lock(mu_);
  return static_cast<int>(uuids_.size());
}

int FakeTierDriver::export_fd(Handle handle) {
  std::lock_guard lock(mu_);
  record("export_fd", "export_fd " + std::to_string(handle));
  auto p = physical_.find(handle);
  if (p == physical_.end() || !p->second->shareable) {
    throw misuse("export_fd of handle " + std::to_string(handle));
  }
  const int fd = ::memfd_create("fake-tier-export", MFD_CLOEXEC);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) throw sys_error("memfd_create", errno);
  exported_[st.st_ino] = p->second;
  return fd;
}

Handle FakeTierDriver::import_fd(int fd) {
  std::lock_guard lock(mu_);
  record("import_fd", "import_fd");
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw misuse("import_fd of a closed descriptor");
  auto e = exported_.find(st.st_ino);
  if (e == exported_.end()) throw misuse("import_fd of a descriptor nobody exported");
  const Handle h = next_handle_++;
  physical_[h] = e->second;
  return h;
}

int FakeTierDriver::handle_device(Handle handle) {
  std::lock_guard lock(mu_);
  auto p = physical_.find(handle);
  if (p == physical_.end()) throw misuse("handle_device of handle " + std::to_string(handle));
  return p->second->device;
}

std::string FakeTierDriver::device_uuid(int device) {
  std::lock_guard lock(mu_);
  record("device_uuid", "device_uuid " + std::to_string(device));
  check_device(device, "device_uuid");
  return uuids_[static_cast<std::size_t>(device)];
}

}  // namespace gpusnap::tier
