// gpusnap-checksum-bench: the evidence behind gpusnap's checksum choice (XXH3-128).
//
// Measures single-thread throughput over an in-memory buffer (pre-faulted, random content) for
// the candidate checksums, then the way gpusnap actually uses its checksum: reading a file from
// the page cache with pread in 4 MiB blocks, 64 MiB chunks, XXH3-128 per chunk (gpusnap's update,
// src/artifact/xxh3.h), on 1 and 2 threads (src/artifact/checksum.cc does the same). Prints a
// markdown table on stdout.
//
//   gpusnap-checksum-bench [--buffer-mib N] [--file-mib N] [--dir DIR] [--reps N]
//
// Defaults: a 1 GiB buffer, a 2 GiB file in /tmp (removed at exit), 5 repetitions; each row
// reports the median. Rows whose library was not found at build time are left out (SHA-256 needs
// OpenSSL's libcrypto, CRC32 needs zlib).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/utsname.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if GPUSNAP_BENCH_HAVE_OPENSSL
#include <openssl/crypto.h>
#include <openssl/evp.h>
#endif
#if GPUSNAP_BENCH_HAVE_ZLIB
#include <zlib.h>
#endif

#include "artifact/xxh3.h"

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr size_t kReadBlock = 4 * kMiB;  // pread size, as gpusnap's checksum_tree
constexpr uint64_t kChunk = 64 * kMiB;   // gpusnap's manifest chunk_bytes

// A failure: main prints it and exits with `code` (1: the benchmark failed, 2: bad usage).
struct Failure : std::runtime_error {
  Failure(const std::string& what, int exit_code) : std::runtime_error(what), code(exit_code) {}
  int code;
};

[[noreturn]] void die(const std::string& what) { throw Failure(what, 1); }

[[noreturn]] void die_errno(const std::string& what) {
  die(what + ": " + std::system_category().message(errno));
}

// Removes the page-cache file however the benchmark ends (exceptions included).
struct RemoveFile {
  std::string path;
  explicit RemoveFile(std::string p) : path(std::move(p)) {}
  RemoveFile(const RemoveFile&) = delete;
  RemoveFile& operator=(const RemoveFile&) = delete;
  ~RemoveFile() { ::unlink(path.c_str()); }
};

// Keeps a result alive so that no hash is optimised away.
inline void keep(uint64_t value) { asm volatile("" : : "r"(value) : "memory"); }

double gb(uint64_t bytes) { return static_cast<double>(bytes) / 1e9; }

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// CPU time of this thread (CLOCK_THREAD_CPUTIME_ID) or of the whole process: unlike wall time,
// it does not grow while other work on a busy machine holds the cores.
double cpu_seconds(clockid_t clock) {
  struct timespec ts {};
  ::clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

struct Timing {
  double wall = 0;
  double cpu = 0;
};

// Fills with a fast, non-repeating pattern: as good as random for a checksum's speed.
void fill_random(uint64_t* words, size_t count, uint64_t seed) {
  uint64_t x = seed;
  for (size_t i = 0; i < count; ++i) {
    uint64_t z = (x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    words[i] = z ^ (z >> 31);
  }
}

struct Row {
  std::string name;
  std::string input;
  int threads = 1;
  double seconds = 0;      // wall time, median of the repetitions
  double cpu_seconds = 0;  // CPU time (all threads), median of the repetitions
  uint64_t bytes = 0;
  std::string note;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct Candidate {
  std::string name;
  std::string note;
  std::function<uint64_t(const uint8_t*, size_t)> fn;
};

// Times every candidate over `total` bytes: the whole buffer in one call (block == total), or
// `block`-sized pieces of the buffer's start hashed one after the other (a block that stays in
// the CPU cache, like the 4 MiB pread buffer gpusnap hashes). The candidates take turns, round
// after round, so that a slow phase of the machine hits them all alike; the median is kept.
std::vector<Row> time_candidates(const std::vector<Candidate>& candidates, int reps,
                                 const uint8_t* data, size_t total, size_t block,
                                 const std::string& input) {
  std::vector<std::vector<double>> times(candidates.size()), cpu(candidates.size());
  for (const auto& c : candidates) keep(c.fn(data, std::min(total, 64 * kMiB)));
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      double t0 = now_seconds(), c0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
      uint64_t h = 0;
      for (size_t done = 0; done < total; done += block) h ^= candidates[i].fn(data, block);
      times[i].push_back(now_seconds() - t0);
      cpu[i].push_back(cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - c0);
      keep(h);
    }
  }
  std::vector<Row> rows;
  for (size_t i = 0; i < candidates.size(); ++i) {
    rows.push_back({candidates[i].name, input, 1, median(times[i]), median(cpu[i]), total,
                    candidates[i].note});
    std::fprintf(stderr, "  %-22s %6.2f GB/s wall, %6.2f GB/s per CPU-second\n",
                 candidates[i].name.c_str(), gb(total) / rows.back().seconds,
                 gb(total) / rows.back().cpu_seconds);
  }
  return rows;
}

// Reads every word, no hash: the memory bandwidth one core gets, the ceiling for any checksum
// of data that is not in the cache.
uint64_t read_words(const uint8_t* p, size_t n) {
  const uint64_t* w = reinterpret_cast<const uint64_t*>(p);
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 4 <= n / 8; i += 4) {
    a += w[i];
    b ^= w[i + 1];
    c += w[i + 2];
    d ^= w[i + 3];
  }
  return a ^ b ^ c ^ d;
}

