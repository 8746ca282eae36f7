// An experiment, not a product path: an LD_PRELOAD library that records the large mappings a
// process makes (and, on request, asks for huge pages in them at once), to see how the CUDA
// driver lays out the host memory of its checkpoint.
//
//   LD_PRELOAD=mmap_trace_shim.so [SHIM_ADVISE=1] program ...
//
// Each mmap or munmap of 1 MiB or more is written to stderr as one line:
//   shim: T_NS mmap|munmap ADDR LEN anon|file FLAGS [advised]   (T_NS: CLOCK_MONOTONIC when the
//   call returned; FLAGS: mmap's flags in hex, 0x8000 is MAP_POPULATE)
// With SHIM_ADVISE=1 a private anonymous mapping of 64 MiB or more gets madvise(MADV_HUGEPAGE)
// before it is returned, so none of its pages is faulted small.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static void* (*real_mmap)(void*, size_t, int, int, int, off_t);
static int (*real_munmap)(void*, size_t);

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void say(const char* verb, void* addr, size_t len, int anon, int flags, int advised) {
  char line[160];
  int n = snprintf(line, sizeof line, "shim: %lld %s %p %zu %s 0x%x%s\n", now_ns(), verb, addr,
                   len, anon ? "anon" : "file", flags, advised ? " advised" : "");
  if (n > 0) (void)!write(2, line, (size_t)n);
}

void* mmap(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  // dlsym returns an object pointer; POSIX's way to make it a function pointer.
  if (!real_mmap) *(void**)(&real_mmap) = dlsym(RTLD_NEXT, "mmap");
  void* p = real_mmap(addr, len, prot, flags, fd, off);
  if (p == MAP_FAILED || len < (1u << 20)) return p;
  int anon = (flags & MAP_ANONYMOUS) != 0;
  int advised = 0;
  const char* advise = getenv("SHIM_ADVISE");
  if (advise && advise[0] == '1' && anon && (flags & MAP_PRIVATE) && len >= (64u << 20)) {
    advised = madvise(p, len, MADV_HUGEPAGE) == 0;
  }
  say("mmap", p, len, anon, flags, advised);
  return p;
}

void* mmap64(void* addr, size_t len, int prot, int flags, int fd, off_t off) {
  return mmap(addr, len, prot, flags, fd, off);
}

int munmap(void* addr, size_t len) {
  if (!real_munmap) *(void**)(&real_munmap) = dlsym(RTLD_NEXT, "munmap");
  if (len >= (1u << 20)) say("munmap", addr, len, 0, 0, 0);
  return real_munmap(addr, len);
}
