// cuda_pattern: a small CUDA workload to checkpoint and restore. It fills --gib GiB of device
// memory (cudaMalloc, in chunks of up to 1 GiB) with a pattern computed from a seed, then answers
// line commands on TCP 127.0.0.1:--port, so a test can prove that every byte survived:
//
//   PING     -> PONG
//   CHECK    -> OK seed=<hex> gib=<N> pid=<pid>     every word verified on the GPU
//               FAIL mismatches=<n>                  otherwise
//   INFO     -> INFO pid=... gib=... seed=... bytes=... chunks=... device=... uuid=... checks=...
//   CORRUPT  -> CORRUPTED word=<i>                   flips one word, so a test can see CHECK fail
//   BUSY <ms> -> BUSY ms=<ms>                        starts a kernel that spins <ms> ms and answers
//               at once: GPU work in flight, for a driver lock to wait on (or time out on)
//   QUIT     -> BYE, and the process exits 0
//
// Options: --gib N (default 4, fractions allowed), --port P (default 0: the kernel picks one),
// --seed S (default 0x5eed), --ready-file PATH (written atomically with the port once the pattern
// is on the GPU and the socket listens), --check-every-ms M (also verify every M ms on its own,
// so the GPU is busy when a checkpoint locks it; default 0: off).
//
// What it must not use, because the driver's checkpoint API cannot capture it: managed (UVM)
// memory, CUDA IPC. Send one command per connection across a checkpoint: CRIU dumps the listening
// socket, but an established connection only with --tcp-established. A command that arrives while
// the driver holds the process LOCKED waits in its CUDA call until the process is unlocked.
//
// Build: nvcc -O2 -arch=sm_90 -o cuda_pattern cuda_pattern.cu
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t kChunkBytes = size_t{1} << 30;  // several allocations, as real workloads have
constexpr size_t kMaxLine = 4096;

// Startup failures end the program: nothing useful can run without the GPU memory.
#define CUDA_OR_DIE(call)                                                                \
  do {                                                                                   \
    const cudaError_t err_ = (call);                                                     \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "cuda_pattern: %s failed: %s: %s\n", #call,                    \
                   cudaGetErrorName(err_), cudaGetErrorString(err_));                    \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// splitmix64 of (seed, word index): every word differs and depends on the seed, so a word moved,
// zeroed, or restored from another run's memory is caught.
__host__ __device__ inline uint32_t pattern_word(uint64_t seed, uint64_t index) {
  uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

__global__ void fill_kernel(uint32_t* words, size_t count, uint64_t first, uint64_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    words[i] = pattern_word(seed, first + i);
  }
}

// Keeps the GPU busy for `ns` nanoseconds of the GPU's global timer, so that a driver lock with
// a shorter timeout has work in flight that it must wait for.
__global__ void busy_kernel(uint64_t ns) {
  uint64_t start = 0;
  uint64_t now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

__global__ void verify_kernel(const uint32_t* words, size_t count, uint64_t first, uint64_t seed,
                              unsigned long long* mismatches) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  unsigned long long local = 0;  // one atomic per thread, not per word
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    if (words[i] != pattern_word(seed, first + i)) ++local;
  }
  if (local != 0) atomicAdd(mismatches, local);
}

struct Chunk {
  uint32_t* words = nullptr;
  size_t count = 0;    // words
  uint64_t first = 0;  // global index of words[0]
};

struct Options {
  double gib = 4;
  int port = 0;
  uint64_t seed = 0x5eed;
  std::string ready_file;
  int check_every_ms = 0;
};