// Reads [0, size) of the file in kChunk chunks spread over `threads` threads, each chunk with
// pread of kReadBlock blocks, hashing with XXH3-128 when `hash` is true.
Timing read_file(const std::string& path, uint64_t size, int threads, bool hash) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) die_errno("open " + path);
  std::atomic<uint64_t> next_chunk{0};
  std::atomic<uint64_t> sink{0};
  std::mutex error_mutex;
  std::string error;  // the first failure of any thread (threads must not throw)
  uint64_t chunks = (size + kChunk - 1) / kChunk;
  auto worker = [&] {
    std::unique_ptr<uint8_t[]> buf(new uint8_t[kReadBlock]);
    std::memset(buf.get(), 0, kReadBlock);
    XXH3_state_t* state = XXH3_createState();
    uint64_t local = 0;
    for (uint64_t c; (c = next_chunk.fetch_add(1)) < chunks;) {
      uint64_t begin = c * kChunk;
      uint64_t end = std::min(size, begin + kChunk);
      XXH3_128bits_reset(state);
      for (uint64_t off = begin; off < end;) {
        ssize_t n = ::pread(fd, buf.get(), std::min<uint64_t>(kReadBlock, end - off),
                            static_cast<off_t>(off));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          std::lock_guard lock(error_mutex);
          if (error.empty()) {
            error = "pread " + path + ": " +
                    (n == 0 ? "unexpected end of file" : std::system_category().message(errno));
          }
          next_chunk = chunks;
          break;
        }
        if (hash) {
          gpusnap::artifact::xxh3_128_update(state, buf.get(), static_cast<size_t>(n));
        } else {
          local += buf[0];
        }
        off += static_cast<uint64_t>(n);
      }
      if (hash) local ^= XXH3_128bits_digest(state).low64;
    }
    XXH3_freeState(state);
    sink ^= local;
  };
  double t0 = now_seconds(), c0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  Timing elapsed{now_seconds() - t0, cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - c0};
  keep(sink.load());
  ::close(fd);
  if (!error.empty()) die(error);
  return elapsed;
}

