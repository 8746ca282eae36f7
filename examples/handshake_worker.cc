// A small server that speaks the gpusnap handshake (docs/handshake.md), with the header-only
// client clients/include/gpusnap/handshake_client.h.
//
// It holds a "cache" (a malloc'd buffer of --cache-mib MiB standing for a GPU KV cache: big,
// and worthless in a snapshot) and state that must survive (a counter). On pause it finishes
// the command in progress, frees the cache and drops its client connections; on resume it makes
// a new cache and applies the per-copy settings ("greeting", "cache_mib").
//
//   g++ -std=c++17 -O2 -Iinclude examples/handshake_worker.cc -o handshake_worker -pthread
//   ./handshake_worker [--port N] [--cache-mib N] [--ready-file PATH]
//
// Line protocol on 127.0.0.1:PORT, one reply line per command:
//   PING -> PONG        INCR -> the counter        HELLO -> the greeting        CHECK -> OK
//   INFO -> pid=<pid> copy=<copy or -1> restored=<0|1> cache_mib=<N, 0 while released>
//           greeting=<greeting or ->
// While paused, commands other than PING and INFO answer "ERR paused".
//
// For tests: GPUSNAP_EXAMPLE_PAUSE=fail refuses to pause, GPUSNAP_EXAMPLE_PAUSE=die exits 3 on
// pause, GPUSNAP_EXAMPLE_PAUSE=slow takes 3 s to pause, GPUSNAP_EXAMPLE_NEVER_READY=1 never
// writes `ready`.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "gpusnap/handshake_client.h"

namespace {

namespace hs = gpusnap::handshake;

class Worker {
 public:
  Worker(size_t cache_mib, std::string pause_mode)
      : cache_mib_(cache_mib), pause_mode_(std::move(pause_mode)) {}

  // The cache is written, so it is really in memory. false: out of memory.
  bool make_cache() {
    cache_ = static_cast<char*>(std::malloc((cache_mib_ << 20) + 1));
    if (cache_ == nullptr) return false;
    std::memset(cache_, kFill, cache_mib_ << 20);
    return true;
  }

  bool on_pause(std::string& reason) {
    if (pause_mode_ == "die") std::exit(3);  // NOLINT(concurrency-mt-unsafe): a test of death
    if (pause_mode_ == "fail") {
      reason = "refused by test";
      return false;
    }
    // A pause that takes its time: a capture that can be interrupted while it waits.
    if (pause_mode_ == "slow") std::this_thread::sleep_for(std::chrono::seconds(3));
    std::lock_guard<std::mutex> lock(mu_);  // the command in progress finishes first
    paused_ = true;
    // A malloc this large is an mmap of its own: free() gives it back to the kernel, so it is
    // in neither the snapshot nor any copy.
    std::free(cache_);
    cache_ = nullptr;
    // A copy lives in a fresh network namespace: no client connection can follow it.
    for (int fd : connections_) ::shutdown(fd, SHUT_RDWR);
    std::fprintf(stderr, "handshake: paused, cache released\n");
    return true;
  }

