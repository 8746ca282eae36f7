#include "agent/tcp_front.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include "agent/access.h"
#include "agent/operation.h"
#include "gpusnap/error.h"

namespace gpusnap::agent {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollStep = std::chrono::milliseconds(200);  // how soon stop() is noticed

bool send_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// A complete answer of the front itself, in the API's error form, closing the connection.
void answer(int fd, int status, const char* reason, const Error& error, bool bearer = false) {
  const std::string body = nlohmann::json{{"error", error_json(error)}}.dump(
                               2, ' ', false, nlohmann::json::error_handler_t::replace) +
                           "\n";
  std::string text = "HTTP/1.1 " + std::to_string(status) + " " + reason + "\r\n";
  if (bearer) text += "WWW-Authenticate: Bearer\r\n";
  text += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
          "\r\nConnection: close\r\n\r\n" + body;
  (void)send_all(fd, text.data(), text.size());
  // Closing with unread bytes of the request (its body) would send a reset, which may reach
  // the caller before the answer does: end our side, then read what is left, briefly.
  ::shutdown(fd, SHUT_WR);
  char buf[4096];
  size_t drained = 0;
  for (pollfd p{fd, POLLIN, 0}; drained < (64 << 10) && ::poll(&p, 1, 200) > 0;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
}

bool iequals_prefix(const std::string& line, const char* name) {
  const size_t n = std::strlen(name);
  if (line.size() < n) return false;
  for (size_t i = 0; i < n; ++i) {
    if (std::tolower(static_cast<unsigned char>(line[i])) != name[i]) return false;
  }
  return true;
}

std::string trimmed(std::string s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string::npos) return {};
  s = s.substr(first);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.pop_back();
  return s;
}

}  // namespace

TcpFront::TcpFront(const std::string& address, int port, std::string token, std::string unix_socket,
                   TcpFrontLimits limits)
    : token_(std::move(token)), unix_socket_(std::move(unix_socket)), limits_(limits) {
  auto refuse = [&](int err) {
    return Error(
        ErrorKind::kUsage,
        "cannot listen on " + address + ":" + std::to_string(port) + ": " + errno_text(err),
        "choose a free port and an address of this host");
  };
  sockaddr_storage addr{};
  socklen_t size = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (::inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    size = sizeof *v4;
  } else if (::inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    size = sizeof *v6;
  } else {
    throw refuse(EINVAL);
  }
  listener_ = common::UniqueFd(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listener_) throw refuse(errno);
  const int one = 1;
  ::setsockopt(listener_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), size) != 0 ||
      ::listen(listener_.get(), 128) != 0) {
    throw refuse(errno);
  }
  sockaddr_storage bound{};
  socklen_t bound_size = sizeof bound;
  ::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&bound), &bound_size);
  port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
}

TcpFront::~TcpFront() { stop(); }

void TcpFront::start() {
  acceptor_ = std::jthread([this] { accept_loop(); });
}

void TcpFront::stop() noexcept {
  stopping_ = true;
  if (acceptor_.joinable()) acceptor_.join();
  std::lock_guard lock(connections_mutex_);
  threads_.clear();  // joins each: they notice stopping_ within kPollStep
}

void TcpFront::accept_loop() {
  while (!stopping_) {
    pollfd p{listener_.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(kPollStep.count())) <= 0) continue;
    common::UniqueFd client(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!client) continue;
    std::lock_guard lock(connections_mutex_);
    threads_.remove_if([](const Connection& c) { return c.done.load(); });
    if (!make_room()) {
      answer(client.get(), 503, "Service Unavailable",
             Error(ErrorKind::kEnvironment, "the agent has too many connections open",
                   "try again in a few seconds"));
      continue;
    }
    auto& c = threads_.emplace_back();
    c.fd = std::move(client);
    c.since = Clock::now();
    c.thread = std::jthread([this, &c] {
      serve(c);
      // Closed now, not when pruned: a peer cut off must see its connection end.
      std::lock_guard done(c.mutex);
      c.fd.reset();
      c.done = true;
    });
  }
}

