// A stand-in for the driver calls of the memory tier, for tests on machines without a GPU.
// Device memory is host memory: each physical handle owns a buffer, reservations and mappings
// are checked the way the driver checks them (an access through an unmapped address, a map
// outside a reservation or over a mapping, an unmap of nothing, freeing a reservation that is
// still mapped: each throws, so a test catches the tier misusing the API). Every call is recorded
// in order, and any call can be made to fail on demand. Copies happen at once, in the calling
// thread. Thread-safe: one internal mutex.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tier/tier_driver.h"

namespace gpusnap::tier {

class FakeTierDriver final : public TierDriver {
 public:
  // `devices` GPUs of `memory` bytes each, UUIDs "GPU-fake-0", "GPU-fake-1", ...; granularity
  // 2 MiB, as on the H200.
  explicit FakeTierDriver(int devices = 1, std::size_t memory = std::size_t{1} << 30);

  // --- set-up
  void set_uuid(int device, std::string uuid);
  // Starts a graph capture on `stream` with a new id, as cuStreamBeginCapture does (the first
  // id is 0), or ends it.
  void set_capturing(Stream stream, bool capturing);
  // Joins `stream` to the capture `origin` takes part in, as a fork inside captured work does.
  void join_capture(Stream stream, Stream origin);
  // The nth call named `call` from now ("create", "map", "unmap", "copy_to_host", ...) fails:
  // it throws Error(kGpu), or for "create" answers out of memory. "capture_id" fails too but,
  // asked at every allocation, is not listed in calls(). As the real one, "capture_id" also
  // fails on a thread with no context current (neither entered nor made current by use_device).
  void fail_next(std::string call, int nth = 1);

  // --- inspection
  // Every call in order, e.g. "reserve 2097152", "create 0 2097152", "map 0x7f0000000000",
  // "set_access 0x7f0000000000 0", "unmap 0x7f0000000000", "release 3",
  // "address_free 0x7f0000000000", "synchronize 0", "copy_to_host 0x7f0000000000 1024",
  // "copy_to_device ...", "host_alloc 33554432", "host_free", "host_register 16777216",
  // "host_unregister", "stream_create",
  // "stream_destroy", "stream_synchronize", "stack_limit 0", "set_stack_limit 0 1024". A failed
  // call is recorded with " failed".
  std::vector<std::string> calls() const;
  // The calls whose name (first word) is `name`.
  std::vector<std::string> calls_named(const std::string& name) const;
  void clear_calls();
  std::size_t used(int device) const;  // bytes of live physical handles
  std::size_t handles() const;
  std::size_t reservations() const;
  std::size_t mappings() const;
  std::size_t host_allocations() const;  // pinned buffers not freed
  std::size_t registered() const;        // host_register() ranges not unregistered
  std::size_t registrations() const;     // host_register() calls that succeeded, ever
  std::size_t streams() const;           // streams not destroyed
  // Device memory through the mappings, as a kernel would touch it. Throws like a copy.
  void write(DevicePtr va, const void* src, std::size_t size);
  void read(DevicePtr va, void* dst, std::size_t size) const;

  // --- TierDriver
  std::size_t granularity(int device) override;
  DevicePtr reserve(std::size_t size, std::size_t alignment) override;
  void address_free(DevicePtr va, std::size_t size) noexcept override;
  bool create(int device, std::size_t size, Handle* handle) override;
  void release(Handle handle) override;
  void map(DevicePtr va, std::size_t size, Handle handle) override;
  void set_access(DevicePtr va, std::size_t size, int device) override;
  void unmap(DevicePtr va, std::size_t size) override;
  void use_device(int device) override;
  void enter_device(int device) override;
  void leave_device() noexcept override;
  void synchronize(int device) override;
  // enter_device() calls not yet left: 0 after every drain and fill.
  int entered() const;
  // Each device's stack starts at 1 KiB, the driver's default.
  std::size_t stack_limit(int device) override;
  void set_stack_limit(int device, std::size_t bytes) override;
  void* host_alloc(std::size_t size) override;
  void host_free(void* p) noexcept override;
  // Fails (false) on fail_next("host_register"); throws for a range over one registered already,
  // which the driver refuses. A copy from a registered range reads what it held when registered
  // (as from a page the file has since replaced): registering bytes still to be written shows.
  bool host_register(const void* p, std::size_t size) override;
  void host_unregister(const void* p) noexcept override;
  Stream stream_create() override;
  void stream_destroy(Stream stream) noexcept override;
  void copy_to_host(void* dst, DevicePtr src, std::size_t size, Stream stream) override;
  void copy_to_device(DevicePtr dst, const void* src, std::size_t size, Stream stream) override;
  void stream_synchronize(Stream stream) override;
  std::optional<std::uint64_t> capture_id(Stream stream) override;
  std::string device_uuid(int device) override;
  int device_count() override;
  bool create_shareable(int device, std::size_t size, Handle* handle) override;
  // A memfd standing for the exported memory: import_fd() of it (or of a descriptor passed on
  // from it, over a Unix socket as between two processes) reaches the same bytes, in this
  // driver only.
  int export_fd(Handle handle) override;
  Handle import_fd(int fd) override;
  int handle_device(Handle handle) override;

 private:
  struct Physical {
    int device = 0;
    std::vector<unsigned char> bytes;
    bool shareable = false;
  };
  struct Mapping {
    std::size_t size = 0;
    Handle handle = 0;
    bool accessible = false;
  };

  // Records `line`; throws (or, for create, returns true = "fail") when a fault is due.
  bool record(const std::string& name, const std::string& line);
  bool create_locked(int device, std::size_t size, Handle* handle, bool shareable);
  std::size_t used_locked(int device) const;
  unsigned char* at(DevicePtr va, std::size_t size, const char* call);
  const unsigned char* at(DevicePtr va, std::size_t size, const char* call) const;
  void check_device(int device, const char* call) const;
  // Whether [p, p + size) lies in one pinned allocation: a copy to or from anywhere else is the
  // driver's undefined behaviour, and here an error.
  bool pinned(const void* p, std::size_t size) const;
  // Where a copy from `p` reads: inside a registration, what it held when registered; else p.
  const void* registered_bytes(const void* p) const;

  mutable std::mutex mu_;
  std::size_t memory_;
  std::vector<std::string> uuids_;
  std::vector<std::size_t> stacks_;  // by device
  // Handles share their Physical after an import, as the driver's handles share memory.
  std::map<Handle, std::shared_ptr<Physical>> physical_;
  std::map<std::uint64_t, std::shared_ptr<Physical>> exported_;  // by the memfd's inode
  std::map<DevicePtr, std::size_t> reservations_;
  std::map<DevicePtr, Mapping> mappings_;
  std::map<void*, std::vector<unsigned char>> host_;
  // host_register()ed ranges: start -> what they held when registered
  std::map<void*, std::vector<unsigned char>> registered_;
  std::size_t registrations_ = 0;
  std::map<Stream, std::optional<std::uint64_t>> streams_;  // stream -> the capture it is in
  std::map<std::string, int> faults_;                       // call -> countdown
  std::vector<std::string> calls_;
  Handle next_handle_ = 1;
  DevicePtr next_va_ = 0x7f0000000000;
  std::uintptr_t next_stream_ = 0x1000;
  std::uint64_t next_capture_ = 0;
  int entered_ = 0;
};

}  // namespace gpusnap::tier
