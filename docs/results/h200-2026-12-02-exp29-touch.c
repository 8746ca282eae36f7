// First-touch rate of fresh anonymous memory, again after the memory was freed and idle.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char** argv) {
  size_t mib = argc > 1 ? strtoull(argv[1], 0, 10) : 2048;
  int huge = argc > 2 ? atoi(argv[2]) : 0;
  int nsleeps = argc - 3;
  for (int r = 0; r <= nsleeps; ++r) {
    int s = r == 0 ? 0 : atoi(argv[3 + r - 1]);
    if (s) sleep(s);
    size_t n = mib << 20;
    char* p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 1; }
    if (huge) madvise(p, n, MADV_HUGEPAGE);
    double t0 = now();
    for (size_t i = 0; i < n; i += 4096) p[i] = 1;
    double t1 = now();
    munmap(p, n);
    printf("touch %zu MiB huge=%d after sleep %d s: %.3f s, %.2f GB/s\n", mib, huge, s, t1 - t0, n / (t1 - t0) / 1e9);
    fflush(stdout);
  }
  return 0;
}
