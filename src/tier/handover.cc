#include "tier/handover.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

#include "gpusnap/error.h"

namespace gpusnap::tier {
namespace {

constexpr std::uint64_t kMagic = 0x31444e4850534e47;  // "GNSPHND1", little-endian

Error handover_error(const std::string& what, int err = 0) {
  return Error(ErrorKind::kInternal,
               "memory tier handover: " + what + (err != 0 ? ": " + errno_text(err) : ""));
}

// A socket's address. sun_path holds 107 bytes, and a run folder can lie deeper than that (the
// prefill's socket is RUN_DIR/prefill/restore-ID/copy-N/PID.sock): then the socket is reached
// through its folder, held open while the address is used, as /proc/self/fd/N/NAME.
class SocketAddress {
 public:
  explicit SocketAddress(const std::filesystem::path& path) {
    addr_.sun_family = AF_UNIX;
    std::string reach = path.string();
    if (reach.size() >= sizeof addr_.sun_path) {
      folder_.reset(::open(path.parent_path().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
      if (folder_.get() < 0) throw handover_error("open " + path.parent_path().string(), errno);
      reach = "/proc/self/fd/" + std::to_string(folder_.get()) + "/" + path.filename().string();
      if (reach.size() >= sizeof addr_.sun_path) {
        throw handover_error("socket name too long: " + path.string());
      }
    }
    std::memcpy(addr_.sun_path, reach.c_str(), reach.size() + 1);
  }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&addr_); }
  static socklen_t size() { return sizeof(sockaddr_un); }

 private:
  sockaddr_un addr_{};
  common::UniqueFd folder_;
};

void send_record(int sock, const std::uint64_t (&words)[2], int fd) {
  iovec iov{const_cast<std::uint64_t*>(words), sizeof words};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  ssize_t n = 0;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof words)) throw handover_error("send", n < 0 ? errno : EIO);
}

// One record; `fd` receives its descriptor (or stays empty).
void receive_record(int sock, std::uint64_t (&words)[2], common::UniqueFd& fd) {
  iovec iov{words, sizeof words};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n = 0;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) throw handover_error("receive", errno);
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int))) {
      int received = -1;
      std::memcpy(&received, CMSG_DATA(c), sizeof received);
      fd.reset(received);
    }
  }
  if (n == 0) throw handover_error("the prefill ended before its offer was complete");
  if (n != static_cast<ssize_t>(sizeof words) || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    throw handover_error("a malformed record");
  }
}

}  // namespace

common::UniqueFd listen_for_handover(const std::filesystem::path& path) {
  const SocketAddress addr(path);
  common::UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) throw handover_error("socket", errno);
  ::unlink(path.c_str());
  if (::bind(sock.get(), addr.get(), SocketAddress::size()) != 0) {
    throw handover_error("bind " + path.string(), errno);
  }
  if (::chmod(path.c_str(), 0600) != 0 || ::listen(sock.get(), 4) != 0) {
    throw handover_error("listen on " + path.string(), errno);
  }
  return sock;
}

common::UniqueFd connect_for_handover(const std::filesystem::path& path,
                                      std::chrono::milliseconds timeout) {
  const SocketAddress addr(path);
  common::UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) throw handover_error("socket", errno);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  if (::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
      ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) {
    throw handover_error("setsockopt", errno);
  }
  if (::connect(sock.get(), addr.get(), SocketAddress::size()) != 0) {
    throw handover_error("connect to " + path.string(), errno);
  }
  return sock;
}

void send_offer(int sock, const std::vector<OfferedSegment>& segments) {
  send_record(sock, {kMagic, segments.size()}, -1);
  for (const auto& s : segments) send_record(sock, {s.va, s.size}, s.fd.get());
}

std::vector<OfferedSegment> receive_offer(int sock, std::size_t max_segments) {
  std::uint64_t header[2] = {};
  common::UniqueFd none;
  receive_record(sock, header, none);
  if (header[0] != kMagic || none.get() >= 0) throw handover_error("not a prefill's offer");
  if (header[1] > max_segments) {
    throw handover_error("an offer of " + std::to_string(header[1]) + " segments, more than " +
                         std::to_string(max_segments));
  }
  std::vector<OfferedSegment> out(header[1]);
  for (auto& s : out) {
    std::uint64_t words[2] = {};
    receive_record(sock, words, s.fd);
    if (s.fd.get() < 0) throw handover_error("a segment without its descriptor");
    s.va = words[0];
    s.size = static_cast<std::size_t>(words[1]);
  }
  return out;
}

void send_answer(int sock, bool mapped) noexcept {
  const char c = mapped ? 'y' : 'n';
  (void)::send(sock, &c, 1, MSG_NOSIGNAL);
}

bool receive_answer(int sock) {
  char c = 0;
  ssize_t n = 0;
  do {
    n = ::recv(sock, &c, 1, 0);
  } while (n < 0 && errno == EINTR);
  return n == 1 && c == 'y';
}

}  // namespace gpusnap::tier
