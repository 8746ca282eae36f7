#include "testing/containerd.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <sstream>

#include "common/fd.h"
#include "common/fs.h"
#include "testing/containers.h"

namespace gpusnap::testing {

namespace stdfs = std::filesystem;

namespace {

constexpr const char* kNamespace = "k8s.io";  // the kubelet's

// The last lines of a log, for a message.
std::string tail_of(const stdfs::path& log) {
  std::string text;
  if (!fs::try_read_file(log, &text)) return "(no log)";
  if (text.size() > 1500) text = "..." + text.substr(text.size() - 1500);
  return text;
}

}  // namespace

std::optional<std::string> containerd_blocker() {
  if (auto why = runc_blocker()) return why;
  for (const char* binary :
       {"/usr/bin/containerd", "/usr/bin/ctr", "/usr/bin/containerd-shim-runc-v2"}) {
    if (::access(binary, X_OK) != 0) {
      return std::string(binary) + " is not installed (apt-get install containerd)";
    }
  }
  return std::nullopt;
}

Containerd::Containerd(const stdfs::path& dir) : dir_(dir) {
  stdfs::create_directories(dir_);
  // Its own root, state and sockets; no CRI plugin (the tests drive containerd as the CRI
  // plugin would, through its API, and the plugin would look for CNI). The runc v2 shim keeps
  // its default runc root, /run/containerd/runc/NAMESPACE, as on a node.
  std::ostringstream config;
  config << "version = 2\n"
         << "root = \"" << (dir_ / "root").string() << "\"\n"
         << "state = \"" << (dir_ / "state").string() << "\"\n"
         << "disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n"
         << "[grpc]\n  address = \"" << (dir_ / "containerd.sock").string() << "\"\n"
         << "[ttrpc]\n  address = \"" << (dir_ / "containerd.sock.ttrpc").string() << "\"\n"
         << "[debug]\n  address = \"\"\n";
  fs::write_file(dir_ / "config.toml", config.str());
  start();
}

void Containerd::start() {
  common::UniqueFd log(
      ::open((dir_ / "containerd.log").c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  common::SpawnOptions o;
  o.argv = {"/usr/bin/containerd", "--config", (dir_ / "config.toml").string()};
  o.stdout_fd = log.get();
  o.stderr_fd = log.get();
  o.new_session = true;
  daemon_.emplace(o);
  failure_.reset();
  if (!eventually([&] { return ctr({"version"}).status.ok(); }, std::chrono::seconds(20))) {
    failure_ = "containerd did not start: " + tail_of(dir_ / "containerd.log");
  }
}

void Containerd::kill(bool start_again) {
  if (daemon_) {
    daemon_->kill(SIGKILL);
    daemon_->wait();
    daemon_.reset();
  }
  if (start_again) start();
}

Containerd::~Containerd() {
  if (daemon_) {
    daemon_->kill(SIGTERM);
    if (!daemon_->wait(std::chrono::seconds(10))) daemon_->kill(SIGKILL);
  }
}

common::RunResult Containerd::ctr(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {"/usr/bin/ctr", "-a", (dir_ / "containerd.sock").string(), "-n",
                                   kNamespace};
  argv.insert(argv.end(), args.begin(), args.end());
  return common::run_capture(argv, std::chrono::seconds(60));
}

const std::string& Containerd::image() {
  if (!image_.empty()) return image_;
  auto rootfs = dir_ / "image-rootfs";
  make_rootfs(rootfs);
  const std::string name = "gpusnap.test/workload";
  const std::string tag = "t" + fs::random_id().substr(0, 8);
  auto built = common::run_capture(
      {"python3", std::string(GPUSNAP_SOURCE_DIR) + "/scripts/build-image", "--rootfs",
       rootfs.string(), "--output", (dir_ / "image").string(), "--name", name, "--tag", tag});
  EXPECT_TRUE(built.status.ok()) << built.output;
  auto imported = ctr({"images", "import", (dir_ / "image/gpusnap-image.tar").string()});
  EXPECT_TRUE(imported.status.ok()) << imported.output;
  if (built.status.ok() && imported.status.ok()) image_ = name + ":" + tag;
  return image_;
}

ManagedContainer::ManagedContainer(Containerd& containerd, std::string id,
                                   const std::vector<std::string>& args)
    : containerd_(containerd), id_(std::move(id)) {
  const auto& image = containerd_.image();
  if (image.empty()) return;
  log_ = containerd_.dir() / (id_ + ".log");
  std::vector<std::string> run = {
      "run", "-d", "--log-uri", "file://" + log_.string(),
      // As make_bundle() mounts them for runc (see there why each is needed).
      "--mount",
      "type=bind,src=" + stdfs::canonical(gpusnap_bin()).string() +
          ",dst=/bin/gpusnap,options=rbind:ro",
      "--mount",
      "type=bind,src=" + stdfs::canonical(build_path("libgpusnap-preload.so")).string() +
          ",dst=/bin/libgpusnap-preload.so,options=rbind:ro",
      "--mount", "type=tmpfs,src=tmpfs,dst=/tmp,options=nosuid:nodev:mode=1777", "--mount",
      "type=tmpfs,src=tmpfs,dst=/control,options=nosuid:nodev:mode=700", "--env",
      "GPUSNAP_CONTROL_DIR=/control", image, id_};
  run.insert(run.end(), args.begin(), args.end());
  auto r = containerd_.ctr(run);
  start_output_ = r.output;
  if (r.status.ok()) eventually([&] { return (pid_ = listed_pid()) > 0; });
}

ManagedContainer::~ManagedContainer() {
  containerd_.ctr({"task", "kill", "-s", "SIGKILL", id_});
  eventually([&] { return status() != "RUNNING"; }, std::chrono::seconds(10));
  containerd_.ctr({"task", "delete", "-f", id_});
  containerd_.ctr({"container", "delete", id_});
}

std::vector<std::string> ManagedContainer::listed() const {
  auto r = containerd_.ctr({"task", "ls"});
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::vector<std::string> w;
    for (std::string word; words >> word;) w.push_back(word);
    if (w.size() == 3 && w[0] == id_) return w;
  }
  return {};
}

std::string ManagedContainer::status() const {
  auto w = listed();
  return w.empty() ? "" : w[2];
}

pid_t ManagedContainer::listed_pid() const {
  auto w = listed();
  return w.empty() ? 0 : static_cast<pid_t>(std::stol(w[1]));
}

}  // namespace gpusnap::testing
