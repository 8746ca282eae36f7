// gpusnap-test-workload: the process tree that gpusnap's tests checkpoint and restore with CRIU.
//
// It holds one of each kind of state a snapshot must carry -- anonymous memory with a pattern
// derived from a random per-start seed, worker threads, child processes joined by socketpairs,
// a listening TCP socket, a regular file with a file offset, a flock, an unlinked ("ghost") file,
// unread data in a pipe, optionally an io_uring instance -- and answers a small line protocol on
// 127.0.0.1 whose CHECK command verifies all of it from the inside. A copy restored from a
// snapshot reports the source's seed (proof that its memory came from the snapshot) and the
// source's pid (pids are restored inside the fresh PID namespace).
//
// Everything uses plain blocking syscalls, poll and std::thread, which CRIU can capture; the
// io_uring instance (--io-uring) exists only to check that gpusnap refuses such a workload.
// Descriptors inherited from the starter (other than stdio) are closed at start, so that none
// ends up in the snapshot. See tests/workload/README.md for the protocol and the flags.

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#ifndef SYS_io_uring_setup
#define SYS_io_uring_setup 425  // same number on every architecture using the generic table
#endif

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr std::string_view kProgram = "gpusnap-test-workload";
constexpr std::string_view kPipePayload = "pipe-payload\n";  // 13 bytes, left unread in a pipe
constexpr std::size_t kFileSize = 1 << 20;                   // --file content size
constexpr off_t kFileOffset = (512 << 10) + 13;              // --file offset kept mid-file
constexpr std::size_t kUnlinkedSize = 64 << 10;              // --unlinked content size
constexpr std::size_t kChildBytes = 8 << 20;                 // each child's pattern
constexpr std::size_t kMaxLine = 4096;                       // longest accepted command line
constexpr auto kHeartbeatWindow = 200ms;                     // CHECK: heartbeats must advance
constexpr int kChildReplyTimeoutMs = 2000;                   // CHECK: per child ping

// Exit codes.
constexpr int kExitOk = 0;
constexpr int kExitSetup = 1;
constexpr int kExitUsage = 2;
constexpr int kExitIoUring = 3;

// ---------------------------------------------------------------------------------------------
// Small RAII helpers.

