#include "testing/node_network.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>

#include "common/subprocess.h"
#include "gpusnap/error.h"

namespace gpusnap::testing {

namespace {

// 10.213.0.0/16, cut into /29s: one per NodeNetwork alive on the host.
constexpr uint32_t kRange = (10U << 24) | (213U << 16);
constexpr uint32_t kSlots = 1U << 13;
constexpr int kMaxNodes = 5;  // a /29: the network, the host, five nodes, the broadcast

std::string dotted(uint32_t address) {
  in_addr a{htonl(address)};
  char text[INET_ADDRSTRLEN];
  return ::inet_ntop(AF_INET, &a, text, sizeof text);
}

void must_run(const std::vector<std::string>& argv) {
  auto r = common::run_capture(argv, std::chrono::seconds(30));
  if (!r.status.ok()) {
    std::string line;
    for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
    throw std::runtime_error(line + " failed (" + r.status.describe() + "): " + r.output);
  }
}

// The slot's lock: a socket bound to an abstract name, which the kernel releases when the
// socket closes, the process's death included; no file is left behind. Invalid when another
// process holds it.
common::UniqueFd lock_slot(uint32_t slot) {
  common::UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const int n = std::snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "gpusnap-test-nodes-%u", slot);
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&a), len) != 0) return {};
  return s;
}

// Whether the host already has an address in the /29 (left by someone else, or by a network
// being torn down) or a link with one of the names this slot would make.
bool in_use(uint32_t base, const std::vector<std::string>& links) {
  for (const auto& name : links) {
    if (::if_nametoindex(name.c_str()) != 0) return true;
  }
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return true;
  bool used = false;
  for (auto* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    const uint32_t a = ntohl(reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr);
    used = used || (a & ~7U) == base;
  }
  ::freeifaddrs(list);
  return used;
}

std::vector<std::string> link_names(uint32_t slot, int count) {
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(count));
  char hex[8];
  std::snprintf(hex, sizeof hex, "%04x", slot);
  for (int i = 0; i < count; ++i)
    out.push_back("gsnap" + std::string(hex) + "-" + std::to_string(i));
  return out;
}

}  // namespace

Node::Node(const std::string& link, const std::string& host_address, const std::string& address)
    : link_(link), address_(address) {
  // unshare(2) moves only the calling thread: a thread of its own makes the namespace, and the
  // descriptor keeps it once the thread is gone.
  int err = 0;
  std::thread([&] {
    if (::unshare(CLONE_NEWNET) != 0) {
      err = errno;
      return;
    }
    ns_.reset(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
    if (!ns_) err = errno;
  }).join();
  if (!ns_) throw std::runtime_error("cannot make a network namespace: " + errno_text(err));
  try {
    // The link; its far end made inside the namespace, named eth0 there as on a node.
    must_run(
        {"ip", "link", "add", link_, "type", "veth", "peer", "name", "eth0", "netns", ns_file()});
    must_run({"ip", "addr", "add", host_address + "/32", "peer", address_ + "/32", "dev", link_});
    must_run({"ip", "link", "set", link_, "up"});
    must_run(enter(
        {"ip", "addr", "add", address_ + "/32", "peer", host_address + "/32", "dev", "eth0"}));
    must_run(enter({"ip", "link", "set", "eth0", "up"}));
    must_run(enter({"ip", "link", "set", "lo", "up"}));
  } catch (...) {
    common::run_capture({"ip", "link", "del", link_});
    throw;
  }
}

Node::~Node() {
  // Either end deleted deletes the pair, and the host address on it; the kernel would do the
  // same once the namespace is freed, but later (its clean-up runs in the background).
  try {
    common::run_capture({"ip", "link", "del", link_}, std::chrono::seconds(30));
  } catch (const Error&) {
  }
}

std::string Node::ns_file() const {
  return "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(ns_.get());
}

ino_t Node::inode() const {
  struct stat st {};
  return ::fstat(ns_.get(), &st) == 0 ? st.st_ino : 0;
}

std::vector<std::string> Node::enter(const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {"nsenter", "--net=" + ns_file(), "--"};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

void Node::join_on_this_thread() const {
  if (::setns(ns_.get(), CLONE_NEWNET) != 0) {
    throw std::runtime_error("setns into node " + address_ + ": " + errno_text(errno));
  }
}

std::optional<std::string> NodeNetwork::blocker() {
  if (::geteuid() != 0) return "not root";
  for (const char* p : {"/usr/sbin/ip", "/usr/bin/nsenter"}) {
    if (::access(p, X_OK) != 0) return std::string(p) + " is missing (iproute2, util-linux)";
  }
  return std::nullopt;
}

NodeNetwork::NodeNetwork(int count) {
  if (count < 1 || count > kMaxNodes) throw std::runtime_error("1 to 5 nodes in a /29");
  // From a random slot on, the first one no other process holds and the host does not use:
  // tests of several builds run at once on one host.
  std::mt19937 random(std::random_device{}());
  const uint32_t first = random() % kSlots;
  uint32_t slot = 0;
  for (uint32_t n = 0; n < kSlots && !lock_; ++n) {
    slot = (first + n) % kSlots;
    lock_ = lock_slot(slot);
    if (lock_ && in_use(kRange + slot * 8, link_names(slot, count))) lock_.reset();
  }
  if (!lock_) throw std::runtime_error("no free /29 left in 10.213.0.0/16");
  const uint32_t base = kRange + slot * 8;
  host_address_ = dotted(base + 1);
  const auto links = link_names(slot, count);
  for (int i = 0; i < count; ++i) {
    nodes_.push_back(std::make_unique<Node>(links[i], host_address_,
                                            dotted(base + 2 + static_cast<uint32_t>(i))));
  }
}

NodeNetwork::~NodeNetwork() {
  nodes_.clear();  // the links first; the slot's lock (a member declared before) after
}

ino_t net_namespace_of(pid_t pid) {
  struct stat st {};
  const std::string path = "/proc/" + std::to_string(pid) + "/ns/net";
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

}  // namespace gpusnap::testing
