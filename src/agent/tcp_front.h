// The agent's TCP listener. TCP callers may be anyone on the network, so the agent does not
// hand their bytes to the HTTP library until they have shown the token: cpp-httplib serves
// every connection from a pool of a few threads and waits on each header line for as long as
// it keeps coming, so 40 peers sending one header line a second stalled an authorised request
// for 20 s.
//
// Here each connection gets its request head read within a deadline and a size bound; the
// bearer token is checked on that head, before any HTTP processing; an authorised request is
// then relayed, with "Connection: close", to the agent's own Unix socket, whose server does the
// rest. At most max_unauthenticated connections may be sending their head at once, and a new
// connection beyond that bound evicts the oldest of them rather than being refused: a caller
// with the token sends its head at once and is through in a round trip, so peers that trickle
// header lines only ever push each other out, never an authorised caller.
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
  int max_unauthenticated = 16;  // connections still sending their head; more evict the oldest
  int max_connections = 64;      // all connections; beyond it, refused when none can be evicted
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
  struct Connection {
    // Closed by its thread when it is done, under `mutex`: the acceptor shuts down an evicted
    // connection's socket under the same mutex, after checking `done`, so it never hits a
    // number that was closed and reused.
    std::mutex mutex;
    common::UniqueFd fd;
    std::chrono::steady_clock::time_point since;
    std::atomic<bool> authenticated{false};
    std::atomic<bool> evicted{false};
    std::atomic<bool> done{false};
    std::jthread thread;
  };

  void accept_loop();
  // Under connections_mutex_: makes room for one more connection; false when there is none.
  bool make_room();
  void serve(Connection& connection);
  void relay(int client, const std::string& head, const std::string& rest);

  std::string token_;
  std::string unix_socket_;
  TcpFrontLimits limits_;
  common::UniqueFd listener_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex connections_mutex_;
  // One thread per connection; finished ones are joined and pruned on the next accept.
  std::list<Connection> threads_;
  std::jthread acceptor_;
};

}  // namespace gpusnap::agent
