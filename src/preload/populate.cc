// libgpusnap-preload.so: loaded into a workload (LD_PRELOAD) so that the CUDA driver's
// checkpoint gets its host memory faster.
//
// Why: the driver's checkpoint (cuCheckpointProcessCheckpoint) maps one private anonymous region
// as large as the GPU memory in use, with MAP_POPULATE, and only then copies the GPU's contents
// into it. Populating is done by the kernel in the calling driver thread, one 4 KiB fault and
// one page clear at a time unless the region has huge pages. Profiled on the H200 (driver
// 580.159.04, 16 GiB; docs/benchmarks.md): the populate took ~7 s of the call's 10 s, the copy
// itself ~3 s (6 GB/s). The region does not exist before the call, so nothing outside the process
// can prepare it, and advice from outside arrives after the populate (it holds the mapping lock).
//
// What: this library interposes mmap. A request for a large private anonymous writable mapping
// with MAP_POPULATE is mapped without MAP_POPULATE, asked for transparent huge pages
// (MADV_HUGEPAGE, so that a host in THP `madvise` mode gives 2 MiB pages), and populated with
// MADV_POPULATE_WRITE from several threads on disjoint 2 MiB-aligned slices before mmap returns.
// The caller gets what MAP_POPULATE promises, the same zeroed, resident memory, sooner. Every
// other mapping goes straight through. Nothing here can make a mapping fail that would not have
// failed anyway: when a thread cannot start, or the kernel lacks MADV_POPULATE_WRITE, the work
// is done in the calling thread.
//
// Settings (environment, read once):
//   GPUSNAP_PRELOAD_THREADS      threads for one populate (default: online CPUs, at most 16;
//                                0 turns the library off)
//   GPUSNAP_PRELOAD_HUGE_PAGES   0: do not ask for huge pages (default 1)
//   GPUSNAP_PRELOAD_LOG          1: one line on stderr per mapping populated
//
// The library is plain C++ with no use of the C++ runtime: it is loaded into arbitrary programs
// and must not bring its own copy of libstdc++ into them, nor allocate inside mmap.
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace {

// Below this, a populate is too short for threads to pay off, and it is not the driver's region.
constexpr size_t kMinBytes = size_t{256} << 20;
// Each thread populates at least this much.
constexpr size_t kMinSlice = size_t{64} << 20;
// Slices start on huge-page boundaries, so no 2 MiB page is faulted by two threads.
constexpr size_t kHugePage = size_t{2} << 20;
constexpr int kMaxThreads = 16;

using MmapFn = void* (*)(void*, size_t, int, int, int, off_t);

struct Settings {
  int threads = 0;
  bool huge_pages = true;
  bool log = false;
};

// Process-wide by nature: the library has one interposed mmap per process. Plain globals with
// pthread_once, not function-local statics, whose guards would need the C++ runtime.
// NOLINTBEGIN(cppcoreguidelines-avoid-non-const-global-variables)
std::atomic<MmapFn> real_mmap_fn{nullptr};
pthread_once_t settings_once = PTHREAD_ONCE_INIT;
Settings settings;
// NOLINTEND(cppcoreguidelines-avoid-non-const-global-variables)

void* raw_mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  // The system call returns the address as a long.
  return reinterpret_cast<void*>(  // NOLINT(performance-no-int-to-ptr)
      syscall(SYS_mmap, addr, len, prot, flags, fd, off));
}

MmapFn real_mmap() {
  MmapFn fn = real_mmap_fn.load(std::memory_order_acquire);
  if (fn == nullptr) {
    // The next definition (libc's); without one, the system call itself.
    fn = reinterpret_cast<MmapFn>(dlsym(RTLD_NEXT, "mmap"));
    if (fn == nullptr) fn = raw_mmap;
    real_mmap_fn.store(fn, std::memory_order_release);
  }
  return fn;
}

int env_int(const char* name, int fallback) {
  const char* value = getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  long parsed = strtol(value, &end, 10);
  return (end != nullptr && *end == '\0') ? static_cast<int>(parsed) : fallback;
}

void read_settings() {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int fallback = cpus < 1 ? 1 : (cpus > kMaxThreads ? kMaxThreads : static_cast<int>(cpus));
  int threads = env_int("GPUSNAP_PRELOAD_THREADS", fallback);
  settings.threads = threads < 0 ? 0 : (threads > kMaxThreads ? kMaxThreads : threads);
  settings.huge_pages = env_int("GPUSNAP_PRELOAD_HUGE_PAGES", 1) != 0;
  settings.log = env_int("GPUSNAP_PRELOAD_LOG", 0) != 0;
}