Row time_file(const std::string& name, int reps, const std::string& path, uint64_t size,
              int threads, bool hash) {
  std::vector<double> times, cpu;
  for (int r = 0; r < reps; ++r) {
    Timing t = read_file(path, size, threads, hash);
    times.push_back(t.wall);
    cpu.push_back(t.cpu);
  }
  Row row{name,        std::to_string(size / kMiB / 1024) + " GiB file, page cache, pread 4 MiB",
          threads,     median(times),
          median(cpu), size,
          {}};
  if (size % (1024 * kMiB) != 0) {
    row.input = std::to_string(size / kMiB) + " MiB file, page cache, pread 4 MiB";
  }
  std::fprintf(stderr, "  %-22s %d thread(s) %6.2f GB/s wall, %6.2f GB/s per CPU-second\n",
               name.c_str(), threads, gb(size) / row.seconds, gb(size) / row.cpu_seconds);
  return row;
}

// Writes a file of `size` random bytes and reads it once, so that it sits in the page cache.
void make_file(const std::string& path, uint64_t size, const uint8_t* pattern,
               size_t pattern_size) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) die_errno("create " + path);
  uint64_t written = 0;
  uint64_t salt = 0;
  std::vector<uint64_t> block(kReadBlock / 8);
  while (written < size) {
    // Each 4 MiB block differs from the others: the pattern, mixed with the block number.
    size_t n = static_cast<size_t>(std::min<uint64_t>(kReadBlock, size - written));
    const uint64_t* src = reinterpret_cast<const uint64_t*>(pattern + (written % pattern_size));
    size_t avail = (pattern_size - (written % pattern_size)) / 8;
    for (size_t i = 0; i < n / 8; ++i) block[i] = src[i % avail] ^ salt;
    ++salt;
    const char* p = reinterpret_cast<const char*>(block.data());
    for (size_t left = n; left > 0;) {
      ssize_t w = ::write(fd, p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) die_errno("write " + path);
      p += w;
      left -= static_cast<size_t>(w);
    }
    written += n;
  }
  ::close(fd);
  read_file(path, size, 1, false);  // into the page cache
}

std::string fs_type(const std::string& dir) {
  // The filesystem of DIR as /proc/self/mounts names it (the longest matching mount point).
  FILE* f = std::fopen("/proc/self/mounts", "r");
  if (f == nullptr) return "?";
  char real[4096];
  if (::realpath(dir.c_str(), real) == nullptr) std::snprintf(real, sizeof real, "%s", dir.c_str());
  std::string best_mount, best_type = "?";
  char src[1024], mnt[1024], type[256];
  while (std::fscanf(f, "%1023s %1023s %255s %*[^\n]", src, mnt, type) == 3) {
    std::string m = mnt, r = real;
    bool under = r == m || (r.rfind(m, 0) == 0 && (m == "/" || r[m.size()] == '/'));
    if (under && m.size() >= best_mount.size()) {
      best_mount = m;
      best_type = type;
    }
  }
  std::fclose(f);
  return best_type;
}

std::string cpu_model() {
  FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (f == nullptr) return "?";
  char line[1024];
  std::string model = "?";
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, "model name", 10) == 0) {
      const char* colon = std::strchr(line, ':');
      if (colon != nullptr) model = colon + 2;
      if (!model.empty() && model.back() == '\n') model.pop_back();
      break;
    }
  }
  std::fclose(f);
  return model;
}

// The 1-, 5- and 15-minute load averages, as "a/b/c".
std::string loadavg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  if (!(in >> a >> b >> c)) return "?";
  return a + "/" + b + "/" + c;
}

// A whole number for FLAG, from `min` up; throws Failure (usage) otherwise.
uint64_t parse_number(const std::string& text, const char* flag, uint64_t min) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < min) {
    throw Failure(std::string(flag) + " needs a whole number from " + std::to_string(min) +
                      ", not '" + text + "'",
                  2);
  }
  return value;
}

void usage() {
  std::fprintf(stderr,
               "usage: gpusnap-checksum-bench [--buffer-mib N] [--file-mib N] [--dir DIR] "
               "[--reps N]\n"
               "  --buffer-mib N  in-memory buffer size (default 1024)\n"
               "  --file-mib N    page-cache file size, 0 skips the file rows (default 2048)\n"
               "  --dir DIR       where the file is written (default /tmp); removed at exit\n"
               "  --reps N        repetitions per row, the median is reported (default 5)\n");
}

}  // namespace

