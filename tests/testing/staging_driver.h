// A stand-in for the part of the NVIDIA driver that host images depend on, for tests and
// benchmarks on machines without a GPU: on checkpoint it maps a new private anonymous region in
// the process and fills it with "GPU contents" (what the real driver does, measured on the H200:
// docs/gpu-memory.md), on restore it reads the region back from the process, checks every byte and
// unmaps it, as the driver's restore reads host memory. The state machine is FakeDriver's.
#pragma once

#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/proc.h"
#include "common/syscall_injection.h"
#include "gpu/fake_driver.h"
#include "gpusnap/checkpoint.h"
#include "testing/harness.h"

namespace gpusnap::testing {

inline constexpr uint64_t kMiB = 1ull << 20;
inline constexpr uint64_t kRegion = 192 * kMiB;
// The preload library takes only mappings of at least 256 MiB for the driver's.
inline constexpr uint64_t kLibraryRegion = 320 * kMiB;
inline constexpr uint64_t kHugePage = 2 * kMiB;
// Where the real driver's region started within a 2 MiB page on the H200 (0x7f7ab85db000):
// not on a boundary, which gpusnap's files must make up for.
inline constexpr uint64_t kRegionSkew = 0x1db000;

// The word at `index` of the region: every fourth 4 MiB block is zero (a hole in the image;
// blocks this large stay holes even where the file system caches files in large folios).
inline uint64_t word_at(uint64_t index) {
  if ((index * 8 / (4 * kMiB)) % 4 == 3) return 0;
  uint64_t z = index + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  return z ^ (z >> 27);
}

class StagingDriver final : public gpu::Driver {
 public:
  // `port`: the test workload's; its checkpoint is then played inside the workload, through the
  // C library's mmap (DRIVER-MAP), where libgpusnap-preload.so sees it as it sees the driver's.
  // `region`: the bytes of "GPU memory" a checkpoint leaves in the process (without `port`).
  explicit StagingDriver(gpu::FakeDriver& fake, uint16_t port = 0, uint64_t region = kRegion)
      : fake_(fake), bytes_(region) {
    if (port != 0) ask_ = [port](const std::string& line) { return ask(port, line); };
  }
  // The same, for a workload reached another way than at 127.0.0.1 (one in a container's network
  // namespace): `ask_workload` sends a line and returns the answer.
  StagingDriver(gpu::FakeDriver& fake, std::function<std::string(const std::string&)> ask_workload)
      : fake_(fake), bytes_(kLibraryRegion), ask_(std::move(ask_workload)) {}

  bool available() const override { return fake_.available(); }
  std::string reason() const override { return fake_.reason(); }
  gpu::DriverFacts facts() override { return fake_.facts(); }
  std::vector<gpu::ProcessGpuUsage> usage() override { return fake_.usage(); }
  bool uses_gpu(pid_t pid) override { return fake_.uses_gpu(pid); }
  gpu::ProcessState state(pid_t pid) override { return fake_.state(pid); }
  void lock(pid_t pid, std::chrono::milliseconds t) override { fake_.lock(pid, t); }
  void unlock(pid_t pid) override { fake_.unlock(pid); }

  void checkpoint(pid_t pid) override {
    fake_.checkpoint(pid);
    if (ask_) {
      auto reply = ask_("DRIVER-MAP " + std::to_string(kLibraryRegion / kMiB));
      ASSERT_EQ(reply.rfind("addr=", 0), 0u) << reply;
      std::lock_guard<std::mutex> g(mutex_);
      region_ = std::stoull(reply.substr(5), nullptr, 16);
      return;
    }
    common::RemoteThread thread(pid);
    // A region that starts kRegionSkew past a 2 MiB boundary, as the driver's did.
    long room = thread.syscall(SYS_mmap, 0, bytes_ + 2 * kHugePage, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS, static_cast<uint64_t>(-1), 0);
    ASSERT_GT(room, 0);
    uint64_t base = static_cast<uint64_t>(room);
    uint64_t start = (base + kHugePage - 1) / kHugePage * kHugePage + kRegionSkew;
    if (start > base) thread.syscall(SYS_munmap, base, start - base);
    thread.syscall(SYS_munmap, start + bytes_, base + bytes_ + 2 * kHugePage - start - bytes_);
    long at = static_cast<long>(start);
    std::vector<uint64_t> words(kMiB / 8);
    for (uint64_t off = 0; off < bytes_; off += kMiB) {
      for (uint64_t i = 0; i < words.size(); ++i) words[i] = word_at(off / 8 + i);
      thread.write_memory(static_cast<uint64_t>(at) + off, words.data(), kMiB);
    }
    std::lock_guard<std::mutex> g(mutex_);
    region_ = static_cast<uint64_t>(at);
  }

  void restore(pid_t pid, const std::vector<gpu::GpuPair>& pairs) override {
    uint64_t region;
    {
      std::lock_guard<std::mutex> g(mutex_);
      region = region_;  // a copy has the source's address space layout
    }
    const uint64_t bytes = ask_ ? kLibraryRegion : bytes_;
    std::string outcome = check_region(pid, region, bytes);
    {
      common::RemoteThread thread(pid);
      thread.syscall(SYS_munmap, region, bytes);
    }
    std::lock_guard<std::mutex> g(mutex_);
    outcomes_[pid] = outcome;
    fake_.restore(pid, pairs);
  }

  std::map<pid_t, std::string> outcomes() const {
    std::lock_guard<std::mutex> g(mutex_);
    return outcomes_;
  }

  // "ok", or what differs.
  static std::string check_region(pid_t pid, uint64_t region, uint64_t bytes) {
    std::vector<uint64_t> words(kMiB / 8);
    for (uint64_t off = 0; off < bytes; off += kMiB) {
      iovec local{words.data(), kMiB};
      iovec remote{reinterpret_cast<void*>(region + off), kMiB};
      if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(kMiB)) {
        return "cannot read the region at offset " + std::to_string(off);
      }
      for (uint64_t i = 0; i < words.size(); ++i) {
        if (words[i] != word_at(off / 8 + i)) {
          return "byte " + std::to_string(off + i * 8) + " differs";
        }
      }
    }
    return "ok";
  }

 private:
  gpu::FakeDriver& fake_;
  uint64_t bytes_;
  std::function<std::string(const std::string&)> ask_;  // the workload's, when it maps the region
  mutable std::mutex mutex_;
  uint64_t region_ = 0;
  std::map<pid_t, std::string> outcomes_;
};

// Copies' processes: host pid of every process one PID namespace down whose inner pid is `ns`.
inline std::vector<pid_t> copies_of(pid_t ns) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    pid_t pid = std::atoi(e.path().filename().c_str());
    if (pid <= 0) continue;
    try {
      auto p = proc::read_process(pid);
      if (p.nspid.size() == 2 && p.nspid[1] == ns && p.state != 'Z') out.push_back(pid);
    } catch (const std::exception&) {
    }
  }
  return out;
}

// A capture of `source` into `dir`/`name` through `driver`, gpusnap's state in `dir`/run.
inline CheckpointOptions capture_options(const TempDir& dir, const Workload& source,
                                         gpu::Driver& driver, const std::string& name = "snap") {
  CheckpointOptions co;
  co.pid = source.pid();
  co.output = dir / name;
  co.driver = &driver;
  co.helper_binary = gpusnap_bin();
  co.run_dir = dir / "run";
  return co;
}

}  // namespace gpusnap::testing