  bool on_resume(const hs::ResumeContext& ctx, std::string& reason) {
    size_t mib = cache_mib_;
    if (auto it = ctx.settings.find("cache_mib"); it != ctx.settings.end()) {
      char* end = nullptr;
      mib = std::strtoul(it->second.c_str(), &end, 10);
      if (it->second.empty() || *end != '\0' || mib > (1u << 16)) {
        reason = "bad cache_mib setting '" + it->second + "'";
        return false;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    cache_mib_ = mib;
    if (!make_cache()) {
      reason = "out of memory for a " + std::to_string(mib) + " MiB cache";
      return false;  // still paused: gpusnap may try another resume
    }
    if (auto it = ctx.settings.find("greeting"); it != ctx.settings.end()) greeting_ = it->second;
    copy_ = ctx.copy;
    restored_ = ctx.restored;
    paused_ = false;
    std::fprintf(stderr, "handshake: resumed copy=%d/%d restored=%d\n", ctx.copy, ctx.copies,
                 ctx.restored ? 1 : 0);
    return true;
  }

  std::string command(const std::string& cmd) {
    std::lock_guard<std::mutex> lock(mu_);
    if (cmd == "PING") return "PONG";
    if (cmd == "INFO") {
      return "pid=" + std::to_string(::getpid()) + " copy=" + std::to_string(copy_) +
             " restored=" + (restored_ ? "1" : "0") +
             " cache_mib=" + std::to_string(cache_ != nullptr ? cache_mib_ : 0) +
             " greeting=" + (greeting_.empty() ? "-" : greeting_);
    }
    if (paused_) return "ERR paused";
    if (cmd == "INCR") return std::to_string(++counter_);
    if (cmd == "HELLO") return greeting_.empty() ? "hello" : greeting_;
    if (cmd == "CHECK") {
      for (size_t i = 0; i < (cache_mib_ << 20); ++i) {
        if (cache_[i] != kFill) return "FAIL cache";
      }
      return "OK";
    }
    return "ERR unknown command";
  }

  // One thread per connection.
  void handle(int fd) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      connections_.insert(fd);
    }
    std::string buf;
    char chunk[4096];
    ssize_t n;
    while ((n = ::recv(fd, chunk, sizeof chunk, 0)) > 0) {
      buf.append(chunk, static_cast<size_t>(n));
      for (size_t eol; (eol = buf.find('\n')) != std::string::npos;) {
        std::string line = buf.substr(0, eol);
        buf.erase(0, eol + 1);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        const std::string reply = command(line) + "\n";
        if (::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL) < 0) break;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    connections_.erase(fd);
    ::close(fd);
  }

 private:
  static constexpr char kFill = 0x5a;

  std::mutex mu_;  // one command at a time; a pause waits for it
  size_t cache_mib_;
  const std::string pause_mode_;  // GPUSNAP_EXAMPLE_PAUSE
  char* cache_ = nullptr;
  long long counter_ = 0;  // the state a snapshot must carry
  int copy_ = -1;
  bool restored_ = false;
  std::string greeting_;
  bool paused_ = false;
  std::set<int> connections_;
};

[[noreturn]] void usage() {
  std::fprintf(stderr, "usage: handshake_worker [--port N] [--cache-mib N] [--ready-file PATH]\n");
  std::exit(2);  // NOLINT(concurrency-mt-unsafe): before any thread starts
}

}  // namespace

// NOLINTNEXTLINE(bugprone-exception-escape): an example; an exception ends it, as it should
int main(int argc, char** argv) {
  unsigned long port = 0, cache_mib = 64;
  std::string ready_file;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage();
    const char* value = argv[++i];
    char* end = nullptr;
    if (arg == "--port")
      port = std::strtoul(value, &end, 10);
    else if (arg == "--cache-mib")
      cache_mib = std::strtoul(value, &end, 10);
    else if (arg == "--ready-file")
      ready_file = value;
    else
      usage();
    if (end != nullptr && (*end != '\0' || *value == '\0')) usage();
  }
  if (port > 65535 || cache_mib > (1u << 16)) usage();

  // The test knobs, read before any thread starts.
  const char* pause_mode = std::getenv("GPUSNAP_EXAMPLE_PAUSE");  // NOLINT(concurrency-mt-unsafe)
  const char* never_ready =
      std::getenv("GPUSNAP_EXAMPLE_NEVER_READY");  // NOLINT(concurrency-mt-unsafe)
  Worker worker(cache_mib, pause_mode != nullptr ? pause_mode : "");
  if (!worker.make_cache()) {
    std::fprintf(stderr, "out of memory for a %lu MiB cache\n", cache_mib);
    return 1;
  }
  const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const int one = 1;
  ::setsockopt(server, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(server, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(server, 64) != 0 ||
      ::getsockname(server, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("listen");
    return 1;
  }
  port = ntohs(addr.sin_port);

  auto handshake = hs::Client::from_environment();  // disabled without gpusnap
  handshake.serve([&](std::string& reason) { return worker.on_pause(reason); },
                  [&](const hs::ResumeContext& ctx, std::string& reason) {
                    return worker.on_resume(ctx, reason);
                  });
  if (never_ready == nullptr || std::strcmp(never_ready, "1") != 0) {
    handshake.ready();  // initialised: capturable from now on
  }
  std::printf("ready port=%lu pid=%d handshake=%s\n", port, static_cast<int>(::getpid()),
              handshake.enabled() ? "on" : "off");
  std::fflush(stdout);
  if (!ready_file.empty()) {  // PATH.tmp, then rename, like the project's test workload
    const std::string tmp = ready_file + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "we");
    if (f == nullptr || std::fprintf(f, "%lu\n", port) < 0 || std::fclose(f) != 0 ||
        std::rename(tmp.c_str(), ready_file.c_str()) != 0) {
      std::perror("ready file");
      return 1;
    }
  }

  for (;;) {
    const int fd = ::accept4(server, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) std::thread([&worker, fd] { worker.handle(fd); }).detach();
  }
}
