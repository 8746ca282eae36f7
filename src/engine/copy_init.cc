#include "engine/copy_init.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <list>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/subprocess.h"
#include "container/enter.h"
#include "engine/container_init.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

void send_line(int fd, const std::string& line) {
  std::string data = line + "\n";
  (void)::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
}

void prepare_namespaces(const CopyInitSpec& spec) {
  // Our mounts must not propagate back to the host, and CRIU needs a /proc of this PID
  // namespace to find the pids it restores.
  if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    throw sys_error("make mounts private", errno);
  }
  if (::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) {
    throw sys_error("mount /proc", errno);
  }
  // A fresh network namespace starts with loopback down; CRIU's TCP checks need it up.
  common::UniqueFd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  struct ifreq ifr {};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  if (!sock || ::ioctl(sock.get(), SIOCGIFFLAGS, &ifr) != 0) throw sys_error("query lo", errno);
  ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
  if (::ioctl(sock.get(), SIOCSIFFLAGS, &ifr) != 0) throw sys_error("bring lo up", errno);
  // The workload polls its handshake directory by path: in this mount namespace that path
  // shows the copy's own directory, so copies never read each other's (or the source's)
  // requests. The path may not exist on this host yet (a copy restored elsewhere).
  if (!spec.handshake_target.empty()) {
    std::filesystem::create_directories(spec.handshake_target);
    if (::mount(spec.handshake_source.c_str(), spec.handshake_target.c_str(), nullptr, MS_BIND,
                nullptr) != 0) {
      throw sys_error("mount the copy's handshake directory", errno);
    }
  }
}

// One forwarded connection: bytes both ways between a host client and the copy's port.
struct Relay {
  common::UniqueFd outside;
  common::UniqueFd inside;
  std::string to_inside;
  std::string to_outside;
  bool outside_eof = false;
  bool inside_eof = false;
  bool connected = false;
};

bool pump(int from, std::string& buffer, bool& eof) {
  char buf[65536];
  ssize_t n = ::read(from, buf, sizeof buf);
  if (n > 0) {
    buffer.append(buf, static_cast<size_t>(n));
    return true;
  }
  if (n == 0 || (errno != EAGAIN && errno != EINTR)) eof = true;
  return n > 0;
}

bool drain(int to, std::string& buffer) {
  if (buffer.empty()) return true;
  ssize_t n = ::send(to, buffer.data(), buffer.size(), MSG_NOSIGNAL);
  if (n > 0) buffer.erase(0, static_cast<size_t>(n));
  return n >= 0 || errno == EAGAIN || errno == EINTR;
}

common::UniqueFd connect_inside(uint16_t port) {
  common::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 &&
      errno != EINPROGRESS) {
    return {};
  }
  return fd;
}

}  // namespace

