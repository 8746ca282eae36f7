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
// When the caller is one of the CUDA driver's own threads (its name starts with "cuda", as the
// thread that runs the checkpoint does), mmap returns at once and the helpers populate *ahead*
// of the driver's copy instead: they take 32 MiB stripes in address order, the copy follows
// behind (it writes from the start), and a page the copy reaches first is simply faulted by
// the copy. MADV_POPULATE_WRITE never changes a page that is already there, so the helpers can
// never overwrite what the driver wrote; and with no MADV_POPULATE_WRITE they stop rather than
// touch pages. On the H200 (16 GiB) the driver's call took 3.27 s populating ahead against
// 4.11 s populating first (docs/benchmarks.md, "The driver's checkpoint given its memory by
// libgpusnap-preload"), so there is no setting for the other way. The helpers are named
// "gpusnap-fill"; gpusnap waits for them to be gone before it moves or dumps the region
// (engine/preload.h).
//
// Straight into the artifact: when gpusnap is about to run the driver's checkpoint of this
// process, it leaves a request, a file named "PIDNS-PID" (this process's PID namespace inode and
// its PID there) in the requests directory, naming an empty file of the artifact being written.
// The driver thread's mapping is then a SHARED mapping of that file instead of anonymous memory,
// so that the driver's own copy is the write into the artifact and gpusnap copies nothing
// (docs/gpu-memory.md, "Host images"). The request is honoured once (it is removed when taken),
// only for the driver's thread and a mapping the caller lets the kernel place, only when it is
// recent (kRequestLifetime), owned by root and not writable by others, and only when the file is
// an empty regular file owned by root on a file system with room for the whole mapping (a write
// into a full one would be a SIGBUS in the driver). In every other case, and on any failure, the
// mapping is the anonymous memory the caller asked for. The mapping starts on a 2 MiB boundary
// at file offset 0, so that a huge-page tmpfs can map the file 2 MiB at a time.
//
// After the driver's call the region must become a PRIVATE mapping of the same file (nothing the
// process writes may reach the artifact). The library does that itself, from a thread it starts
// when it maps the file ("gpusnap-remap"): it waits for gpusnap's second request, "PIDNS-PID.remap"
// ("START END OFFSET PROT ADVICE", a range inside the region it mapped), maps the range privately
// from the file in one mmap(MAP_FIXED) and leaves; "cancel" makes it leave without. gpusnap
// waits for the thread to be gone. Why not from outside: gpusnap used to stop a thread of the
// process with ptrace and inject the system calls, and a gpusnap killed in those milliseconds
// left that thread with its registers and the process died. Here a killed gpusnap leaves the
// region either as it was or remapped, both whole; a watcher nobody asks leaves once the region
// is unmapped (the driver's restore unmaps it) or after kWatchLifetime.
//
// Settings (environment, read once):
//   GPUSNAP_PRELOAD_THREADS      threads for one populate (default: online CPUs, at most 16;
//                                0 turns the library off)
//   GPUSNAP_PRELOAD_HUGE_PAGES   0: do not ask for huge pages (default 1)
//   GPUSNAP_PRELOAD_LOG          1: one line on stderr per mapping populated
//   GPUSNAP_PRELOAD_REQUESTS     gpusnap's requests directory (default /run/gpusnap/preload,
//                                gpusnap's own under its default --run-dir); empty: none.
//                                `gpusnap init` sets /tmp/.gpusnap-preload, where a capture
//                                of the container mounts this capture's requests (read-only:
//                                gpusnap removes what this library takes)
//
// The library is plain C++ with no use of the C++ runtime: it is loaded into arbitrary programs
// and must not bring its own copy of libstdc++ into them, nor allocate inside mmap.
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

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
// The unit of work of a populate ahead of the caller: small enough that the front moves in
// order, large enough to be 16 huge pages per call.
constexpr size_t kStripe = size_t{32} << 20;
// The helpers' thread name, which gpusnap looks for (kFillThreadName in engine/preload.h).
constexpr const char* kFillThreadName = "gpusnap-fill";