int run(int argc, char** argv) {
  uint64_t buffer_mib = 1024, file_mib = 2048;
  int reps = 5;
  std::string dir = "/tmp";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Failure(a + " needs a value", 2);
      return argv[++i];
    };
    if (a == "--buffer-mib") {
      buffer_mib = parse_number(value(), "--buffer-mib", 4);
    } else if (a == "--file-mib") {
      file_mib = parse_number(value(), "--file-mib", 0);
    } else if (a == "--dir") {
      dir = value();
    } else if (a == "--reps") {
      reps = static_cast<int>(std::min<uint64_t>(parse_number(value(), "--reps", 1), 1000));
    } else if (a == "--help" || a == "-h") {
      usage();
      return 0;
    } else {
      throw Failure("unknown option " + a, 2);
    }
  }
  if (buffer_mib % 4 != 0) throw Failure("--buffer-mib must be a multiple of 4", 2);
  if (file_mib % 4 != 0) throw Failure("--file-mib must be a multiple of 4", 2);

  const std::string load_at_start = loadavg();
  const size_t size = buffer_mib * kMiB;
  void* mem = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) die_errno("mmap the buffer");
  auto* data = static_cast<uint8_t*>(mem);
  std::fprintf(stderr, "filling a %llu MiB buffer...\n",
               static_cast<unsigned long long>(buffer_mib));
  auto seed = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  fill_random(reinterpret_cast<uint64_t*>(data), size / 8, seed);  // writes every page: faulted

  std::vector<Candidate> candidates;
  candidates.push_back({"XXH3-64", "", [](const uint8_t* p, size_t n) {
                          return static_cast<uint64_t>(XXH3_64bits(p, n));
                        }});
  candidates.push_back({"XXH3-128 (libxxhash.a)", "Debian's build: SSE2, no dispatch",
                        [](const uint8_t* p, size_t n) {
                          XXH128_hash_t h = XXH3_128bits(p, n);
                          return static_cast<uint64_t>(h.low64 ^ h.high64);
                        }});
  candidates.push_back({"XXH3-128", std::string("gpusnap's: ") + gpusnap::artifact::xxh3_vectors(),
                        [](const uint8_t* p, size_t n) {
                          static thread_local XXH3_state_t* state = XXH3_createState();
                          XXH3_128bits_reset(state);
                          gpusnap::artifact::xxh3_128_update(state, p, n);
                          XXH128_hash_t h = XXH3_128bits_digest(state);
                          return static_cast<uint64_t>(h.low64 ^ h.high64);
                        }});
  candidates.push_back({"XXH64", "", [](const uint8_t* p, size_t n) {
                          return static_cast<uint64_t>(XXH64(p, n, 0));
                        }});
#if GPUSNAP_BENCH_HAVE_OPENSSL
  candidates.push_back(
      {"SHA-256", std::string("OpenSSL EVP, ") + OpenSSL_version(OPENSSL_VERSION),
       [](const uint8_t* p, size_t n) {
         unsigned char md[EVP_MAX_MD_SIZE];
         unsigned int len = 0;
         EVP_MD_CTX* ctx = EVP_MD_CTX_new();
         if (ctx == nullptr || EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1 ||
             EVP_DigestUpdate(ctx, p, n) != 1 || EVP_DigestFinal_ex(ctx, md, &len) != 1) {
           die("OpenSSL SHA-256 failed");
         }
         EVP_MD_CTX_free(ctx);
         uint64_t v;
         std::memcpy(&v, md, sizeof v);
         return v;
       }});
#else
  std::fprintf(stderr, "SHA-256: skipped (built without OpenSSL libcrypto)\n");
