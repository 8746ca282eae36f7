// Nodes of a cluster, stood up on one host for the tests: each node a network namespace of its
// own, linked to the host by a veth pair. The links are point-to-point, as a PPP server sets
// them up: the host end of every link carries the one host address, the node end its node's.
//
//     host  N+1 ══ veth ══ node 0: N+2        (N: a /29 of 10.213.0.0/16 that this object
//               ══ veth ══ node 1: N+3         holds: free on the host, locked against
//                                              other test processes)
//
// A service on the host listening at host_address() (the registry) is reached from every node
// and from the host itself; a node's services are reached from the host at the node's address,
// and its loopback only from inside (run()). The namespaces have no name in /run/netns: each is
// held by a descriptor of this process, so that it (and the veth pair with it) cannot outlive
// the test even when the test process is killed: the kernel frees it with its last process.
// Destroying the object deletes the links at once. Root.
#pragma once

#include <sys/types.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common/fd.h"

namespace gpusnap::testing {

// One node: its namespace, its address, the host end of its link.
class Node {
 public:
  Node(const std::string& link, const std::string& host_address, const std::string& address);
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;
  ~Node();  // deletes the link (both ends; its host address with it), closes the namespace

  const std::string& address() const { return address_; }
  const std::string& link() const { return link_; }  // the host end's name
  // The namespace's file, for `nsenter --net=` and `ip ... netns` (/proc/PID/fd/N).
  std::string ns_file() const;
  // Its inode: what /proc/PID/ns/net of a process in it names.
  ino_t inode() const;
  // `argv` run inside the namespace (nsenter, which execs it: the pid is the program's).
  std::vector<std::string> enter(const std::vector<std::string>& argv) const;

  // Runs `fn` on a thread inside the namespace (setns(2) moves that thread alone): the sockets
  // it opens are the node's, 127.0.0.1 its loopback. Rethrows what `fn` throws.
  template <class Fn>
  auto run(Fn fn) const -> std::invoke_result_t<Fn> {
    using R = std::invoke_result_t<Fn>;
    std::exception_ptr error;
    std::optional<std::conditional_t<std::is_void_v<R>, bool, R>> out;
    std::thread([&] {
      try {
        join_on_this_thread();
        if constexpr (std::is_void_v<R>) {
          fn();
        } else {
          out.emplace(fn());
        }
      } catch (...) {
        error = std::current_exception();
      }
    }).join();
    if (error) std::rethrow_exception(error);
    if constexpr (!std::is_void_v<R>) return std::move(*out);
  }

 private:
  void join_on_this_thread() const;

  std::string link_, address_;
  common::UniqueFd ns_;
};

class NodeNetwork {
 public:
  // Why it cannot be set up here (not root, no `ip` or `nsenter`); nullopt when it can.
  static std::optional<std::string> blocker();

  // `count` nodes (1 to 5). Throws std::runtime_error with the failing command's output.
  explicit NodeNetwork(int count);
  NodeNetwork(const NodeNetwork&) = delete;
  NodeNetwork& operator=(const NodeNetwork&) = delete;
  ~NodeNetwork();

  const std::string& host_address() const { return host_address_; }
  const Node& node(size_t i) const { return *nodes_.at(i); }

 private:
  common::UniqueFd lock_;  // the /29's lock: released last, after the links are gone
  std::string host_address_;
  std::vector<std::unique_ptr<Node>> nodes_;
};

// The inode of /proc/PID/ns/net: the network namespace process `pid` is in (0 when gone).
ino_t net_namespace_of(pid_t pid);

}  // namespace gpusnap::testing