// A request older than this is left over from a gpusnap that died before the driver's call:
// gpusnap writes it just before that call.
constexpr time_t kRequestLifetime = 60;
constexpr size_t kPathMax = 4096;
// The remap watcher's name (kRemapThreadName in engine/preload.h), how often it looks for its
// request, and how long it waits at most (a driver's checkpoint of a whole GPU takes a minute).
constexpr const char* kRemapThreadName = "gpusnap-remap";
constexpr long kWatchStepNs = 1000000;
constexpr double kWatchLifetime = 900;

using MmapFn = void* (*)(void*, size_t, int, int, int, off_t);

struct Settings {
  int threads = 0;
  bool huge_pages = true;
  bool log = false;
  char requests[kPathMax] = "/run/gpusnap/preload";
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
  if (const char* dir = getenv("GPUSNAP_PRELOAD_REQUESTS"); dir != nullptr) {
    if (std::strlen(dir) < sizeof settings.requests) {
      std::strcpy(settings.requests, dir);  // NOLINT(clang-analyzer-security.insecureAPI.strcpy)
    }
  }
}

bool qualifies(size_t len, int prot, int flags) {
  if (len < kMinBytes || (flags & MAP_POPULATE) == 0) return false;
  if ((flags & MAP_ANONYMOUS) == 0 || (flags & MAP_TYPE) != MAP_PRIVATE) return false;
  if ((flags & (MAP_HUGETLB | MAP_LOCKED)) != 0 || (prot & PROT_WRITE) == 0) return false;
  pthread_once(&settings_once, read_settings);
  return settings.threads > 0;
}

// Blocks every signal in the calling thread while it lives, so that the helper threads it
// starts meanwhile inherit a full mask: none of the workload's signals is delivered to them.
class SignalsBlocked {
 public:
  SignalsBlocked() {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old_);
  }
  SignalsBlocked(const SignalsBlocked&) = delete;
  SignalsBlocked& operator=(const SignalsBlocked&) = delete;
  ~SignalsBlocked() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }

 private:
  sigset_t old_{};
};

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

void log_line(size_t len, double seconds, int threads, bool huge, const char* how) {
  if (!settings.log) return;
  char line[200];
  int n = snprintf(line, sizeof line,
                   "gpusnap-preload: populated %zu MiB in %.3f s with %d threads%s%s\n", len >> 20,
                   seconds, threads, huge ? ", huge pages asked" : "", how);
  if (n > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(n));
}

// Whether the calling thread is one of the CUDA driver's (named "cuda..."): only its mapping is
// populated ahead, because only there is it known what comes next (the driver's sequential
// copy, and no unmapping of the region while the helpers run).
bool called_by_the_driver() {
  char name[16] = {};
  return prctl(PR_GET_NAME, name, 0, 0, 0) == 0 && std::strncmp(name, "cuda", 4) == 0;
}

// One populate ahead of the caller, shared by its helpers. It lives in a page of its own (not
// malloc: this runs inside mmap), freed by the last helper out.
struct Ahead {
  char* start = nullptr;
  size_t len = 0;
  bool huge = false;
  double began = 0;
  int threads = 0;
  std::atomic<size_t> next{0};
  std::atomic<int> live{0};
};

// Drops `n` references to the populate; the last one out logs and frees it.
void release(Ahead* a, int n) {
  if (a->live.fetch_sub(n) != n) return;
  log_line(a->len, now_seconds() - a->began, a->threads, a->huge, ", ahead of the driver's copy");
  a->~Ahead();
  munmap(a, sizeof(Ahead));
}

void* ahead_thread(void* arg) {
  auto* a = static_cast<Ahead*>(arg);
  pthread_setname_np(pthread_self(), kFillThreadName);
  for (;;) {
    size_t off = a->next.fetch_add(1) * kStripe;
    if (off >= a->len) break;
    size_t size = a->len - off < kStripe ? a->len - off : kStripe;
    // Without MADV_POPULATE_WRITE, or with the mapping gone: stop. Touching pages here could
    // overwrite what the driver has written.
    if (madvise(a->start + off, size, MADV_POPULATE_WRITE) != 0) {
      a->next.store(a->len / kStripe + 1);
      break;
    }
  }
  release(a, 1);
  return nullptr;
}