// Owns one file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Owns one private anonymous mapping, viewed as 64-bit words.
class Mapping {
 public:
  Mapping() = default;
  explicit Mapping(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ == 0) return;
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw std::system_error(errno, std::generic_category(),
                              "mmap " + std::to_string(bytes_) + " bytes");
    addr_ = p;
  }
  Mapping(Mapping&& other) noexcept
      : addr_(std::exchange(other.addr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  Mapping& operator=(Mapping&& other) noexcept {
    if (this != &other) {
      release();
      addr_ = std::exchange(other.addr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { release(); }

  std::uint64_t* words() const noexcept { return static_cast<std::uint64_t*>(addr_); }
  std::size_t word_count() const noexcept { return bytes_ / sizeof(std::uint64_t); }

 private:
  void release() noexcept {
    if (addr_ != nullptr) ::munmap(addr_, bytes_);
    addr_ = nullptr;
  }
  void* addr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Thrown by setup; `code` becomes the exit status.
struct SetupError : std::runtime_error {
  SetupError(int exit_code, const std::string& what) : std::runtime_error(what), code(exit_code) {}
  int code;
};

// "<what>: <strerror(errno)>", thread-safe (CHECK runs on connection threads).
std::string errno_text(std::string_view what) {
  return std::string(what) + ": " + std::error_code(errno, std::generic_category()).message();
}

[[noreturn]] void fail_setup(std::string_view what) {
  throw SetupError(kExitSetup, errno_text(what));
}

std::string hex16(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Deterministic content.

std::uint64_t splitmix64(std::uint64_t x) {
  std::uint64_t z = x + 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Memory pattern: word i holds splitmix64(i ^ seed).
void fill_pattern(const Mapping& m, std::uint64_t seed) {
  std::uint64_t* w = m.words();
  for (std::size_t i = 0, n = m.word_count(); i < n; ++i) w[i] = splitmix64(i ^ seed);
}

// Index of the first word that differs from the pattern, if any.
std::optional<std::size_t> pattern_mismatch(const Mapping& m, std::uint64_t seed) {
  const std::uint64_t* w = m.words();
  for (std::size_t i = 0, n = m.word_count(); i < n; ++i)
    if (w[i] != splitmix64(i ^ seed)) return i;
  return std::nullopt;
}

// File content: 32-byte text records "<prefix><zero-padded record index>\n", so that a test (or
// a human with `head`) can recognise it; e.g. "gpusnap-file 000000000000000042\n".
std::string record_content(std::string_view prefix, std::size_t size) {
  constexpr std::size_t kRecord = 32;
  const std::size_t digits = kRecord - 1 - prefix.size();
  std::string out;
  out.reserve(size);
  char num[32];
  for (std::size_t i = 0; out.size() < size; ++i) {
    std::snprintf(num, sizeof num, "%0*zu", static_cast<int>(digits), i);
    out.append(prefix).append(num).push_back('\n');
  }
  out.resize(size);
  return out;
}

std::string file_content() { return record_content("gpusnap-file ", kFileSize); }
std::string unlinked_content() { return record_content("gpusnap-unlinked ", kUnlinkedSize); }

// ---------------------------------------------------------------------------------------------
// Syscall helpers.

// Writes all of `data` (blocking fd), retrying on EINTR / short writes.
bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Sends all of `data` on a socket without raising SIGPIPE.
bool send_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Reads exactly `size` bytes at `offset`; nullopt on error or short file.
std::optional<std::string> pread_exact(int fd, std::size_t size, off_t offset) {
  std::string buf(size, '\0');
  std::size_t got = 0;
  while (got < size) {
    ssize_t n = ::pread(fd, buf.data() + got, size - got, offset + static_cast<off_t>(got));
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::nullopt;
    }
    if (n == 0) return std::nullopt;
    got += static_cast<std::size_t>(n);
  }
  return buf;
}

std::optional<std::string> read_small_file(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return std::nullopt;
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::nullopt;
    }
    if (n == 0) return out;
    out.append(buf, static_cast<std::size_t>(n));
  }
}

pid_t current_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

template <typename T>
std::optional<T> parse_number(std::string_view s) {
  T v{};
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

// Thread ids of this process as seen from its own PID namespace. /proc may belong to another
// PID namespace than ours (e.g. a restore where /proc was not remounted), so each task's id is
// taken from the last field of "NSpid:" in its status file -- the id in the innermost namespace,
// which is what gettid() returns -- and the directory name is used only when NSpid is missing.
std::set<pid_t> own_thread_ids() {
  std::set<pid_t> tids;
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir("/proc/self/task"), &::closedir);
  if (!dir) return tids;
  while (dirent* e = ::readdir(dir.get())) {
    auto dir_tid = parse_number<pid_t>(e->d_name);
    if (!dir_tid) continue;
    pid_t tid = *dir_tid;
    if (auto status = read_small_file("/proc/self/task/" + std::string(e->d_name) + "/status")) {
      std::string_view s = *status;
      if (auto pos = s.find("\nNSpid:"); pos != std::string_view::npos) {
        std::string_view line = s.substr(pos + 7);
        line = line.substr(0, line.find('\n'));
        auto last = line.find_last_of(" \t");
        if (auto v =
                parse_number<pid_t>(line.substr(last == std::string_view::npos ? 0 : last + 1)))
          tid = *v;
      }
    }
    tids.insert(tid);
  }
  return tids;
}

// ---------------------------------------------------------------------------------------------
// Child processes.

std::uint64_t child_seed(std::uint64_t seed, unsigned index) {
  return splitmix64(seed ^ (0xc41d000000000000ULL + index));
}

// Body of a child: holds its own pattern and answers "ping\n" with "pong <ok|bad> <pid>\n".
// It exits on EOF or error on its socket, i.e. when the parent is gone. PR_SET_PDEATHSIG is not
// used: CRIU does not restore it in a useful way, and the socketpair gives the same signal.
[[noreturn]] void child_main(Fd sock, std::uint64_t seed) {
  ::prctl(PR_SET_NAME, "tw-child", 0, 0, 0);
  Mapping mem;
  try {
    mem = Mapping(kChildBytes);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: child: %s\n", kProgram.data(), e.what());
    ::_exit(kExitSetup);
  }
  fill_pattern(mem, seed);

  std::string buf;
  char chunk[256];
  for (;;) {
    ssize_t n = ::read(sock.get(), chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) ::_exit(kExitOk);  // parent closed its end or died
    buf.append(chunk, static_cast<std::size_t>(n));
    for (std::size_t nl; (nl = buf.find('\n')) != std::string::npos; buf.erase(0, nl + 1)) {
      std::string reply;
      if (std::string_view(buf).substr(0, nl) == "ping") {
        const bool ok = !pattern_mismatch(mem, seed);
        reply = std::string("pong ") + (ok ? "ok " : "bad ") + std::to_string(::getpid()) + "\n";
      } else {
        reply = "err unknown\n";
      }
      if (!send_all(sock.get(), reply)) ::_exit(kExitOk);
    }
    if (buf.size() > kMaxLine) ::_exit(kExitSetup);
  }
}

struct Child {
  pid_t pid = -1;
  Fd sock;  // parent's end of the socketpair
};

// ---------------------------------------------------------------------------------------------
// Options.

struct Options {
  std::uint16_t port = 0;
  std::size_t mib = 64;
  unsigned threads = 4;
  unsigned children = 1;
  std::string file;
  std::string lock_file;
  std::string unlinked_dir;
  bool io_uring = false;
  std::string ready_file;
  // Fixed memory pattern (the store's dedup tests capture two identical workloads); 0: random.
  std::uint64_t seed = 0;
  // Tensor-like buffers of 1-10 MiB and more, one mapping each, allocated in an order drawn from
  // `order` (0: by index): the same bytes at other addresses, as a model loaded twice.
  unsigned tensors = 0;
  std::uint64_t order = 0;
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: %s [--port N] [--mib N] [--threads N] [--children N] [--file PATH]\n"
               "       [--lock-file PATH] [--unlinked DIR] [--io-uring] [--ready-file PATH]\n"
               "       [--seed N] [--tensors N] [--order N]\n"
               "Test workload for gpusnap; see tests/workload/README.md.\n",
               kProgram.data());
}

Options parse_options(int argc, char** argv) {
  Options o;
  auto usage_error = [](const std::string& msg) -> SetupError {
    return SetupError(kExitUsage, msg + " (try --help)");
  };
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    std::string_view value;
    bool has_inline_value = false;
    if (auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_inline_value = true;
    }
    auto take_value = [&]() -> std::string_view {
      if (has_inline_value) return value;
      if (i + 1 >= argc) throw usage_error(std::string(arg) + " needs a value");
      return argv[++i];
    };
    auto take_uint = [&](unsigned long max) -> unsigned long {
      std::string_view v = take_value();
      auto n = parse_number<unsigned long>(v);
      if (!n || *n > max)
        throw usage_error(std::string(arg) + ": expected an integer in [0, " + std::to_string(max) +
                          "], got '" + std::string(v) + "'");
      return *n;
    };
    auto take_path = [&]() -> std::string {
      std::string_view v = take_value();
      if (v.empty()) throw usage_error(std::string(arg) + " needs a non-empty path");
      return std::string(v);
    };

    if (arg == "--help" || arg == "-h") {
      print_usage(stdout);
      std::exit(kExitOk);
    } else if (arg == "--port") {
      o.port = static_cast<std::uint16_t>(take_uint(65535));
    } else if (arg == "--mib") {
      o.mib = take_uint(1 << 20);
    } else if (arg == "--threads") {
      o.threads = static_cast<unsigned>(take_uint(1024));
    } else if (arg == "--children") {
      o.children = static_cast<unsigned>(take_uint(256));
    } else if (arg == "--file") {
      o.file = take_path();
    } else if (arg == "--lock-file") {
      o.lock_file = take_path();
    } else if (arg == "--unlinked") {
      o.unlinked_dir = take_path();
    } else if (arg == "--ready-file") {
      o.ready_file = take_path();
    } else if (arg == "--seed") {
      o.seed = take_uint(UINT64_MAX);
    } else if (arg == "--tensors") {
      o.tensors = static_cast<unsigned>(take_uint(1024));
    } else if (arg == "--order") {
      o.order = take_uint(UINT64_MAX);
    } else if (arg == "--io-uring" && !has_inline_value) {
      o.io_uring = true;
    } else {
      throw usage_error("unknown argument '" + std::string(argv[i]) + "'");
    }
  }
  return o;
}

// ---------------------------------------------------------------------------------------------
// The workload.

// One heartbeat thread's shared state; cache-line aligned so that threads don't contend.
struct alignas(64) Worker {
  std::atomic<std::uint64_t> beats{0};
  std::atomic<pid_t> tid{0};
};

class Workload {
 public:
  explicit Workload(Options opts) : opts_(std::move(opts)) {}

  // Builds all state. Children are forked first, while the process is single-threaded and holds
  // no descriptors beyond stdio and the children's sockets, so that each child inherits nothing
  // but its own socket (no shared flock, no copy-on-write share of the big mapping).
  void setup() {
    close_inherited_fds();
    seed_ = opts_.seed != 0 ? opts_.seed : read_seed();
    fork_children();
    block_termination_signals();
    memory_ = Mapping(opts_.mib << 20);
    fill_pattern(memory_, seed_);
    allocate_tensors();
    if (!opts_.file.empty()) open_file();
    if (!opts_.lock_file.empty()) open_lock();
    if (!opts_.unlinked_dir.empty()) open_unlinked();
    if (opts_.io_uring) open_io_uring();
    open_pipe();
    listen_tcp();
    start_workers();
    std::thread([this] { accept_loop(); }).detach();
  }

  // Announces readiness on stdout and, if asked, through the ready file (written atomically).
  void announce_ready() {
    std::printf("ready port=%u pid=%d\n", static_cast<unsigned>(port_),
                static_cast<int>(::getpid()));
    std::fflush(stdout);
    if (opts_.ready_file.empty()) return;
    const std::string tmp = opts_.ready_file + ".tmp";
    Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) fail_setup("create " + tmp);
    if (!write_all(fd.get(), std::to_string(port_) + "\n")) fail_setup("write " + tmp);
    fd.reset();  // closed before the rename: no descriptor to it stays in the snapshot
    if (::rename(tmp.c_str(), opts_.ready_file.c_str()) != 0)
      fail_setup("rename " + tmp + " to " + opts_.ready_file);
  }

  // Main thread after setup: waits for SIGTERM/SIGINT/SIGHUP, then exits cleanly.
  [[noreturn]] void wait_for_termination() {
    sigset_t set = termination_signals();
    for (;;) {
      int sig = 0;
      if (::sigwait(&set, &sig) == 0) exit_cleanly(kExitOk);
    }
  }

  // Kills and reaps the children, then exits the whole process. Safe to call from any thread;
  // later callers block until the first one has exited the process.
  [[noreturn]] void exit_cleanly(int code) {
    exit_mutex_.lock();  // never unlocked: the process ends here
    for (Child& c : children_) {
      ::kill(c.pid, SIGTERM);
      // EOF also makes the child exit. shutdown(), not close(): another thread may be in CHECK.
      ::shutdown(c.sock.get(), SHUT_RDWR);
    }
    const auto deadline = Clock::now() + 2s;
    for (Child& c : children_) {
      for (;;) {
        pid_t r = ::waitpid(c.pid, nullptr, WNOHANG);
        if (r == c.pid || (r < 0 && errno != EINTR)) break;
        if (Clock::now() > deadline) {
          ::kill(c.pid, SIGKILL);
          ::waitpid(c.pid, nullptr, 0);
          break;
        }
        std::this_thread::sleep_for(5ms);
      }
    }
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(code);  // not exit(): detached threads are still running
  }

 private:
  // --- setup -----------------------------------------------------------------------------------

  // Descriptors inherited from whoever started us (a test runner's pipes, say) would end up in
  // the snapshot as external resources CRIU cannot restore on its own; only stdio is kept.
  static void close_inherited_fds() {
    std::vector<int> fds;
    if (std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir("/proc/self/fd"), &::closedir); dir) {
      while (dirent* e = ::readdir(dir.get()))
        if (auto fd = parse_number<int>(e->d_name); fd && *fd > 2 && *fd != ::dirfd(dir.get()))
          fds.push_back(*fd);
    }
    for (int fd : fds) ::close(fd);
  }

  // Tensor i: 1 MiB + (i * 397 mod 37) quarter-MiB, every fourth 16 MiB more, its words
  // splitmix64(w ^ tensor_seed(i)). Mapped in a shuffled order, so that their place in the
  // address space (and in a capture's page images) depends on --order, not on the bytes.
  void allocate_tensors() {
    std::vector<unsigned> order(opts_.tensors);
    for (unsigned i = 0; i < opts_.tensors; ++i) order[i] = i;
    std::uint64_t state = opts_.order;
    for (unsigned i = opts_.tensors; opts_.order != 0 && i > 1; --i) {
      state = splitmix64(state);
      std::swap(order[i - 1], order[state % i]);
    }
    tensors_.resize(opts_.tensors);
    for (unsigned i : order) {
      const std::size_t bytes = (std::size_t{1} << 20) + (i * 397 % 37) * (std::size_t{1} << 18) +
                                (i % 4 == 0 ? std::size_t{16} << 20 : 0);
      tensors_[i] = Mapping(bytes);
      fill_pattern(tensors_[i], splitmix64(seed_ ^ (0x7e4500000000ULL + i)));
    }
  }

  static std::uint64_t read_seed() {
    Fd fd(::open("/dev/urandom", O_RDONLY | O_CLOEXEC));
    if (!fd) fail_setup("open /dev/urandom");
    std::uint64_t seed = 0;
    if (::read(fd.get(), &seed, sizeof seed) != static_cast<ssize_t>(sizeof seed))
      fail_setup("read /dev/urandom");
    return seed;
  }

  void fork_children() {
    std::fflush(nullptr);  // nothing buffered may be written twice
    for (unsigned i = 0; i < opts_.children; ++i) {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) fail_setup("socketpair");
      Fd parent_end(sv[0]);
      Fd child_end(sv[1]);
      pid_t pid = ::fork();
      if (pid < 0) fail_setup("fork");
      if (pid == 0) {
        parent_end.reset();
        for (Child& c : children_) c.sock.reset();  // earlier children's parent ends
        child_main(std::move(child_end), child_seed(seed_, i));
      }
      children_.push_back(Child{pid, std::move(parent_end)});
    }
  }

  static sigset_t termination_signals() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    return set;
  }

  // Blocked in every thread (they inherit the mask) and consumed by sigwait() in the main thread,
  // so no async signal handler and no global flag are needed.
  static void block_termination_signals() {
    sigset_t set = termination_signals();
    if (int err = ::pthread_sigmask(SIG_BLOCK, &set, nullptr); err != 0) {
      errno = err;
      fail_setup("pthread_sigmask");
    }
  }

  void open_file() {
    file_ = Fd(::open(opts_.file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!file_) fail_setup("open " + opts_.file);
    if (!write_all(file_.get(), file_content())) fail_setup("write " + opts_.file);
    if (::lseek(file_.get(), kFileOffset, SEEK_SET) != kFileOffset)
      fail_setup("lseek " + opts_.file);
  }

  void open_lock() {
    lock_ = Fd(::open(opts_.lock_file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (!lock_) fail_setup("open " + opts_.lock_file);
    // LOCK_NB: a workload that hangs at start because someone else holds the lock would only
    // make a test time out; failing at once says what is wrong.
    while (::flock(lock_.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      fail_setup("flock(LOCK_EX) " + opts_.lock_file);
    }
  }

  void open_unlinked() {
    std::string path = opts_.unlinked_dir + "/gpusnap-workload-unlinked-XXXXXX";
    unlinked_ = Fd(::mkostemp(path.data(), O_CLOEXEC));
    if (!unlinked_) fail_setup("create a file in " + opts_.unlinked_dir);
    const bool written = write_all(unlinked_.get(), unlinked_content());
    const int write_errno = errno;
    if (::unlink(path.c_str()) != 0) fail_setup("unlink " + path);
    errno = write_errno;
    if (!written) fail_setup("write " + path);
  }

  void open_io_uring() {
    // A zeroed struct io_uring_params (120 bytes today) asks for the defaults; the buffer is
    // larger so that no kernel header is needed. Nothing is mapped: holding the fd is the point.
    std::array<std::uint32_t, 64> params{};
    long fd = ::syscall(SYS_io_uring_setup, 8U, params.data());
    if (fd < 0)
      throw SetupError(kExitIoUring, errno_text("--io-uring: io_uring_setup") +
                                         " (io_uring unavailable or disabled by "
                                         "kernel.io_uring_disabled / seccomp)");
    io_uring_ = Fd(static_cast<int>(fd));
  }

  void open_pipe() {
    int p[2];
    // Non-blocking, so that CHECK reports a pipe that lost its data instead of hanging on it.
    if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) fail_setup("pipe2");
    pipe_read_ = Fd(p[0]);
    pipe_write_ = Fd(p[1]);
    if (::write(pipe_write_.get(), kPipePayload.data(), kPipePayload.size()) !=
        static_cast<ssize_t>(kPipePayload.size()))
      fail_setup("write pipe");
  }

  void listen_tcp() {
    listener_ = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener_) fail_setup("socket");
    int one = 1;
    ::setsockopt(listener_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(opts_.port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
      fail_setup("bind 127.0.0.1:" + std::to_string(opts_.port));
    if (::listen(listener_.get(), 64) != 0) fail_setup("listen");
    socklen_t len = sizeof addr;
    if (::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0)
      fail_setup("getsockname");
    port_ = ntohs(addr.sin_port);
  }

  void start_workers() {
    workers_.reserve(opts_.threads);
    for (unsigned i = 0; i < opts_.threads; ++i) {
      auto w = std::make_unique<Worker>();
      Worker* self = w.get();
      workers_.push_back(std::move(w));
      std::thread([self, i] {
        ::pthread_setname_np(::pthread_self(), ("tw-beat-" + std::to_string(i)).c_str());
        self->tid.store(current_tid());
        for (;;) {
          self->beats.fetch_add(1, std::memory_order_relaxed);
          std::this_thread::sleep_for(1ms);
        }
      }).detach();
    }
    // Ready means every tid is recorded and every heartbeat has started.
    for (const auto& w : workers_)
      while (w->tid.load() == 0 || w->beats.load() == 0) std::this_thread::sleep_for(1ms);
  }

  // --- TCP server --------------------------------------------------------------------------------

  // One thread per connection, so that a test may hold a connection open (or SLEEP on one) while
  // it opens another.
  void accept_loop() {
    ::pthread_setname_np(::pthread_self(), "tw-accept");
    for (;;) {
      int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        // EINTR (e.g. across a checkpoint), ECONNABORTED, or transient EMFILE/ENOBUFS: retry.
        if (errno != EINTR && errno != ECONNABORTED) std::this_thread::sleep_for(10ms);
        continue;
      }
      auto conn = std::make_shared<Fd>(fd);
      try {
        std::thread([this, conn] { serve(conn->get()); }).detach();
      } catch (const std::system_error&) {
        // Could not start a thread: drop the connection (conn closes it), keep accepting.
      }
    }
  }

  void serve(int fd) {
    std::string buf;
    char chunk[4096];
    for (;;) {
      ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;  // EOF, or the connection was reset / closed by a restore
      buf.append(chunk, static_cast<std::size_t>(n));
      for (std::size_t nl; (nl = buf.find('\n')) != std::string::npos; buf.erase(0, nl + 1)) {
        std::string_view line = std::string_view(buf).substr(0, nl);
        if (line.ends_with('\r')) line.remove_suffix(1);
        if (line == "QUIT") {
          send_all(fd, "BYE\n");
          exit_cleanly(kExitOk);
        }
        if (!send_all(fd, handle(line) + "\n")) return;
      }
      if (buf.size() > kMaxLine) {
        send_all(fd, "ERR line too long\n");
        return;
      }
    }
  }

  std::string handle(std::string_view line) {
    if (line == "PING") return "PONG";
    if (line == "INFO") {
      return "pid=" + std::to_string(::getpid()) + " seed=" + hex16(seed_) +
             " mib=" + std::to_string(opts_.mib) + " threads=" + std::to_string(opts_.threads) +
             " children=" + std::to_string(opts_.children) +
             " counter=" + std::to_string(counter_.load());
    }
    if (line == "INCR") return std::to_string(counter_.fetch_add(1) + 1);
    if (line == "CHECK") return check();
    if (line.starts_with("DRIVER-MAP ")) {
      auto mib = parse_number<unsigned>(line.substr(11));
      if (!mib || *mib == 0 || *mib > 65536) return "ERR bad argument";
      // 100 bytes short of whole MiB: the driver's length is no whole number of pages either.
      return driver_map((static_cast<std::size_t>(*mib) << 20) - 100);
    }
    if (line.starts_with("SLEEP ")) {
      auto ms = parse_number<unsigned>(line.substr(6));
      if (!ms || *ms > 3'600'000) return "ERR bad argument";
      std::this_thread::sleep_for(std::chrono::milliseconds(*ms));
      return "SLEPT";
    }
    return "ERR unknown command";
  }

  // --- DRIVER-MAP
  // ---------------------------------------------------------------------------------

  // Plays the CUDA driver's checkpoint inside the process, through the C library's mmap (where
  // libgpusnap-preload.so sits when preloaded): a thread named as the driver's, one private
  // anonymous MAP_POPULATE mapping, then the "GPU contents" written into it front to back.
  std::string driver_map(std::size_t len) {
    std::string reply;
    std::thread driver([&] {
      ::prctl(PR_SET_NAME, "cuda-checkpoint", 0, 0, 0);
      void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
      if (p == MAP_FAILED) {
        reply = "ERR mmap: " + std::string(std::strerror(errno));
        return;
      }
      auto* words = static_cast<std::uint64_t*>(p);
      for (std::size_t i = 0; i < len / 8; ++i) words[i] = driver_word(i);
      char hex[32];
      std::snprintf(hex, sizeof hex, "%lx", reinterpret_cast<unsigned long>(p));
      reply = std::string("addr=") + hex;
    });
    driver.join();
    return reply;
  }

  // Word `index` of DRIVER-MAP's contents: every fourth 4 MiB block zero, the rest a mix of the
  // index (tests/engine/host_images_system_test.cc checks the same words).
  static std::uint64_t driver_word(std::uint64_t index) {
    if ((index * 8 / (4u << 20)) % 4 == 3) return 0;
    std::uint64_t z = index + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    return z ^ (z >> 27);
  }

  // --- CHECK -------------------------------------------------------------------------------------

  std::string check() {
    // Serialised: the pipe round trip and the child pings must not interleave.
    std::lock_guard guard(check_mutex_);
    std::vector<std::string> failures;
    auto add = [&failures](std::optional<std::string> f) {
      if (f) failures.push_back(std::move(*f));
    };
    add(check_memory());
    add(check_threads());
    add(check_file());
    add(check_pipe());
    add(check_children());
    add(check_unlinked());
    add(check_lock());
    if (failures.empty()) return "OK seed=" + hex16(seed_) + " pid=" + std::to_string(::getpid());
    std::string out = "FAIL";
    for (std::size_t i = 0; i < failures.size(); ++i) out += (i == 0 ? " " : "; ") + failures[i];
    return out;
  }

  std::optional<std::string> check_memory() const {
    if (auto bad = pattern_mismatch(memory_, seed_)) return "memory word " + std::to_string(*bad);
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (auto bad = pattern_mismatch(tensors_[i], splitmix64(seed_ ^ (0x7e4500000000ULL + i))))
        return "tensor " + std::to_string(i) + " word " + std::to_string(*bad);
    }
    return std::nullopt;
  }

  std::optional<std::string> check_threads() const {
    std::vector<std::uint64_t> before;
    for (const auto& w : workers_) before.push_back(w->beats.load());
    const auto deadline = Clock::now() + kHeartbeatWindow;
    std::optional<std::size_t> stalled;
    for (;;) {
      stalled.reset();
      for (std::size_t i = 0; i < workers_.size() && !stalled; ++i)
        if (workers_[i]->beats.load() == before[i]) stalled = i;
      if (!stalled || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(10ms);
    }
    if (stalled) return "thread " + std::to_string(*stalled) + " heartbeat stalled";
    const std::set<pid_t> tids = own_thread_ids();
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      pid_t tid = workers_[i]->tid.load();
      if (!tids.contains(tid))
        return "thread " + std::to_string(i) + " tid " + std::to_string(tid) + " missing";
    }
    return std::nullopt;
  }

  std::optional<std::string> check_file() const {
    if (!file_) return std::nullopt;
    off_t pos = ::lseek(file_.get(), 0, SEEK_CUR);
    if (pos != kFileOffset) return "file offset " + std::to_string(pos);
    auto data = pread_exact(file_.get(), kFileSize, 0);
    if (!data) return errno_text("file pread");
    if (*data != file_content()) return std::string("file content");
    return std::nullopt;
  }

  // Reads the payload out of the pipe and writes back what was read, so that the pipe holds the
  // same bytes after a CHECK as before it.
  std::optional<std::string> check_pipe() {
    char buf[64];
    ssize_t n;
    do n = ::read(pipe_read_.get(), buf, sizeof buf);
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN) return std::string("pipe empty");
    if (n < 0) return errno_text("pipe read");
    if (n > 0 && ::write(pipe_write_.get(), buf, static_cast<std::size_t>(n)) != n)
      return errno_text("pipe write back");
    if (std::string_view(buf, static_cast<std::size_t>(n)) != kPipePayload)
      return "pipe content (" + std::to_string(n) + " bytes)";
    return std::nullopt;
  }

  std::optional<std::string> check_children() {
    for (std::size_t i = 0; i < children_.size(); ++i)
      if (auto f = ping_child(children_[i])) return "child " + std::to_string(i) + " " + *f;
    return std::nullopt;
  }

  static std::optional<std::string> ping_child(const Child& c) {
    const int fd = c.sock.get();
    // Drop a late reply left over from an earlier ping that timed out.
    char junk[256];
    while (::recv(fd, junk, sizeof junk, MSG_DONTWAIT) > 0) {
    }
    if (!send_all(fd, "ping\n")) return errno_text("send");
    std::string reply;
    const auto deadline = Clock::now() + std::chrono::milliseconds(kChildReplyTimeoutMs);
    while (reply.find('\n') == std::string::npos) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return std::string("timeout");
      pollfd pfd{fd, POLLIN, 0};
      int r = ::poll(&pfd, 1, static_cast<int>(left.count()));
      if (r < 0 && errno != EINTR) return errno_text("poll");
      if (r <= 0) continue;
      char chunk[128];
      ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n == 0) return std::string("gone");
      if (n < 0 && errno != EINTR) return errno_text("recv");
      if (n > 0) reply.append(chunk, static_cast<std::size_t>(n));
    }
    reply.resize(reply.find('\n'));
    if (reply != "pong ok " + std::to_string(c.pid)) return "replied '" + reply + "'";
    return std::nullopt;
  }

  std::optional<std::string> check_unlinked() const {
    if (!unlinked_) return std::nullopt;
    auto data = pread_exact(unlinked_.get(), kUnlinkedSize, 0);
    if (!data) return errno_text("unlinked pread");
    if (*data != unlinked_content()) return std::string("unlinked content");
    return std::nullopt;
  }

  // The kernel lists the locks held through a descriptor as "lock:" lines in its fdinfo, e.g.
  // "lock:\t1: FLOCK  ADVISORY  WRITE 1234 00:2e:5678 0 EOF".
  std::optional<std::string> check_lock() const {
    if (!lock_) return std::nullopt;
    const std::string path = "/proc/self/fdinfo/" + std::to_string(lock_.get());
    auto info = read_small_file(path);
    if (!info) return errno_text("read " + path);
    std::string_view rest = *info;
    while (!rest.empty()) {
      std::string_view line = rest.substr(0, rest.find('\n'));
      rest.remove_prefix(std::min(rest.size(), line.size() + 1));
      if (line.starts_with("lock:") && line.find("FLOCK") != std::string_view::npos &&
          line.find("WRITE") != std::string_view::npos)
        return std::nullopt;
    }
    return std::string("flock not held");
  }

  // --- state -------------------------------------------------------------------------------------

  const Options opts_;
  std::uint64_t seed_ = 0;
  std::vector<Child> children_;
  Mapping memory_;
  std::vector<Mapping> tensors_;  // by index, whatever the order they were mapped in
  Fd file_;
  Fd lock_;
  Fd unlinked_;
  Fd io_uring_;
  Fd pipe_read_;
  Fd pipe_write_;
  Fd listener_;
  std::uint16_t port_ = 0;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<std::uint64_t> counter_{0};
  std::mutex check_mutex_;
  std::mutex exit_mutex_;
};

}  // namespace

int main(int argc, char** argv) {
  // Replies go to peers that may have hung up; a write error is handled where it happens.
  ::signal(SIGPIPE, SIG_IGN);
  std::optional<Workload> workload;
  try {
    workload.emplace(parse_options(argc, argv));
    workload->setup();
    workload->announce_ready();
  } catch (const SetupError& e) {
    std::fprintf(stderr, "%s: error: %s\n", kProgram.data(), e.what());
    if (e.code == kExitUsage) print_usage(stderr);
    std::fflush(stderr);
    // _exit: worker threads may already run; children exit on EOF of their sockets.
    ::_exit(e.code);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", kProgram.data(), e.what());
    std::fflush(stderr);
    ::_exit(kExitSetup);
  }
  workload->wait_for_termination();
}
