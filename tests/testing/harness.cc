#include "testing/harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "common/fd.h"
#include "common/fs.h"
#include "common/proc.h"
#include "criu/criu.h"
#include "gpusnap/error.h"

namespace gpusnap::testing {

std::optional<std::string> system_test_blocker() {
  if (::geteuid() != 0) return "not root";
  try {
    criu::locate();
  } catch (const Error& e) {
    return e.one_line();
  }
  return std::nullopt;
}

std::string build_path(const std::string& relative) {
  auto exe = std::filesystem::read_symlink("/proc/self/exe");
  return (exe.parent_path().parent_path() / relative).string();
}

std::string gpusnap_bin() {
  const char* env = std::getenv("GPUSNAP_BIN");
  return env != nullptr && *env != '\0' ? env : build_path("gpusnap");
}

namespace {
std::vector<std::string> test_workload_argv(std::vector<std::string> extra) {
  extra.insert(extra.begin(), build_path("tests/gpusnap-test-workload"));
  return extra;
}
}  // namespace

Workload::Workload(const TempDir& dir, std::vector<std::string> extra_args)
    : Workload(dir, test_workload_argv(std::move(extra_args)), std::chrono::seconds(30)) {}

Workload::Workload(const TempDir& dir, std::vector<std::string> argv,
                   std::chrono::seconds ready_within) {
  auto ready = dir / ("ready-" + fs::random_id().substr(0, 6));
  common::UniqueFd log(
      ::open((dir / "workload.log").c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  common::SpawnOptions o;
  o.argv = std::move(argv);
  o.argv.push_back("--ready-file");
  o.argv.push_back(ready.string());
  o.stdout_fd = log.get();
  o.stderr_fd = log.get();
  o.new_session = true;  // as a service would run: no terminal
  process_.emplace(o);
  pid_ = process_->pid();
  auto deadline = std::chrono::steady_clock::now() + ready_within;
  std::string text;
  while (!fs::try_read_file(ready, &text)) {
    if (process_->poll() || std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("test workload did not become ready: " +
                               fs::read_file(dir / "workload.log"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  port_ = static_cast<uint16_t>(std::stoi(text));
}

Workload::~Workload() { kill_tree(); }

void Workload::kill_tree() {
  if (pid_ <= 0) return;
  try {
    for (const auto& p : proc::read_tree(pid_)) ::kill(p.pid, SIGKILL);
  } catch (const Error&) {
  }
  if (process_) process_->wait(std::chrono::seconds(10));
  pid_ = 0;
}

std::string ask(uint16_t port, const std::string& line, std::chrono::milliseconds timeout) {
  common::UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return "";
  std::string msg = line + "\n";
  if (::send(fd.get(), msg.data(), msg.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(msg.size())) {
    return "";
  }
  std::string reply;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return "";
    struct pollfd p {
      fd.get(), POLLIN, 0
    };
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char c;
    ssize_t n = ::recv(fd.get(), &c, 1, 0);
    if (n <= 0) return reply.empty() ? "" : reply;
    if (c == '\n') return reply;
    reply += c;
  }
}

CliResult gpusnap(const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
  TempDir dir;
  common::UniqueFd out(::open((dir / "out").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
  common::UniqueFd err(::open((dir / "err").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
  common::SpawnOptions o;
  o.argv = {gpusnap_bin()};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.stdout_fd = out.get();
  o.stderr_fd = err.get();
  common::Subprocess p(o);
  auto status = p.wait(timeout);
  CliResult r;
  if (!status) {
    p.kill(SIGKILL);
    p.wait();
    r.exit_code = -1;
  } else {
    r.exit_code = status->exited ? status->code : 128 + status->code;
  }
  r.out = fs::read_file(dir / "out");
  r.err = fs::read_file(dir / "err");
  return r;
}

bool maps_file(pid_t pid, const std::string& name) {
  std::string maps;
  if (!fs::try_read_file("/proc/" + std::to_string(pid) + "/maps", &maps)) return false;
  for (size_t at = maps.find(name); at != std::string::npos; at = maps.find(name, at + 1)) {
    size_t end = at + name.size();
    if ((end == maps.size() || maps[end] == '\n') && at > 0 && maps[at - 1] == '/') return true;
  }
  return false;
}

std::string field(const std::string& reply, const std::string& key) {
  auto at = reply.find(key + "=");
  if (at == std::string::npos) return {};
  auto start = at + key.size() + 1;
  return reply.substr(start, reply.find(' ', start) - start);
}

std::set<std::string> pid_namespaces() {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    char link[64];
    auto ns = e.path() / "ns" / "pid";
    ssize_t n = ::readlink(ns.c_str(), link, sizeof link - 1);
    if (n > 0) out.insert(std::string(link, static_cast<size_t>(n)));
  }
  return out;
}

std::set<std::string> pid_namespaces_since(const std::set<std::string>& before) {
  std::set<std::string> out;
  for (const auto& ns : pid_namespaces()) {
    if (!before.contains(ns)) out.insert(ns);
  }
  return out;
}

void end_copy(pid_t init_pid) {
  if (init_pid <= 0) return;
  ::kill(init_pid, SIGKILL);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    // Our own child would stay a zombie (and "exist") until reaped; anyone else's fails ECHILD.
    if (::waitpid(init_pid, nullptr, WNOHANG) == init_pid || !proc::exists(init_pid)) return;
    // Another's zombie is as ended: a namespace's init turns zombie only once every process
    // of its namespace has exited, and reaping it is its parent's business. An orphan's
    // parent is PID 1, which may reap in batches (every ~1.5 s on some VMs' inits): waiting
    // for the reap would cost each restored copy that much.
    try {
      if (proc::read_process(init_pid).state == 'Z') return;
    } catch (const Error&) {
      return;  // gone between the two looks
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

bool running(pid_t pid) {
  try {
    char s = proc::read_process(pid).state;
    return s == 'R' || s == 'S' || s == 'D';
  } catch (const Error&) {
    return false;
  }
}

Copies::Copies(nlohmann::json restore_json) : doc(std::move(restore_json)) {
  if (!doc.is_object() || !doc.contains("copies")) return;
  for (const auto& c : doc["copies"]) {
    RestoredCopy copy;
    copy.pid = c.value("pid", pid_t{0});
    copy.init_pid = c.value("init_pid", pid_t{0});
    if (c.contains("ports") && !c["ports"].empty()) {
      copy.port = c["ports"][0].value("host_port", uint16_t{0});
    }
    copies.push_back(copy);
  }
}

Copies::Copies(const std::vector<CopyInfo>& restored) {
  for (const auto& c : restored) {
    copies.push_back(
        {c.host_pid, c.init_pid, c.ports.empty() ? uint16_t{0} : c.ports[0].host_port});
  }
}

Copies::~Copies() {
  for (const auto& c : copies) end_copy(c.init_pid);
}

}  // namespace gpusnap::testing