#endif
#if GPUSNAP_BENCH_HAVE_ZLIB
  candidates.push_back(
      {"CRC32", std::string("zlib ") + zlibVersion(), [](const uint8_t* p, size_t n) {
         uLong crc = crc32(0L, Z_NULL, 0);
         // zlib's length is a uInt: feed at most 1 GiB per call.
         for (size_t off = 0; off < n;) {
           size_t len = std::min<size_t>(n - off, 1u << 30);
           crc = crc32(crc, p + off, static_cast<uInt>(len));
           off += len;
         }
         return static_cast<uint64_t>(crc);
       }});
#else
  std::fprintf(stderr, "CRC32: skipped (built without zlib)\n");
#endif
  std::vector<Candidate> reference = {
      {"memory read (no hash)", "reference: the ceiling", read_words}};

  std::vector<Row> rows;
  std::string whole = std::to_string(buffer_mib) + " MiB buffer in memory";
  if (buffer_mib % 1024 == 0) whole = std::to_string(buffer_mib / 1024) + " GiB buffer in memory";
  std::fprintf(stderr, "%s, 1 thread, median of %d:\n", whole.c_str(), reps);
  for (auto& r : time_candidates(candidates, reps, data, size, size, whole)) rows.push_back(r);
  for (auto& r : time_candidates(reference, reps, data, size, size, whole)) rows.push_back(r);
  std::string cached =
      "4 MiB block in CPU cache, hashed " + std::to_string(size / kReadBlock) + "x";
  std::fprintf(stderr, "%s, 1 thread, median of %d:\n", cached.c_str(), reps);
  for (auto& r : time_candidates(candidates, reps, data, size, kReadBlock, cached)) {
    rows.push_back(r);
  }

  if (file_mib > 0) {
    std::string file_path = dir + "/gpusnap-checksum-bench." + std::to_string(::getpid());
    RemoveFile remove(file_path);
    std::fprintf(stderr, "writing %llu MiB to %s (%s) and reading it into the page cache...\n",
                 static_cast<unsigned long long>(file_mib), file_path.c_str(),
                 fs_type(dir).c_str());
    make_file(file_path, file_mib * kMiB, data, size);
    std::fprintf(stderr, "page-cache file, median of %d:\n", reps);
    for (int threads : {1, 2}) {
      rows.push_back(
          time_file("pread only (no hash)", reps, file_path, file_mib * kMiB, threads, false));
      rows.push_back(
          time_file("pread + XXH3-128", reps, file_path, file_mib * kMiB, threads, true));
    }
  }
  ::munmap(mem, size);

  struct utsname u {};
  ::uname(&u);
  std::printf("Machine: %s, %u online CPU(s), kernel %s. xxHash %u.%u.%u, the static library "
              "gpusnap links. File in %s (%s). Load average at start %s, at end %s. Each row: "
              "median of %d runs; GB = 10^9 bytes. GB/s is wall-clock; per CPU-second divides by "
              "the CPU time "
              "the benchmark itself used (the two differ when other work shares the cores).\n\n",
              cpu_model().c_str(), std::thread::hardware_concurrency(), u.release,
              XXH_VERSION_MAJOR, XXH_VERSION_MINOR, XXH_VERSION_RELEASE, dir.c_str(),
              fs_type(dir).c_str(), load_at_start.c_str(), loadavg().c_str(), reps);
  std::printf("| Checksum | Input | Threads | GB/s | GB/s per CPU-second | Seconds per GiB "
              "| Notes |\n");
  std::printf("|---|---|---:|---:|---:|---:|---|\n");
  for (const auto& r : rows) {
    std::printf("| %s | %s | %d | %.2f | %.2f | %.3f | %s |\n", r.name.c_str(), r.input.c_str(),
                r.threads, gb(r.bytes) / r.seconds, gb(r.bytes) / r.cpu_seconds,
                r.seconds * static_cast<double>(1ull << 30) / static_cast<double>(r.bytes),
                r.note.c_str());
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const Failure& e) {
    std::fprintf(stderr, "gpusnap-checksum-bench: %s\n", e.what());
    if (e.code == 2) usage();
    return e.code;
  }
}
