// fd_probe: reports which of its descriptors are open, so that a test of Subprocess can check
// what a spawned program really receives, from inside that program.
//
//   fd_probe open|closed FD [open|closed FD]...
//
// Exits 0 when every descriptor is as named, else 10 + the index of the first that is not
// (and 2 on a usage error).
#include <fcntl.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (argc < 3 || argc % 2 != 1) {
    std::fprintf(stderr, "usage: fd_probe open|closed FD [open|closed FD]...\n");
    return 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const bool want_open = std::strcmp(argv[i], "open") == 0;
    const int fd = std::atoi(argv[i + 1]);
    const bool is_open = ::fcntl(fd, F_GETFD) != -1 || errno != EBADF;
    if (is_open != want_open) return 10 + (i - 1) / 2;
  }
  return 0;
}