// Starts the helpers of a populate ahead of the caller and returns; false when none could start
// (the caller then populates before returning).
bool populate_ahead(char* start, size_t len, bool huge) {
  void* page = real_mmap()(nullptr, sizeof(Ahead), PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) return false;
  auto* a = new (page) Ahead;
  a->start = start;
  a->len = len;
  a->huge = huge;
  a->began = now_seconds();
  const int wanted = settings.threads;
  // One reference per helper, and the caller's own until it has counted them.
  a->live.store(wanted + 1);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  int started = 0;
  {
    SignalsBlocked blocked;
    for (int i = 0; i < wanted; ++i) {
      pthread_t t;
      if (pthread_create(&t, &attr, ahead_thread, a) == 0) ++started;
    }
  }
  pthread_attr_destroy(&attr);
  if (started == 0) {
    a->~Ahead();
    munmap(a, sizeof(Ahead));
    return false;
  }
  a->threads = started;
  release(a, wanted - started + 1);  // the helpers that never started, and the caller's
  return true;
}

void populate(char* start, size_t len) {
  const double began = settings.log ? now_seconds() : 0;
  const bool huge = settings.huge_pages && madvise(start, len, MADV_HUGEPAGE) == 0;
  if (called_by_the_driver() && populate_ahead(start, len, huge)) return;

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

  int threads = 1;
  {
    SignalsBlocked blocked;
    for (size_t i = 1; i < count; ++i) {
      slices[i].started =
          pthread_create(&slices[i].thread, nullptr, populate_thread, &slices[i]) == 0;
      threads += slices[i].started ? 1 : 0;
    }
  }

  populate_slice(slices[0]);
  for (size_t i = 1; i < count; ++i) {
    if (slices[i].started) {
      pthread_join(slices[i].thread, nullptr);
    } else {
      populate_slice(slices[i]);
    }
  }

  log_line(len, settings.log ? now_seconds() - began : 0, threads, huge, "");
}

void log_text(const char* a, const char* b) {
  if (!settings.log) return;
  char line[kPathMax + 200];
  int n = snprintf(line, sizeof line, "gpusnap-preload: %s%s\n", a, b);
  if (n > 0) (void)!write(STDERR_FILENO, line, std::strlen(line));
}

// Closes a descriptor when it goes out of scope.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// The request's path for this process: "DIR/PIDNS-PID", the PID namespace's inode taken from
// /proc/self/ns/pid ("pid:[4026531836]"). False when it cannot be made.
bool request_path(char* out, size_t size) {
  char ns[64] = {};
  ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  if (n <= 0) return false;
  const char* open_bracket = std::strchr(ns, '[');
  if (open_bracket == nullptr) return false;
  unsigned long long inode = std::strtoull(open_bracket + 1, nullptr, 10);
  int len = snprintf(out, size, "%s/%llu-%d", settings.requests, inode, static_cast<int>(getpid()));
  return len > 0 && static_cast<size_t>(len) < size;
}

enum class Taken { kNone, kInvalid, kText };

