#include "tier/handover.h"

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

sockaddr_un address(const std::filesystem::path& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.string().size() >= sizeof addr.sun_path) {
    throw handover_error("socket path too long: " + path.string());
  }
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  return addr;
}

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
  const sockaddr_un addr = address(path);
  common::UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) throw handover_error("socket", errno);
  ::unlink(path.c_str());
  if (::bind(sock.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    throw handover_error("bind " + path.string(), errno);
  }
  if (::chmod(path.c_str(), 0600) != 0 || ::listen(sock.get(), 4) != 0) {
    throw handover_error("listen on " + path.string(), errno);
  }
  return sock;
}

common::UniqueFd connect_for_handover(const std::filesystem::path& path,
                                      std::chrono::milliseconds timeout) {
  const sockaddr_un addr = address(path);
  common::UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) throw handover_error("socket", errno);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  if (::setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
      ::setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) {
    throw handover_error("setsockopt", errno);
  }
  if (::connect(sock.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
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