int supervise(pid_t root, const std::vector<ForwardSpec>& forwards) {
  sigset_t mask;
  sigemptyset(&mask);
  for (int sig : {SIGCHLD, SIGTERM, SIGINT, SIGHUP}) sigaddset(&mask, sig);
  common::UniqueFd sfd(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
  std::list<Relay> relays;
  for (;;) {
    std::vector<pollfd> fds;
    fds.push_back({sfd.get(), POLLIN, 0});
    for (const auto& f : forwards) fds.push_back({f.listen_fd, POLLIN, 0});
    for (auto& r : relays) {
      short out_events =
          static_cast<short>((r.outside_eof ? 0 : POLLIN) | (r.to_outside.empty() ? 0 : POLLOUT));
      short in_events = static_cast<short>((r.inside_eof || !r.connected ? 0 : POLLIN) |
                                           (!r.connected || !r.to_inside.empty() ? POLLOUT : 0));
      fds.push_back({r.outside.get(), out_events, 0});
      fds.push_back({r.inside.get(), in_events, 0});
    }
    if (::poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) return 1;

    if (fds[0].revents & POLLIN) {
      signalfd_siginfo si{};
      while (::read(sfd.get(), &si, sizeof si) == sizeof si) {
        if (si.ssi_signo != SIGCHLD) ::kill(root, static_cast<int>(si.ssi_signo));
      }
      int raw;
      for (pid_t pid; (pid = ::waitpid(-1, &raw, WNOHANG)) > 0;) {
        if (pid == root) return WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
      }
    }
    // Only the relays that were polled have results in fds; ones accepted below wait for the
    // next round.
    const size_t polled = relays.size();
    for (size_t i = 0; i < forwards.size(); ++i) {
      if (!(fds[1 + i].revents & POLLIN)) continue;
      common::UniqueFd client(
          ::accept4(forwards[i].listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!client) continue;
      common::UniqueFd inside = connect_inside(forwards[i].port);
      if (!inside) continue;  // closing the client tells it the copy does not listen
      Relay relay;
      relay.outside = std::move(client);
      relay.inside = std::move(inside);
      relays.push_back(std::move(relay));
    }
    size_t k = 1 + forwards.size();
    size_t seen = 0;
    for (auto it = relays.begin(); it != relays.end() && seen < polled; k += 2, ++seen) {
      Relay& r = *it;
      short out_rev = fds[k].revents, in_rev = fds[k + 1].revents;
      bool ok = true;
      if (!r.connected && (in_rev & (POLLOUT | POLLERR | POLLHUP))) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(r.inside.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        ok = err == 0;
        r.connected = ok;
      }
      if (ok && (out_rev & (POLLIN | POLLHUP))) pump(r.outside.get(), r.to_inside, r.outside_eof);
      if (ok && r.connected && (in_rev & (POLLIN | POLLHUP))) {
        pump(r.inside.get(), r.to_outside, r.inside_eof);
      }
      if (ok && r.connected) ok = drain(r.inside.get(), r.to_inside);
      if (ok) ok = drain(r.outside.get(), r.to_outside);
      if (ok && r.connected && r.outside_eof && r.to_inside.empty()) {
        ::shutdown(r.inside.get(), SHUT_WR);
      }
      if (ok && r.inside_eof && r.to_outside.empty()) ::shutdown(r.outside.get(), SHUT_WR);
      bool done = (r.outside_eof && r.inside_eof) || (out_rev & POLLERR) ||
                  (r.inside_eof && r.to_outside.empty());
      it = (!ok || done) ? relays.erase(it) : std::next(it);
    }
  }
}

namespace {

// Runs CRIU's restore through `run`, then tells gpusnap how it went: "R <root>" (the restored
// root's pid in the copy's namespace) or "F <reason>". Returns the root, or 0 after a failure.
pid_t restore_and_report(const CopyInitSpec& spec, const std::function<common::ExitStatus()>& run) {
  pid_t root = 0;
  try {
    common::ExitStatus status = run();
    if (!status.ok()) {
      send_line(spec.control_fd, "F criu restore " + status.describe());
      return 0;
    }
    root = std::stoi(fs::read_file(spec.pidfile));
  } catch (const std::exception& e) {
    send_line(spec.control_fd, std::string("F ") + e.what());
    return 0;
  }
  for (int fd : spec.inherit_fds) ::close(fd);  // the restored tree holds them now
  send_line(spec.control_fd, "R " + std::to_string(root));
  return root;
}

// The container mode of a copy's init: the restored tree goes into a placeholder container's
// namespaces, where CRIU runs; we stay outside and only report, then hand the root over.
int restore_into_placeholder(const CopyInitSpec& spec) {
  // gpusnap's end reaches us as EOF on the control socket (we outlive it on purpose: the tree
  // is not in namespaces of ours that would end with us); CRIU must not hold that socket.
  ::fcntl(spec.control_fd, F_SETFD, FD_CLOEXEC);
  pid_t root = restore_and_report(spec, [&] {
    container::EnterSpec enter;
    enter.target = spec.into_pid;
    enter.argv = spec.criu_argv;
    enter.output = spec.criu_output;
    enter.inherit_fds = spec.inherit_fds;
    enter.pid = spec.criu_pid;
    enter.last_pid = spec.last_pid;
    enter.join_cgroups = true;  // the restored tree counts against the placeholder's limits
    return container::run_inside(enter);
  });
  if (root == 0) return 1;
  char go = 0;
  ssize_t n;
  while ((n = ::recv(spec.control_fd, &go, 1, 0)) < 0 && errno == EINTR) {
  }
  if (n != 1 || go != 'G') {
    // gpusnap gave up: the placeholder reaps what we kill and goes on waiting.
    kill_restored_tree(spec.into_pid, root);
    return 1;
  }
  if (!hand_over(spec.into_pid, root)) {
    send_line(spec.control_fd, "F the placeholder refused the restored root");
    kill_restored_tree(spec.into_pid, root);
    return 1;
  }
  send_line(spec.control_fd, "A");
  return 0;
}

}  // namespace

void become_init() {
  // SIGTERM sent from the host to a namespace init is dropped unless the init handles it: a
  // no-op handler makes it deliverable; blocking it routes it to the signalfd.
  struct sigaction sa {};
  sa.sa_handler = [](int) {};
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  sigset_t mask;
  sigemptyset(&mask);
  for (int sig : {SIGCHLD, SIGTERM, SIGINT, SIGHUP}) sigaddset(&mask, sig);
  ::pthread_sigmask(SIG_BLOCK, &mask, nullptr);
}

std::string to_json(const CopyInitSpec& spec) {
  nlohmann::json forwards = nlohmann::json::array();
  for (const auto& f : spec.forwards) forwards.push_back({{"fd", f.listen_fd}, {"port", f.port}});
  return nlohmann::json{{"criu_argv", spec.criu_argv},
                        {"pidfile", spec.pidfile.string()},
                        {"criu_output", spec.criu_output.string()},
                        {"inherit_fds", spec.inherit_fds},
                        {"forwards", forwards},
                        {"handshake_source", spec.handshake_source.string()},
                        {"handshake_target", spec.handshake_target.string()},
                        {"control_fd", spec.control_fd},
                        {"into_pid", spec.into_pid},
                        {"criu_pid", spec.criu_pid},
                        {"last_pid", spec.last_pid}}
      .dump();
}

CopyInitSpec copy_init_spec_from_json(const std::string& text) {
  auto doc = nlohmann::json::parse(text);
  CopyInitSpec spec;
  spec.criu_argv = doc.at("criu_argv").get<std::vector<std::string>>();
  spec.pidfile = doc.at("pidfile").get<std::string>();
  spec.criu_output = doc.at("criu_output").get<std::string>();
  spec.inherit_fds = doc.at("inherit_fds").get<std::vector<int>>();
  for (const auto& f : doc.at("forwards")) {
    spec.forwards.push_back({f.at("fd").get<int>(), f.at("port").get<uint16_t>()});
  }
  spec.handshake_source = doc.at("handshake_source").get<std::string>();
  spec.handshake_target = doc.at("handshake_target").get<std::string>();
  spec.control_fd = doc.at("control_fd").get<int>();
  spec.into_pid = doc.value("into_pid", 0);
  spec.criu_pid = doc.value("criu_pid", 0);
  spec.last_pid = doc.value("last_pid", 0);
  return spec;
}

int copy_init_main(const CopyInitSpec& spec) {
  if (spec.into_pid != 0) return restore_into_placeholder(spec);
  become_init();

  pid_t root = restore_and_report(spec, [&] {
    prepare_namespaces(spec);
    common::UniqueFd out(
        ::open(spec.criu_output.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
    common::SpawnOptions o;
    o.argv = spec.criu_argv;
    o.stdout_fd = out.get();
    o.stderr_fd = out.get();
    for (int fd : spec.inherit_fds) o.keep_fds.push_back({fd, fd});
    return *common::Subprocess(o).wait();
  });
  if (root == 0) return 1;
  char go = 0;
  ssize_t n;
  while ((n = ::recv(spec.control_fd, &go, 1, 0)) < 0 && errno == EINTR) {
  }
  if (n != 1 || go != 'G') return 1;  // gpusnap gave up on this copy: end it
  // Released: the copy outlives gpusnap from now on. gpusnap waits for our word that the
  // death signal is off; exiting before that would kill us with it.
  ::prctl(PR_SET_PDEATHSIG, 0);
  send_line(spec.control_fd, "A");
  ::close(spec.control_fd);
  return supervise(root, spec.forwards);
}

}  // namespace gpusnap::engine