// Takes the request at `path`: its text, without a final newline, in `text`. A request counts
// only when it is a regular file owned by root, writable by nobody else, recent, and smaller
// than `size`; it is removed either way once read, so that it is honoured at most once.
Taken take_text(const char* path, char* text, size_t size) {
  Fd fd(open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (fd.get() < 0) return Taken::kNone;  // the usual case: no capture in progress
  struct stat st {};
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  ssize_t n = -1;
  if (fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == 0 &&
      (st.st_mode & (S_IWGRP | S_IWOTH)) == 0 && st.st_size > 0 &&
      static_cast<size_t>(st.st_size) < size && now.tv_sec - st.st_mtime <= kRequestLifetime &&
      st.st_mtime <= now.tv_sec + 1) {
    n = read(fd.get(), text, size - 1);
  }
  unlink(path);
  if (n <= 0 || n != st.st_size) {
    log_text("ignored a stale or malformed request ", path);
    return Taken::kInvalid;
  }
  text[n] = '\0';
  if (text[n - 1] == '\n') text[n - 1] = '\0';
  return Taken::kText;
}

// Takes this process's request, if there is a valid one: the path of the file it names, in
// `file`, and the request's own path in `request` (the remap request goes beside it).
bool take_request(char* file, size_t size, char* request, size_t request_size) {
  if (settings.requests[0] == '\0') return false;
  if (!request_path(request, request_size)) return false;
  return take_text(request, file, size) == Taken::kText && file[0] == '/';
}

// The remap watcher of one region: in a page of its own (not malloc: this starts inside mmap),
// freed by the watcher when it leaves.
struct Watch {
  int fd = -1;  // the file, kept open: gpusnap renames it meanwhile
  char* start = nullptr;
  size_t len = 0;
  int keep_flags = 0;           // MAP_NORESERVE, as the caller asked
  char request[kPathMax] = {};  // "DIR/PIDNS-PID.remap"
};

// Whether the first page of the region is still mapped (the driver's restore unmaps it).
bool still_mapped(const Watch& w) { return msync(w.start, 1, MS_ASYNC) == 0 || errno != ENOMEM; }

// "START END OFFSET PROT ADVICE" (hexadecimal addresses, decimal rest): the range to make
// private, inside the region and at the file offsets the region maps. Then one mmap(MAP_FIXED):
// the range is the file's pages either way, shared before, private after, never unmapped.
void remap(const Watch& w, const char* text) {
  char* end = nullptr;
  const uintptr_t first = std::strtoull(text, &end, 16);
  const uintptr_t last = std::strtoull(end, &end, 16);
  const uint64_t offset = std::strtoull(end, &end, 10);
  const long prot = std::strtol(end, &end, 10);
  const long advice = std::strtol(end, &end, 10);
  const auto region = reinterpret_cast<uintptr_t>(w.start);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  // The mapping ends on a page boundary, the length the driver asked for need not.
  const uintptr_t region_end = region + (w.len + page - 1) / page * page;
  if (first < region || last > region_end || first >= last || first % page != 0 ||
      last % page != 0 || offset != first - region || (prot & ~(PROT_READ | PROT_WRITE)) != 0) {
    log_text("ignored a remap request outside the region: ", text);
    return;
  }
  // NOLINTBEGIN(performance-no-int-to-ptr)
  void* p = real_mmap()(reinterpret_cast<void*>(first), last - first, static_cast<int>(prot),
                        MAP_PRIVATE | MAP_FIXED | w.keep_flags, w.fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED) {
    // The number, not strerror(): this runs on the watcher thread, and strerror is not
    // thread-safe.
    char code[32];
    snprintf(code, sizeof code, "errno %d", errno);
    log_text("cannot make the driver's memory private: ", code);
    return;
  }
  // The advice the range had (gpusnap read it from smaps), bit by bit as engine/preload.h says.
  const int advise[] = {MADV_DONTFORK, MADV_DONTDUMP, MADV_HUGEPAGE, MADV_NOHUGEPAGE};
  for (int bit = 0; bit < 4; ++bit) {
    if ((advice & (1L << bit)) != 0)
      madvise(reinterpret_cast<void*>(first), last - first, advise[bit]);
  }
  // NOLINTEND(performance-no-int-to-ptr)
  log_text("made the driver's memory private from inside the process", "");
}

void* watch_thread(void* arg) {
  auto* w = static_cast<Watch*>(arg);
  pthread_setname_np(pthread_self(), kRemapThreadName);
  const double began = now_seconds();
  char text[256];
  while (now_seconds() - began < kWatchLifetime && still_mapped(*w)) {
    const Taken taken = take_text(w->request, text, sizeof text);
    if (taken == Taken::kText) {
      if (std::strcmp(text, "cancel") != 0) remap(*w, text);
      break;
    }
    timespec step{0, kWatchStepNs};
    nanosleep(&step, nullptr);
  }
  close(w->fd);
  w->~Watch();
  munmap(w, sizeof(Watch));
  return nullptr;
}

// Starts the remap watcher of a region just mapped from `fd`; false when it cannot (the caller
// then gives the driver anonymous memory: a region nobody can make private must not exist).
bool start_watch(int fd, void* start, size_t len, int keep_flags, const char* request) {
  void* page = real_mmap()(nullptr, sizeof(Watch), PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) return false;
  auto* w = new (page) Watch;
  w->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  w->start = static_cast<char*>(start);
  w->len = len;
  w->keep_flags = keep_flags;
  const int n = snprintf(w->request, sizeof w->request, "%s.remap", request);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  bool started = false;
  if (w->fd >= 0 && n > 0 && static_cast<size_t>(n) < sizeof w->request) {
    SignalsBlocked blocked;
    pthread_t t;
    started = pthread_create(&t, &attr, watch_thread, w) == 0;
  }
  pthread_attr_destroy(&attr);
  if (!started) {
    if (w->fd >= 0) close(w->fd);
    w->~Watch();
    munmap(w, sizeof(Watch));
  }
  return started;
}

// The caller's mapping as a shared mapping of the file gpusnap asked for, 2 MiB-aligned at file
// offset 0; MAP_FAILED when there is no request or it cannot be honoured (nothing is then
// changed but the file's size, which gpusnap checks).
void* map_into_file(size_t len, int prot, int flags) {
  char file[kPathMax];
  char request[kPathMax];
  if (!take_request(file, sizeof file, request, sizeof request)) return MAP_FAILED;
  Fd fd(open(file, O_RDWR | O_CLOEXEC | O_NOFOLLOW));
  struct stat st {};
  struct statvfs vfs {};
  if (fd.get() < 0 || fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != 0 ||
      st.st_size != 0 || fstatvfs(fd.get(), &vfs) != 0) {
    log_text("cannot use the requested file ", file);
    return MAP_FAILED;
  }
  // Every page the driver writes must find room: a shared mapping of a full file system faults
  // with SIGBUS, where anonymous memory would simply have been allocated.
  if (static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize < len) {
    log_text("no room for the driver's memory beside ", file);
    return MAP_FAILED;
  }
  // Whole pages, as the mapping is: the file then holds every byte the process can see.
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  if (ftruncate(fd.get(), static_cast<off_t>((len + page - 1) / page * page)) != 0) {
    return MAP_FAILED;
  }
  MmapFn real = real_mmap();
  // Room for a 2 MiB-aligned start, reserved without memory, then the file mapped over it.
  void* room =
      real(nullptr, len + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (room == MAP_FAILED) {
    (void)!ftruncate(fd.get(), 0);
    return MAP_FAILED;
  }
  auto base = reinterpret_cast<uintptr_t>(room);
  uintptr_t start = (base + kHugePage - 1) / kHugePage * kHugePage;
  const int keep = flags & MAP_NORESERVE;
  // An address the kernel gave, rounded up.
  void* p = real(reinterpret_cast<void*>(start),  // NOLINT(performance-no-int-to-ptr)
                 len, prot, MAP_SHARED | MAP_FIXED | keep, fd.get(), 0);
  if (p == MAP_FAILED) {
    munmap(room, len + kHugePage);
    (void)!ftruncate(fd.get(), 0);
    return MAP_FAILED;
  }
  // NOLINTBEGIN(performance-no-int-to-ptr)
  if (start > base) munmap(room, start - base);
  if (base + kHugePage > start) {
    munmap(reinterpret_cast<void*>(start + len), base + kHugePage - start);
  }
  // NOLINTEND(performance-no-int-to-ptr)
  if (!start_watch(fd.get(), p, len, keep, request)) {
    munmap(p, len);
    (void)!ftruncate(fd.get(), 0);
    return MAP_FAILED;
  }
  log_text("the driver's memory goes straight into ", file);
  return p;
}

void* mmap_impl(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  MmapFn real = real_mmap();
  if (!qualifies(len, prot, flags)) return real(addr, len, prot, flags, fd, off);
  void* p = MAP_FAILED;
  if (addr == nullptr && called_by_the_driver()) {
    const int saved = errno;
    p = map_into_file(len, prot, flags);
    errno = saved;
  }
  if (p == MAP_FAILED) p = real(addr, len, prot, flags & ~MAP_POPULATE, fd, off);
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
