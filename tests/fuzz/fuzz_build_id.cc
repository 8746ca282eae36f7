// The GNU build-id reader (container/build_id.h) on arbitrary bytes: it reads the executables
// and libraries of a container's root, which the container's owner controls.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

#include "common/fd.h"
#include "container/build_id.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One file per process, reused: a memfd is what the reader's pread sees of a real file.
  static const int fd = ::memfd_create("elf", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, 0) != 0) return 0;
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) return 0;
    done += static_cast<size_t>(n);
  }
  (void)gpusnap::container::gnu_build_id(fd);
  return 0;
}
