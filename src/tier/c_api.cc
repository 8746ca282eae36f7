// The C interface of libgpusnap-tier.so (clients/include/gpusnap/tier_api.h): the one place that
// holds the process's Tier. A pluggable allocator is a pair of plain functions, so the instance
// they reach must be process-wide; everything below it (Tier, TierDriver) takes its collaborators
// explicitly and is tested on its own instances.
//
// The instance is created at the first call and never destroyed: at process exit the CUDA
// runtime and driver may already be torn down, and returning memory then would crash the
// workload on its way out. No exception crosses this interface.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "gpusnap/error.h"
#include "gpusnap/tier_api.h"
#include "tier/memory_tier.h"

namespace {

using gpusnap::Error;
using gpusnap::ErrorKind;
using gpusnap::tier::Tier;

struct Library {
  std::mutex mu;  // guards creation and last_error
  std::unique_ptr<gpusnap::tier::TierDriver> driver;
  std::unique_ptr<Tier> tier;
  std::string last_error;
};

Library& library() {
  // The one instance the C entry points reach; never destroyed (see the top of this file).
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory,cppcoreguidelines-avoid-non-const-global-variables)
  static auto* lib = new Library;
  return *lib;
}

// The tier, created with the real driver at first use; nullptr (and last_error set) when the
// driver cannot be loaded.
Tier* tier(bool create) {
  Library& lib = library();
  std::lock_guard lock(lib.mu);
  if (lib.tier || !create) return lib.tier.get();
  try {
    lib.driver = gpusnap::tier::open_cuda_tier_driver();
    lib.tier = std::make_unique<Tier>(*lib.driver, gpusnap::tier::TierSettings::from_environment(),
                                      ::getpid());
  } catch (const Error& e) {
    lib.last_error = e.what();
  }
  return lib.tier.get();
}

void remember(const std::string& text) {
  Library& lib = library();
  std::lock_guard lock(lib.mu);
  lib.last_error = text;
}

void copy_out(const std::string& text, char* out, size_t size) {
  if (out == nullptr || size == 0) return;
  const size_t n = std::min(text.size(), size - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

// Runs `fn`, turning an exception into a return code and a message.
template <typename Fn>
int guarded(char* error, size_t error_size, Fn fn) {
  try {
    fn();
    copy_out("", error, error_size);
    return 0;
  } catch (const Error& e) {
    copy_out(e.what(), error, error_size);
    return e.exit_code();
  } catch (const std::exception& e) {
    copy_out(std::string("memory tier: ") + e.what(), error, error_size);
    return static_cast<int>(ErrorKind::kInternal);
  }
}

std::map<std::string, std::string> parse_gpu_map(const char* text) {
  std::map<std::string, std::string> map;
  if (text == nullptr) return map;
  std::string s(text);
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find(';', start);
    if (end == std::string::npos) end = s.size();
    const std::string pair = s.substr(start, end - start);
    const size_t eq = pair.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == pair.size()) {
      throw Error(ErrorKind::kInternal, "memory tier: bad GPU map entry \"" + pair + "\"",
                  "pass OLD=NEW pairs of GPU UUIDs separated by ';'");
    }
    map[pair.substr(0, eq)] = pair.substr(eq + 1);
    start = end + 1;
  }
  return map;
}

}  // namespace

extern "C" {

void* tier_malloc(ssize_t size, int device, void* stream) {
  Tier* t = tier(true);
  if (t == nullptr || size < 0) return nullptr;
  try {
    return t->allocate(static_cast<size_t>(size), device, stream);
  } catch (const std::exception& e) {
    remember(e.what());
    return nullptr;
  }
}

void tier_free(void* ptr, ssize_t /*size*/, int /*device*/, void* /*stream*/) {
  Tier* t = tier(false);
  if (t == nullptr) return;
  try {
    t->free(ptr);
  } catch (const std::exception& e) {
    remember(e.what());
  }
}

int gpusnap_tier_drain(const char* dir, char* error, size_t error_size) {
  return guarded(error, error_size, [&] {
    if (dir == nullptr || *dir == '\0') {
      throw Error(ErrorKind::kInternal, "memory tier: no folder to drain into",
                  "pass the pause request's tier_dir");
    }
    Tier* t = tier(false);
    if (t == nullptr) return;  // nothing allocated: nothing to drain
    // A folder this process cannot see (a workload in a container into which gpusnap could not
    // mount it, container/mount.h): the memory stays mapped and goes with the driver's
    // checkpoint, as without the tier. Safe, only slower, so a note and not a failure.
    struct stat st {};
    if (::stat(dir, &st) != 0 && errno == ENOENT) {
      std::fprintf(stderr,
                   "gpusnap-tier: %s is not reachable from this process; its GPU memory goes "
                   "with the driver's checkpoint\n",
                   dir);
      return;
    }
    t->drain(dir);
  });
}

int gpusnap_tier_adopt(const char* dir, unsigned long long* adopted, char* error,
                       size_t error_size) {
  return guarded(error, error_size, [&] {
    if (adopted != nullptr) *adopted = 0;
    Tier* t = tier(false);
    if (t == nullptr || dir == nullptr || *dir == '\0') return;
    // The prefill's socket is named by the pid the tier drained under, which a restored copy
    // keeps (its pid namespace is restored with it).
    const auto socket = std::filesystem::path(dir) / (std::to_string(t->pid()) + ".sock");
    const auto bytes = t->adopt(socket, std::chrono::seconds(30));
    if (adopted != nullptr) *adopted = bytes;
  });
}

int gpusnap_tier_fill(const char* dir, const char* gpu_map, char* error, size_t error_size) {
  return guarded(error, error_size, [&] {
    const auto map = parse_gpu_map(gpu_map);
    if (Tier* t = tier(false)) t->fill(dir != nullptr ? dir : "", map);
  });
}

int gpusnap_tier_state(void) {
  Tier* t = tier(false);
  if (t == nullptr) return GPUSNAP_TIER_UNUSED;
  return t->state() == gpusnap::tier::TierState::kServing ? GPUSNAP_TIER_SERVING
                                                          : GPUSNAP_TIER_DRAINED;
}

unsigned long long gpusnap_tier_live_bytes(void) {
  Tier* t = tier(false);
  return t == nullptr ? 0 : t->stats().live_bytes;
}

void gpusnap_tier_last_error(char* error, size_t error_size) {
  Library& lib = library();
  std::lock_guard lock(lib.mu);
  copy_out(lib.last_error, error, error_size);
}

}  // extern "C"