[[noreturn]] void usage_and_exit(const char* message) {
  std::fprintf(stderr,
               "cuda_pattern: %s\nusage: cuda_pattern [--gib N] [--port P] [--seed S] "
               "[--ready-file PATH] [--check-every-ms M]\n",
               message);
  std::exit(2);
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage_and_exit(("missing value for " + arg).c_str());
    const char* value = argv[++i];
    char* end = nullptr;
    errno = 0;
    if (arg == "--gib") {
      options.gib = std::strtod(value, &end);
      if (!(options.gib > 0)) usage_and_exit("--gib must be positive");
    } else if (arg == "--port") {
      const long port = std::strtol(value, &end, 10);
      if (port < 0 || port > 65535) usage_and_exit("--port must be 0..65535");
      options.port = static_cast<int>(port);
    } else if (arg == "--seed") {
      options.seed = std::strtoull(value, &end, 0);  // decimal, or hex with 0x
    } else if (arg == "--ready-file") {
      options.ready_file = value;
      end = const_cast<char*>(value) + std::strlen(value);
    } else if (arg == "--check-every-ms") {
      options.check_every_ms = static_cast<int>(std::strtol(value, &end, 10));
      if (options.check_every_ms < 0) usage_and_exit("--check-every-ms must be >= 0");
    } else {
      usage_and_exit(("unknown option " + arg).c_str());
    }
    if (errno != 0 || end == value || *end != '\0') {
      usage_and_exit(("bad value for " + arg + ": " + value).c_str());
    }
  }
  return options;
}

class Workload {
 public:
  explicit Workload(const Options& options) : options_(options) {
    CUDA_OR_DIE(cudaSetDevice(0));
    int sms = 0;
    CUDA_OR_DIE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    blocks_ = sms * 8;

    const double wanted = std::floor(options.gib * static_cast<double>(size_t{1} << 30));
    total_words_ = static_cast<uint64_t>(wanted) / sizeof(uint32_t);
    if (total_words_ == 0) usage_and_exit("--gib is too small");

    uint64_t first = 0;
    while (first < total_words_) {
      Chunk chunk;
      chunk.first = first;
      chunk.count = static_cast<size_t>(
          std::min<uint64_t>(kChunkBytes / sizeof(uint32_t), total_words_ - first));
      CUDA_OR_DIE(cudaMalloc(&chunk.words, chunk.count * sizeof(uint32_t)));
      chunks_.push_back(chunk);
      first += chunk.count;
    }
    CUDA_OR_DIE(cudaMalloc(&mismatches_, sizeof(unsigned long long)));

    const auto start = std::chrono::steady_clock::now();
    for (const Chunk& chunk : chunks_) {
      fill_kernel<<<blocks_, kThreads>>>(chunk.words, chunk.count, chunk.first, options_.seed);
      CUDA_OR_DIE(cudaGetLastError());
    }
    CUDA_OR_DIE(cudaDeviceSynchronize());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "cuda_pattern: filled %" PRIu64 " bytes in %zu chunks in %.3f s\n",
                 bytes(), chunks_.size(), seconds);
  }

  ~Workload() {
    for (const Chunk& chunk : chunks_) cudaFree(chunk.words);
    cudaFree(mismatches_);
  }

  Workload(const Workload&) = delete;
  Workload& operator=(const Workload&) = delete;

  uint64_t bytes() const { return total_words_ * sizeof(uint32_t); }
  size_t chunks() const { return chunks_.size(); }
  uint64_t checks() const { return checks_; }

  // Verifies every word on the GPU. Returns the mismatch count, or -1 with *error set when CUDA
  // itself failed (e.g. after a broken restore).
  long long verify(std::string* error) {
    ++checks_;
    cudaError_t err = cudaMemset(mismatches_, 0, sizeof(unsigned long long));
    for (size_t i = 0; err == cudaSuccess && i < chunks_.size(); ++i) {
      const Chunk& chunk = chunks_[i];
      verify_kernel<<<blocks_, kThreads>>>(chunk.words, chunk.count, chunk.first, options_.seed,
                                           mismatches_);
      err = cudaGetLastError();
    }
    unsigned long long count = 0;
    if (err == cudaSuccess) {
      err = cudaMemcpy(&count, mismatches_, sizeof(count), cudaMemcpyDeviceToHost);
    }
    if (err != cudaSuccess) {
      *error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
      return -1;
    }
    return static_cast<long long>(count);
  }

  // Starts a kernel that spins for `ms` and returns without waiting for it.
  bool busy(int ms, std::string* error) {
    busy_kernel<<<1, 1>>>(static_cast<uint64_t>(ms) * 1000000ULL);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      *error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
      return false;
    }
    return true;
  }

  // Flips one word in the middle of the last chunk. Returns its global index, or -1.
  long long corrupt(std::string* error) {
    const Chunk& chunk = chunks_.back();
    const size_t offset = chunk.count / 2;
    uint32_t word = ~pattern_word(options_.seed, chunk.first + offset);
    const cudaError_t err =
        cudaMemcpy(chunk.words + offset, &word, sizeof(word), cudaMemcpyHostToDevice);
    if (err != cudaSuccess) {
      *error = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
      return -1;
    }
    return static_cast<long long>(chunk.first + offset);
  }

 private:
  static constexpr int kThreads = 256;

  Options options_;
  int blocks_ = 0;
  uint64_t total_words_ = 0;
  std::vector<Chunk> chunks_;
  unsigned long long* mismatches_ = nullptr;
  uint64_t checks_ = 0;
};

