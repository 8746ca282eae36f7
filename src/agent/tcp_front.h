// The agent's TCP listener. TCP callers may be anyone on the network, so the agent does not
// hand their bytes to the HTTP library until they have shown the token: cpp-httplib serves
// every connection from a pool of a few threads and waits on each header line for as long as
// it keeps coming, so 40 peers sending one header line a second stalled an authorised request
// for 20 s.
//
// Here each connection gets its request head read within a deadline and a size bound, with a
// bound on how many connections may be in that state at once; the bearer token is checked on
// that head, before any HTTP processing; an authorised request is then relayed, with
// "Connection: close", to the agent's own Unix socket, whose server does the rest.
#pragma once

#include <atomic>
#include <chrono>
#include <list>
#include <mutex>
#include <string>
#include <thread>

#include "common/fd.h"

namespace gpusnap::agent {

struct TcpFrontLimits {
  std::chrono::milliseconds head_deadline{5000};  // the whole head, first byte to blank line
  size_t max_head_bytes = 16 << 10;
  int max_unauthenticated = 16;  // connections still sending their head; more are refused
  int max_connections = 64;      // all connections, authorised ones relaying included
  std::chrono::milliseconds idle_timeout{60000};  // an authorised relay with no traffic
};

class TcpFront {
 public:
  // Binds ADDRESS:PORT (port 0: any free one). Throws Error(kUsage) when it cannot.
  TcpFront(const std::string& address, int port, std::string token, std::string unix_socket,
           TcpFrontLimits limits = {});
  TcpFront(const TcpFront&) = delete;
  TcpFront& operator=(const TcpFront&) = delete;
  // Stops accepting and waits for every connection's thread.
  ~TcpFront();

  int port() const { return port_; }
  // Serves on a thread of its own until stop() or destruction.
  void start();
  void stop() noexcept;

 private:
  void accept_loop();
  void serve(UniqueFd client);
  void relay(int client, const std::string& head, const std::string& rest);

  std::string token_;
  std::string unix_socket_;
  TcpFrontLimits limits_;
  UniqueFd listener_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> unauthenticated_{0};
  std::atomic<int> connections_{0};
  struct Connection {
    std::atomic<bool> done{false};
    std::jthread thread;
  };
  std::mutex connections_mutex_;
  // One thread per connection; finished ones are joined and pruned on the next accept.
  std::list<Connection> threads_;
  std::jthread acceptor_;
};

}  // namespace gpusnap::agent
