// populate_probe: maps memory the way a test asks and reports what the process got, so that
// tests/preload can watch libgpusnap-preload.so from outside (it acts inside a process only).
//
//   populate_probe MIB private|shared populate|lazy [driver]
//
// Prints one line: `rss_kib=N huge_advised=0|1 zero=0|1 errno=E` for the new mapping: its
// resident size, whether its VMA carries the huge-page advice (VmFlags "hg"), whether every byte
// read back zero, and errno after the mmap that succeeded (the library must leave it alone).
//
// With `driver`, the probe plays the CUDA driver's checkpoint thread: it names itself "cuda…"
// before the mmap, writes a pattern over the first quarter of the mapping the moment mmap
// returns (as the driver's copy does while the library's helpers still populate), waits until no
// "gpusnap-fill" thread is left, and then reports `zero` for the rest and `pattern=0|1` for the
// quarter it wrote.
//
// With PROBE_REQUEST=FILE in the environment the probe first leaves, as gpusnap does, a request
// for its own mapping to go into FILE (in $GPUSNAP_PRELOAD_REQUESTS, dated PROBE_REQUEST_AGE
// seconds ago, default 0), and adds to its report `shared=0|1` (the mapping is a shared mapping
// of FILE), `aligned=0|1` (it starts on a 2 MiB boundary) and `request_left=0|1`.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace {

// Rss and VmFlags of the mapping that starts at `start`, from /proc/self/smaps.
void describe(unsigned long start, long* rss_kib, bool* advised) {
  std::ifstream smaps("/proc/self/smaps");
  bool ours = false;
  for (std::string line; std::getline(smaps, line);) {
    // A mapping's header line: "start-end perms offset dev inode [path]".
    char* end = nullptr;
    unsigned long lo = std::strtoul(line.c_str(), &end, 16);
    if (end != line.c_str() && *end == '-') {
      ours = lo == start;
      continue;
    }
    if (!ours) continue;
    if (line.rfind("Rss:", 0) == 0) *rss_kib = std::strtol(line.c_str() + 4, nullptr, 10);
    if (line.rfind("VmFlags:", 0) == 0) *advised = line.find(" hg") != std::string::npos;
  }
}

// Whether a thread of this process is named "gpusnap-fill" (the library's helpers).
bool fill_threads_left() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return false;
  bool found = false;
  while (dirent* e = readdir(dir)) {
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string name;
    if (std::getline(comm, name) && name == "gpusnap-fill") found = true;
  }
  closedir(dir);
  return found;
}

// The request's path, named as the library looks for it: "DIR/PIDNS-PID".
std::string request_path() {
  char ns[64] = {};
  if (readlink("/proc/self/ns/pid", ns, sizeof ns - 1) <= 0) return {};
  std::string text(ns);
  auto inode = text.substr(text.find('[') + 1);
  inode.pop_back();
  return std::string(std::getenv("GPUSNAP_PRELOAD_REQUESTS")) + "/" + inode + "-" +
         std::to_string(getpid());
}

void leave_request(const std::string& file) {
  auto path = request_path();
  std::ofstream(path) << file << "\n";
  chmod(path.c_str(), 0644);
  const char* age = std::getenv("PROBE_REQUEST_AGE");
  if (age != nullptr) {
    timespec times[2] = {};
    clock_gettime(CLOCK_REALTIME, &times[0]);
    times[0].tv_sec -= std::atol(age);
    times[1] = times[0];
    utimensat(AT_FDCWD, path.c_str(), times, 0);
  }
}

// Whether the mapping at `start` is a shared mapping of `file` (/proc/self/maps).
bool shared_mapping_of(unsigned long start, const std::string& file) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (std::strtoul(line.c_str(), nullptr, 16) != start) continue;
    std::istringstream fields(line);
    std::string range, perms, offset, dev, inode, path;
    fields >> range >> perms >> offset >> dev >> inode >> path;
    return perms == "rw-s" && path == file && offset == "00000000";
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: populate_probe MIB private|shared populate|lazy [driver]\n");
    return 2;
  }
  const bool driver = argc == 5 && std::strcmp(argv[4], "driver") == 0;
  if (driver) prctl(PR_SET_NAME, "cuda-probe", 0, 0, 0);
  size_t len = std::strtoul(argv[1], nullptr, 10) << 20;
  int flags = MAP_ANONYMOUS | (std::strcmp(argv[2], "shared") == 0 ? MAP_SHARED : MAP_PRIVATE);
  if (std::strcmp(argv[3], "populate") == 0) flags |= MAP_POPULATE;
  const char* request = std::getenv("PROBE_REQUEST");
  if (request != nullptr) leave_request(request);
  errno = 0;
  auto* p = static_cast<unsigned char*>(mmap(nullptr, len, PROT_READ | PROT_WRITE, flags, -1, 0));
  int err = errno;
  if (p == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  size_t written = 0;
  if (driver) {
    written = len / 4;
    std::memset(p, 0xab, written);
    for (int i = 0; i < 30000 && fill_threads_left(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  long rss_kib = -1;
  bool advised = false;
  describe(reinterpret_cast<unsigned long>(p), &rss_kib, &advised);
  bool pattern = true;
  for (size_t i = 0; i < written; ++i) pattern = pattern && p[i] == 0xab;
  bool zero = true;
  for (size_t i = written; i < len; i += 4096) zero = zero && p[i] == 0 && p[i + 4095] == 0;
  std::printf("rss_kib=%ld huge_advised=%d zero=%d errno=%d pattern=%d", rss_kib, advised ? 1 : 0,
              zero ? 1 : 0, err, pattern ? 1 : 0);
  if (request != nullptr) {
    auto start = reinterpret_cast<unsigned long>(p);
    std::printf(" shared=%d aligned=%d request_left=%d", shared_mapping_of(start, request) ? 1 : 0,
                start % (2ul << 20) == 0 ? 1 : 0,
                access(request_path().c_str(), F_OK) == 0 ? 1 : 0);
  }
  std::printf("\n");
  return 0;
}