std::string format_uuid(const cudaUUID_t& uuid) {
  static const int kGroups[] = {8, 4, 4, 4, 12};
  static const char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  int nibble = 0;
  for (int group = 0; group < 5; ++group) {
    if (group > 0) out += '-';
    for (int i = 0; i < kGroups[group]; ++i, ++nibble) {
      const unsigned char b = static_cast<unsigned char>(uuid.bytes[nibble / 2]);
      out += kHex[nibble % 2 == 0 ? b >> 4 : b & 0xf];
    }
  }
  return out;
}

// The atomic handshake: readers never see a half-written file.
bool write_ready_file(const std::string& path, int port) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE* file = std::fopen(tmp.c_str(), "w");
  if (file == nullptr) return false;
  const bool written = std::fprintf(file, "%d\n", port) > 0 && std::fflush(file) == 0 &&
                       fsync(fileno(file)) == 0;
  const bool closed = std::fclose(file) == 0;
  if (!written || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

bool send_all(int fd, const std::string& text) {
  size_t sent = 0;
  while (sent < text.size()) {
    const ssize_t n = send(fd, text.data() + sent, text.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

struct Client {
  int fd = -1;
  std::string buffer;
};

class Server {
 public:
  Server(Workload& workload, const Options& options) : workload_(workload), options_(options) {}

  ~Server() {
    for (const Client& client : clients_) close(client.fd);
    if (listen_fd_ >= 0) close(listen_fd_);
  }

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Returns the port it listens on, or -1.
  int listen_on(int port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return -1;
    const int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return -1;
    if (listen(listen_fd_, 16) != 0) return -1;
    socklen_t length = sizeof(address);
    if (getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&address), &length) != 0) return -1;
    return ntohs(address.sin_port);
  }

  // Serves until QUIT.
  void run() {
    using Clock = std::chrono::steady_clock;
    const auto interval = std::chrono::milliseconds(options_.check_every_ms);
    auto next_check = Clock::now() + interval;
    while (!quit_) {
      std::vector<pollfd> fds;
      fds.push_back({listen_fd_, POLLIN, 0});
      for (const Client& client : clients_) fds.push_back({client.fd, POLLIN, 0});

      int timeout_ms = -1;  // no self-checks: wait for clients only
      if (interval.count() > 0) {
        const auto wait =
            std::chrono::duration_cast<std::chrono::milliseconds>(next_check - Clock::now());
        timeout_ms = static_cast<int>(std::max<long long>(0, wait.count()));
      }
      const int ready = poll(fds.data(), fds.size(), timeout_ms);
      if (ready < 0 && errno != EINTR) {
        std::perror("cuda_pattern: poll");
        return;
      }
      if (interval.count() > 0 && Clock::now() >= next_check) {
        self_check();
        next_check = Clock::now() + interval;
      }
      if (ready <= 0) continue;

      if (fds[0].revents & POLLIN) accept_client();
      // Walk backwards so that dropping a client does not shift the ones still to visit.
      for (size_t i = fds.size() - 1; i >= 1; --i) {
        if (fds[i].revents == 0) continue;
        if (!serve(clients_[i - 1])) {
          close(clients_[i - 1].fd);
          clients_.erase(clients_.begin() + static_cast<long>(i - 1));
        }
      }
    }
  }

 private:
  void accept_client() {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) clients_.push_back(Client{fd, {}});
  }

  // Reads what the client sent and answers each complete line. False: drop the client.
  bool serve(Client& client) {
    char data[1024];
    const ssize_t n = read(client.fd, data, sizeof(data));
    if (n < 0 && errno == EINTR) return true;
    if (n <= 0) return false;
    client.buffer.append(data, static_cast<size_t>(n));
    size_t newline;
    while ((newline = client.buffer.find('\n')) != std::string::npos) {
      std::string line = client.buffer.substr(0, newline);
      client.buffer.erase(0, newline + 1);
      while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
      if (!send_all(client.fd, answer(line) + "\n")) return false;
      if (quit_) return true;
    }
    return client.buffer.size() <= kMaxLine;
  }

  std::string answer(const std::string& command) {
    char text[512];
    if (command == "PING") return "PONG";
    if (command == "CHECK") {
      std::string error;
      const long long mismatches = workload_.verify(&error);
      if (mismatches < 0) return "ERR " + error;
      if (mismatches > 0) return "FAIL mismatches=" + std::to_string(mismatches);
      std::snprintf(text, sizeof(text), "OK seed=0x%" PRIx64 " gib=%g pid=%d", options_.seed,
                    options_.gib, static_cast<int>(getpid()));
      return text;
    }
    if (command == "INFO") {
      cudaDeviceProp prop{};
      std::string device = "?";
      std::string uuid = "?";
      if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
        device = prop.name;
        for (char& c : device) {
          if (c == ' ') c = '_';  // keep the line's key=value fields split by spaces
        }
        uuid = format_uuid(prop.uuid);
      }
      std::snprintf(text, sizeof(text),
                    "INFO pid=%d gib=%g seed=0x%" PRIx64 " bytes=%" PRIu64
                    " chunks=%zu device=%s uuid=%s checks=%" PRIu64 " self_check_failures=%" PRIu64,
                    static_cast<int>(getpid()), options_.gib, options_.seed, workload_.bytes(),
                    workload_.chunks(), device.c_str(), uuid.c_str(), workload_.checks(),
                    self_check_failures_);
      return text;
    }
    if (command == "CORRUPT") {
      std::string error;
      const long long word = workload_.corrupt(&error);
      if (word < 0) return "ERR " + error;
      return "CORRUPTED word=" + std::to_string(word);
    }
    if (command.rfind("BUSY ", 0) == 0) {
      char* end = nullptr;
      const long ms = std::strtol(command.c_str() + 5, &end, 10);
      if (end == command.c_str() + 5 || *end != '\0' || ms <= 0 || ms > 600000) {
        return "ERR BUSY takes milliseconds, 1..600000";
      }
      std::string error;
      if (!workload_.busy(static_cast<int>(ms), &error)) return "ERR " + error;
      return "BUSY ms=" + std::to_string(ms);
    }
    if (command == "QUIT") {
      quit_ = true;
      return "BYE";
    }
    return "ERR unknown command '" + command + "' (PING, CHECK, INFO, CORRUPT, BUSY <ms>, QUIT)";
  }

  void self_check() {
    std::string error;
    const long long mismatches = workload_.verify(&error);
    if (mismatches != 0) {
      ++self_check_failures_;
      std::fprintf(stderr, "cuda_pattern: self-check failed: %s\n",
                   mismatches < 0 ? error.c_str() : std::to_string(mismatches).c_str());
    }
  }

  Workload& workload_;
  const Options& options_;
  int listen_fd_ = -1;
  std::vector<Client> clients_;
  bool quit_ = false;
  uint64_t self_check_failures_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse_options(argc, argv);
  signal(SIGPIPE, SIG_IGN);

  Workload workload(options);
  Server server(workload, options);
  const int port = server.listen_on(options.port);
  if (port < 0) {
    std::fprintf(stderr, "cuda_pattern: cannot listen on 127.0.0.1:%d: %s\n", options.port,
                 std::strerror(errno));
    return 1;
  }
  if (!options.ready_file.empty() && !write_ready_file(options.ready_file, port)) {
    std::fprintf(stderr, "cuda_pattern: cannot write %s: %s\n", options.ready_file.c_str(),
                 std::strerror(errno));
    return 1;
  }
  std::printf("READY port=%d pid=%d gib=%g seed=0x%" PRIx64 "\n", port, static_cast<int>(getpid()),
              options.gib, options.seed);
  std::fflush(stdout);

  server.run();
  return 0;
}