bool qualifies(size_t len, int prot, int flags) {
  if (len < kMinBytes || (flags & MAP_POPULATE) == 0) return false;
  if ((flags & MAP_ANONYMOUS) == 0 || (flags & MAP_TYPE) != MAP_PRIVATE) return false;
  if ((flags & (MAP_HUGETLB | MAP_LOCKED)) != 0 || (prot & PROT_WRITE) == 0) return false;
  pthread_once(&settings_once, read_settings);
  return settings.threads > 0;
}

struct Slice {
  char* start = nullptr;
  size_t size = 0;
  pthread_t thread{};
  bool started = false;
};

// Faults every page of the slice in for writing. Where the kernel lacks MADV_POPULATE_WRITE,
// one write per page does the same: the memory is fresh and zero, and nobody else holds its
// address yet, so writing a zero changes nothing but residency.
void populate_slice(const Slice& s) {
  if (madvise(s.start, s.size, MADV_POPULATE_WRITE) == 0) return;
  long page = sysconf(_SC_PAGESIZE);
  for (size_t off = 0; off < s.size; off += static_cast<size_t>(page)) {
    *static_cast<volatile char*>(s.start + off) = 0;
  }
}

void* populate_thread(void* arg) {
  populate_slice(*static_cast<Slice*>(arg));
  return nullptr;
}

double now_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

void populate(char* start, size_t len) {
  const double began = settings.log ? now_seconds() : 0;
  const bool huge = settings.huge_pages && madvise(start, len, MADV_HUGEPAGE) == 0;

  size_t wanted = len / kMinSlice;
  if (wanted > static_cast<size_t>(settings.threads))
    wanted = static_cast<size_t>(settings.threads);
  if (wanted < 1) wanted = 1;
  size_t slice = (len / wanted + kHugePage - 1) / kHugePage * kHugePage;

  Slice slices[kMaxThreads];
  size_t count = 0;
  for (size_t off = 0; off < len && count < static_cast<size_t>(kMaxThreads); off += slice) {
    slices[count].start = start + off;
    slices[count].size = (len - off < slice) ? len - off : slice;
    ++count;
  }

  // The helpers take no signals meant for the process: they block all of them from birth.
  sigset_t all;
  sigset_t old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int threads = 1;
  for (size_t i = 1; i < count; ++i) {
    slices[i].started =
        pthread_create(&slices[i].thread, nullptr, populate_thread, &slices[i]) == 0;
    threads += slices[i].started ? 1 : 0;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);

  populate_slice(slices[0]);
  for (size_t i = 1; i < count; ++i) {
    if (slices[i].started) {
      pthread_join(slices[i].thread, nullptr);
    } else {
      populate_slice(slices[i]);
    }
  }

  if (settings.log) {
    char line[200];
    int n = snprintf(line, sizeof line,
                     "gpusnap-preload: populated %zu MiB in %.3f s with %d threads%s\n", len >> 20,
                     now_seconds() - began, threads, huge ? ", huge pages asked" : "");
    if (n > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(n));
  }
}

void* mmap_impl(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  MmapFn real = real_mmap();
  if (!qualifies(len, prot, flags)) return real(addr, len, prot, flags, fd, off);
  void* p = real(addr, len, prot, flags & ~MAP_POPULATE, fd, off);
  if (p == MAP_FAILED) return p;
  const int saved = errno;
  populate(static_cast<char*>(p), len);
  errno = saved;
  return p;
}

}  // namespace

extern "C" {

// glibc's header names the parameters with reserved identifiers; these are the same ones.
// NOLINTNEXTLINE(readability-inconsistent-declaration-parameter-name)
__attribute__((visibility("default"))) void* mmap(void* addr, size_t len, int prot, int flags,
                                                  int fd, off_t off) {
  return mmap_impl(addr, len, prot, flags, fd, off);
}

// Programs built against older C libraries call the large-file name; it is the same call on
// 64-bit systems.
// NOLINTNEXTLINE(readability-inconsistent-declaration-parameter-name)
__attribute__((visibility("default"))) void* mmap64(void* addr, size_t len, int prot, int flags,
                                                    int fd, off_t off) {
  return mmap_impl(addr, len, prot, flags, fd, off);
}

}  // extern "C"