bool TcpFront::make_room() {
  int open = 0;
  int unauthenticated = 0;
  Connection* oldest = nullptr;
  for (auto& c : threads_) {
    if (c.done || c.evicted) continue;
    ++open;
    if (c.authenticated) continue;
    ++unauthenticated;
    if (oldest == nullptr || c.since < oldest->since) oldest = &c;
  }
  if (unauthenticated < limits_.max_unauthenticated && open < limits_.max_connections) {
    return true;
  }
  if (oldest == nullptr) return false;  // every slot relays an authorised request
  // Its thread wakes on the shutdown, reads end-of-file and leaves.
  oldest->evicted = true;
  std::lock_guard evict(oldest->mutex);
  if (!oldest->done) ::shutdown(oldest->fd.get(), SHUT_RDWR);
  return true;
}

void TcpFront::serve(Connection& connection) {
  const int client = connection.fd.get();
  // 1. The request head, whole, within the deadline and the size bound.
  std::string data;
  size_t head_end = std::string::npos;
  const auto deadline = connection.since + limits_.head_deadline;
  while (head_end == std::string::npos) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (stopping_ || left.count() <= 0) {
      answer(client, 408, "Request Timeout",
             Error(ErrorKind::kTimeout, "the request head did not arrive in time",
                   "send the whole request at once"));
      return;
    }
    pollfd p{client, POLLIN, 0};
    if (::poll(&p, 1,
               static_cast<int>(std::min(left, std::chrono::milliseconds(kPollStep)).count())) <=
        0) {
      continue;
    }
    char buf[4096];
    ssize_t n = ::recv(client, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the caller left, or the acceptor evicted us
    data.append(buf, static_cast<size_t>(n));
    head_end = data.find("\r\n\r\n");
    if (head_end == std::string::npos && data.size() > limits_.max_head_bytes) {
      answer(client, 431, "Request Header Fields Too Large",
             Error(ErrorKind::kUsage, "the request head is larger than 16 KiB",
                   "send a request of the agent's API"));
      return;
    }
  }
  // 2. The token, on the head alone; the head is passed on without any Connection header of
  // the caller's, so that the relay ends with the one request it has authorised.
  std::string head;
  std::string authorization;
  size_t start = 0;
  bool first = true;
  while (start < head_end) {
    size_t end = std::min(data.find("\r\n", start), head_end);
    std::string line = data.substr(start, end - start);
    start = end + 2;
    if (!first && iequals_prefix(line, "authorization:")) authorization = trimmed(line.substr(14));
    if (!first && iequals_prefix(line, "connection:")) continue;
    head += line + "\r\n";
    first = false;
  }
  if (!bearer_matches(authorization, token_)) {
    answer(client, 401, "Unauthorized",
           Error(ErrorKind::kUsage, "missing or wrong bearer token",
                 "send Authorization: Bearer TOKEN with the agent's token"),
           /*bearer=*/true);
    return;
  }
  connection.authenticated = true;
  head += "Connection: close\r\n\r\n";
  relay(client, head, data.substr(head_end + 4));
}

void TcpFront::relay(int client, const std::string& head, const std::string& rest) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, unix_socket_.c_str(),
              std::min(unix_socket_.size() + 1, sizeof addr.sun_path - 1));
  common::UniqueFd server(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!server || ::connect(server.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      !send_all(server.get(), head.data(), head.size()) ||
      !send_all(server.get(), rest.data(), rest.size())) {
    answer(client, 503, "Service Unavailable",
           Error(ErrorKind::kInternal, "the agent's own socket does not answer"));
    return;
  }
  // Both ways until the server has answered and closed (it was told Connection: close).
  bool client_open = true;
  auto idle_since = Clock::now();
  while (!stopping_ && Clock::now() - idle_since < limits_.idle_timeout) {
    // A closed client half is polled as -1: its hang-up would otherwise wake every poll.
    pollfd p[2] = {{server.get(), POLLIN, 0}, {client_open ? client : -1, POLLIN, 0}};
    if (::poll(p, 2, static_cast<int>(kPollStep.count())) <= 0) continue;
    char buf[65536];
    if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      ssize_t n = ::recv(server.get(), buf, sizeof buf, 0);
      if (n <= 0 || !send_all(client, buf, static_cast<size_t>(n))) return;
      idle_since = Clock::now();
    }
    if (client_open && (p[1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      ssize_t n = ::recv(client, buf, sizeof buf, 0);
      if (n <= 0) {
        client_open = false;
        ::shutdown(server.get(), SHUT_WR);
      } else if (!send_all(server.get(), buf, static_cast<size_t>(n))) {
        return;
      }
      idle_since = Clock::now();
    }
  }
}

}  // namespace gpusnap::agent
