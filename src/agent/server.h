// The agent's HTTP API (docs/design.md, "The agent") on cpp-httplib: a Unix socket for local
// callers, and optionally a TCP listener that requires a bearer token. Translates requests to
// the Agent and its answers and Errors back to HTTP; decides nothing itself.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "agent/agent.h"
#include "agent/tcp_front.h"

namespace httplib {
class Server;
}

namespace gpusnap::agent {

struct ListenOptions {
  std::string socket_path = "/run/gpusnap/agent.sock";
  std::optional<gid_t> socket_group;  // the socket is root:GROUP 0660; without: root:root 0660
  std::string tcp_address;            // empty: no TCP listener
  int tcp_port = 0;                   // 0: any free port (see Server::tcp_port)
  std::string token;                  // required on TCP
};

class Server {
 public:
  // Binds the Unix socket (and the TCP listener). Call before any thread is started: the
  // socket is created under a umask, so that it is never reachable with a wider mode. Refuses
  // (Error kEnvironment) a socket path another agent is serving. Throws Error.
  explicit Server(const ListenOptions& options);
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  // Stops serving and removes the socket.
  ~Server();

  // Serves `agent` on threads of its own until stop().
  void start(Agent& agent);
  void stop() noexcept;
  int tcp_port() const { return tcp_port_; }

 private:
  ListenOptions options_;
  std::unique_ptr<httplib::Server> unix_;
  // TCP callers reach unix_ through the front, once their token is checked.
  std::unique_ptr<TcpFront> tcp_;
  int tcp_port_ = 0;
  // Set when a listener's loop has returned: stop() repeats httplib's stop() until then, since
  // a stop() that comes before the loop has begun is not remembered.
  std::atomic<bool> unix_done_{false};
  std::jthread unix_thread_;
};

}  // namespace gpusnap::agent
