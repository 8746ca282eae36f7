#include "store/registry_fixture.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <stdexcept>
#include <thread>

#include "common/fd.h"
#include "common/fs.h"
#include "common/subprocess.h"

namespace gpusnap::testing {

namespace {

namespace sfs = std::filesystem;

bool on_path(const std::string& program) {
  for (const char* dir : {"/usr/bin", "/usr/sbin", "/bin", "/usr/local/bin"}) {
    if (::access((std::string(dir) + "/" + program).c_str(), X_OK) == 0) return true;
  }
  return false;
}

sockaddr_in ipv4(const std::string& address, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &a.sin_addr) != 1) {
    throw std::runtime_error("not an IPv4 address: " + address);
  }
  return a;
}

// A port nobody listens on now at `address` (the kernel's pick for an ephemeral bind).
uint16_t free_port(const std::string& address) {
  common::UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a = ipv4(address, 0);
  socklen_t len = sizeof a;
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    throw std::runtime_error("cannot find a free port");
  }
  return ntohs(a.sin_port);
}

void run(const std::vector<std::string>& argv, const sfs::path& out) {
  common::UniqueFd fd(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  common::SpawnOptions o;
  o.argv = argv;
  o.stdout_fd = fd.get();
  o.stderr_fd = fd.get();
  common::Subprocess p(o);
  auto st = p.wait(std::chrono::seconds(60));
  if (!st || !st->ok()) {
    std::string log;
    fs::try_read_file(out, &log);
    throw std::runtime_error(argv[0] + " failed: " + log);
  }
}

bool answers(const std::string& address, uint16_t port) {
  common::UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a = ipv4(address, port);
  return ::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
}

}  // namespace

void openssl(const std::vector<std::string>& args) {
  std::vector<std::string> argv{"openssl"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = common::run_capture(argv);
  if (!r.status.ok()) throw std::runtime_error("openssl failed: " + r.output);
}

std::optional<std::string> LocalRegistry::blocker() {
  if (::geteuid() != 0) return "not root";
  for (const char* p : {"docker-registry", "openssl", "htpasswd", "skopeo"}) {
    if (!on_path(p)) return std::string(p) + " is not installed (scripts/install-deps)";
  }
  return std::nullopt;
}

LocalRegistry::LocalRegistry(const TempDir& dir, const Options& o)
    // A node's namespace is the registry's alone: any port there is free.
    : address_(o.node ? o.node->address() : o.address), port_(o.node ? 5000 : free_port(address_)) {
  const sfs::path base = dir / ("registry-" + fs::random_id().substr(0, 8));
  sfs::create_directories(base);
  storage_ = base / "storage";
  log_ = base / "registry.log";
  std::string config = "version: 0.1\n"
                       "log:\n  level: info\n  accesslog:\n    disabled: false\n"
                       "storage:\n  filesystem:\n    rootdirectory: " +
                       storage_.string() +
                       "\n"
                       "http:\n  addr: " +
                       host() + "\n  secret: gpusnap-test\n";
  if (o.tls) {
    // A CA, and a certificate for the address signed by it.
    ca_ = base / "ca.pem";
    const auto out = base / "openssl.out";
    run({"openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
         "/CN=gpusnap test CA", "-keyout", (base / "ca.key").string(), "-out", ca_.string()},
        out);
    run({"openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=" + address_, "-keyout",
         (base / "server.key").string(), "-out", (base / "server.csr").string()},
        out);
    fs::write_file(base / "san.ext", "subjectAltName=IP:" + address_ + "\n");
    run({"openssl", "x509", "-req", "-in", (base / "server.csr").string(), "-CA", ca_.string(),
         "-CAkey", (base / "ca.key").string(), "-CAcreateserial", "-days", "2", "-extfile",
         (base / "san.ext").string(), "-out", (base / "server.pem").string()},
        out);
    config += "  tls:\n    certificate: " + (base / "server.pem").string() +
              "\n    key: " + (base / "server.key").string() + "\n";
  }
  if (!o.username.empty()) {
    // bcrypt entries, the only kind the registry accepts.
    run({"htpasswd", "-Bbc", (base / "htpasswd").string(), o.username, o.password},
        base / "htpasswd.out");
    config +=
        "auth:\n  htpasswd:\n    realm: gpusnap-test\n    path: " + (base / "htpasswd").string() +
        "\n";
  }
  if (!o.proxy_remote.empty()) config += "proxy:\n  remoteurl: " + o.proxy_remote + "\n";
  config += o.extra_config;
  fs::write_file(base / "config.yml", config);
  common::UniqueFd logfd(::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  common::SpawnOptions so;
  so.argv = {"docker-registry", "serve", (base / "config.yml").string()};
  if (o.node) so.argv = o.node->enter(so.argv);
  so.stdout_fd = logfd.get();
  so.stderr_fd = logfd.get();
  process_.emplace(so);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!answers(address_, port_)) {
    if (!process_->running() || process_->poll() || std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("docker-registry did not start: " + log());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

LocalRegistry::~LocalRegistry() = default;

sfs::path LocalRegistry::blob_data(const std::string& digest) const {
  const std::string hex = digest.substr(7);
  return storage_ / "docker/registry/v2/blobs/sha256" / hex.substr(0, 2) / hex / "data";
}

std::string LocalRegistry::log() const {
  std::string text;
  fs::try_read_file(log_, &text);
  return text;
}

}  // namespace gpusnap::testing
