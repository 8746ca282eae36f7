#include "engine/publish.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>
#include <vector>

#include "gpusnap/error.h"
#include "gpusnap/restore.h"

namespace gpusnap {

PortPublish PortPublish::parse(const std::string& text) {
  PortPublish p;
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t colon; (colon = text.find(':', start)) != std::string::npos; start = colon + 1) {
    parts.push_back(text.substr(start, colon - start));
  }
  parts.push_back(text.substr(start));
  auto port = [&](const std::string& s) -> uint16_t {
    char* end = nullptr;
    long v = std::strtol(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || v < 0 || v > 65535) {
      throw Error(ErrorKind::kUsage, "bad port '" + s + "' in --publish " + text,
                  "use --publish PORT, HOSTPORT:PORT or ADDR:HOSTPORT:PORT");
    }
    return static_cast<uint16_t>(v);
  };
  if (parts.size() > 3) {
    throw Error(ErrorKind::kUsage, "bad --publish " + text,
                "use --publish PORT, HOSTPORT:PORT or ADDR:HOSTPORT:PORT");
  }
  p.port = port(parts.back());
  if (p.port == 0) throw Error(ErrorKind::kUsage, "--publish needs the copy's port, not 0");
  if (parts.size() >= 2) p.host_port = port(parts[parts.size() - 2]);
  if (parts.size() == 3) p.host_address = parts[0];
  return p;
}

namespace engine {

common::UniqueFd listen_on(const std::string& address, uint16_t port, uint16_t* bound) {
  common::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    throw Error(ErrorKind::kUsage, "bad address '" + address + "' in --publish",
                "give an IPv4 address such as 127.0.0.1");
  }
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw Error(
        ErrorKind::kUsage,
        "cannot publish on " + address + ":" + std::to_string(port) + ": " + errno_text(errno),
        "choose a free host port, or give only the copy's port to pick one");
  }
  if (::listen(fd.get(), 128) != 0) throw sys_error("listen", errno);
  socklen_t len = sizeof addr;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  *bound = ntohs(addr.sin_port);
  return fd;
}

}  // namespace engine
}  // namespace gpusnap
