#include "testing/containers.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <regex>
#include <thread>

#include "common/fs.h"
#include "common/proc.h"
#include "common/subprocess.h"

namespace gpusnap::testing {

using nlohmann::json;
namespace stdfs = std::filesystem;

std::optional<std::string> runc_blocker() {
  if (auto why = system_test_blocker()) return why;
  if (::access("/usr/sbin/runc", X_OK) != 0 && ::access("/usr/bin/runc", X_OK) != 0) {
    return std::string("runc is not installed (apt-get install runc)");
  }
  if (::access("/bin/busybox", X_OK) != 0) {
    return std::string("busybox is not installed (apt-get install busybox-static)");
  }
  return std::nullopt;
}

void install_binary(const stdfs::path& rootfs, const stdfs::path& binary, const std::string& as) {
  stdfs::copy_file(binary, rootfs / as.substr(1), stdfs::copy_options::overwrite_existing);
  auto ldd = common::run_capture({"/usr/bin/ldd", binary.string()});
  ASSERT_TRUE(ldd.status.ok()) << ldd.output;
  static const std::regex kLib(R"((/[^ \t\n]+) \(0x)");
  for (std::sregex_iterator it(ldd.output.begin(), ldd.output.end(), kLib), end; it != end; ++it) {
    stdfs::path lib = (*it)[1].str();
    stdfs::create_directories(rootfs / lib.parent_path().relative_path());
    stdfs::copy_file(stdfs::canonical(lib), rootfs / lib.relative_path(),
                     stdfs::copy_options::overwrite_existing);
  }
}

void make_rootfs(const stdfs::path& rootfs) {
  for (const char* d : {"bin", "proc", "dev", "sys", "tmp", "control"}) {
    stdfs::create_directories(rootfs / d);
  }
  stdfs::copy_file("/bin/busybox", rootfs / "bin/busybox");
  stdfs::create_symlink("busybox", rootfs / "bin/sh");
  install_binary(rootfs, build_path("tests/gpusnap-test-workload"), "/bin/gpusnap-test-workload");
  install_binary(rootfs, build_path("tests/gpusnap-example-handshake-worker"),
                 "/bin/handshake-worker");
  write(rootfs / "bin/gpusnap", "");  // the mount point of the bind-mounted binary
  // and of the preload library beside it, as a node's /opt/gpusnap/bin holds both
  write(rootfs / "bin/libgpusnap-preload.so", "");
}

stdfs::path make_bundle(const stdfs::path& dir, const std::vector<std::string>& args) {
  auto rootfs = dir / "rootfs";
  make_rootfs(rootfs);
  auto spec = common::run_capture({"runc", "spec", "--bundle", dir.string()});
  EXPECT_TRUE(spec.status.ok()) << spec.output;
  auto config = json::parse(fs::read_file(dir / "config.json"));
  config["process"]["terminal"] = false;
  config["process"]["args"] = args;
  config["mounts"].push_back({{"destination", "/bin/gpusnap"},
                              {"type", "bind"},
                              {"source", stdfs::canonical(gpusnap_bin()).string()},
                              {"options", {"bind", "ro"}}});
  config["mounts"].push_back(
      {{"destination", "/bin/libgpusnap-preload.so"},
       {"type", "bind"},
       {"source", stdfs::canonical(build_path("libgpusnap-preload.so")).string()},
       {"options", {"bind", "ro"}}});
  // CRIU, run inside the container, probes the kernel with a scratch directory in /tmp.
  config["mounts"].push_back({{"destination", "/tmp"},
                              {"type", "tmpfs"},
                              {"source", "tmpfs"},
                              {"options", {"nosuid", "nodev", "mode=1777"}}});
  // The handshake directory: a volume of the container's own, as an emptyDir would be.
  config["mounts"].push_back({{"destination", "/control"},
                              {"type", "tmpfs"},
                              {"source", "tmpfs"},
                              {"options", {"nosuid", "nodev", "mode=700"}}});
  config["process"]["env"].push_back("GPUSNAP_CONTROL_DIR=/control");
  write(dir / "config.json", config.dump(2));
  return dir;
}

std::optional<std::string> host_container_blocker() {
  if (auto why = system_test_blocker()) return why;
  if (!common::run_capture({"runc", "--version"}).status.ok()) {
    return std::string("runc is not on the PATH (apt-get install runc, or carry one)");
  }
  return std::nullopt;
}

stdfs::path make_python_bundle(const stdfs::path& dir, const std::vector<std::string>& args,
                               bool gpu, const stdfs::path& data) {
  auto rootfs = dir / "rootfs";
  for (const char* d :
       {"usr", "etc", "opt", "proc", "dev", "sys", "tmp", "control", "tests", "gpusnap", "data"}) {
    stdfs::create_directories(rootfs / d);
  }
  for (const char* link : {"bin", "lib", "lib64", "sbin"}) {
    stdfs::create_symlink(std::string("usr/") + link, rootfs / link);
  }
  auto spec = common::run_capture({"runc", "spec", "--bundle", dir.string()});
  EXPECT_TRUE(spec.status.ok()) << spec.output;
  auto config = json::parse(fs::read_file(dir / "config.json"));
  config["process"]["terminal"] = false;
  config["process"]["args"] = args;
  auto& env = config["process"]["env"];
  env = json::array({"HOME=/tmp", "GPUSNAP_CONTROL_DIR=/control", "PYTHONPATH=/tests",
                     "PYTHONDONTWRITEBYTECODE=1"});
  const char* path = std::getenv("PATH");  // NOLINT(concurrency-mt-unsafe): read, never set
  env.push_back(std::string("PATH=") + (gpu && path != nullptr ? path : "/usr/bin:/bin"));
  auto& mounts = config["mounts"];
  auto bind = [&](const stdfs::path& source, const std::string& destination, bool read_only) {
    mounts.push_back({{"destination", destination},
                      {"type", "bind"},
                      {"source", stdfs::canonical(source).string()},
                      {"options", {"rbind", read_only ? "ro" : "rw"}}});
  };
  bind("/usr", "/usr", true);
  bind("/etc", "/etc", true);
  bind(build_path("tests"), "/tests", true);
  for (const char* file : {"libgpusnap-preload.so", "libgpusnap-tier.so"}) {
    write(rootfs / "gpusnap" / file, "");
    bind(build_path(file), std::string("/gpusnap/") + file, true);
  }
  write(rootfs / "gpusnap/gpusnap", "");
  bind(gpusnap_bin(), "/gpusnap/gpusnap", true);
  // gpusnap's Python site folder beside it, as a node's /opt/gpusnap/bin/python.
  stdfs::create_directories(rootfs / "gpusnap/python");
  bind(build_path("python"), "/gpusnap/python", true);
  if (!data.empty()) bind(data, "/data", false);
  // CRIU, run inside the container, probes the kernel with a scratch directory in /tmp; the
  // handshake directory is a volume of the container's own, as an emptyDir would be.
  mounts.push_back({{"destination", "/tmp"},
                    {"type", "tmpfs"},
                    {"source", "tmpfs"},
                    {"options", {"nosuid", "nodev", "mode=1777"}}});
  mounts.push_back({{"destination", "/control"},
                    {"type", "tmpfs"},
                    {"source", "tmpfs"},
                    {"options", {"nosuid", "nodev", "mode=700"}}});
  if (gpu) {
    if (stdfs::exists("/opt")) bind("/opt", "/opt", true);
    const char* libs = std::getenv("LD_LIBRARY_PATH");  // NOLINT(concurrency-mt-unsafe): read
    if (libs != nullptr) env.push_back(std::string("LD_LIBRARY_PATH=") + libs);
    for (const char* dev : {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
                            "/dev/nvidia-uvm-tools"}) {
      if (stdfs::exists(dev)) {
        mounts.push_back(
            {{"destination", dev}, {"type", "bind"}, {"source", dev}, {"options", {"bind", "rw"}}});
      }
    }
    config["linux"]["resources"]["devices"] = json::array({{{"allow", true}, {"access", "rwm"}}});
  }
  write(dir / "config.json", config.dump(2));
  return dir;
}

Container::Container(const stdfs::path& runtime_root, std::string id, const stdfs::path& bundle)
    : root_(runtime_root), id_(std::move(id)) {
  common::Pipe out = common::Pipe::make();
  common::SpawnOptions o;
  o.argv = {"runc",
            "--root",
            root_.string(),
            "run",
            "-d",
            "--pid-file",
            (bundle / "init.pid").string(),
            "--bundle",
            bundle.string(),
            id_};
  o.stdout_fd = out.write.get();
  o.stderr_fd = out.write.get();
  auto status = *common::Subprocess(o).wait();
  output_ = std::move(out.read);
  started_ = status.ok();
  if (started_) pid_ = std::stoi(fs::read_file(bundle / "init.pid"));
}

Container::~Container() {
  common::run_capture({"runc", "--root", root_.string(), "delete", "-f", id_});
}

json Container::state() const {
  auto r = common::run_capture({"runc", "--root", root_.string(), "state", id_});
  return r.status.ok() ? json::parse(r.output) : json();
}

std::string ask_in(pid_t pid, const std::string& line, std::chrono::milliseconds timeout) {
  std::string reply;
  // setns applies to the calling thread: a thread of its own joins the namespace and asks.
  std::thread([&] {
    common::UniqueFd ns(
        ::open(("/proc/" + std::to_string(pid) + "/ns/net").c_str(), O_RDONLY | O_CLOEXEC));
    if (ns && ::setns(ns.get(), CLONE_NEWNET) == 0) reply = ask(kContainerPort, line, timeout);
  }).join();
  return reply;
}

std::string namespace_of(pid_t pid, const char* ns) {
  std::error_code ec;
  return stdfs::read_symlink("/proc/" + std::to_string(pid) + "/ns/" + ns, ec).string();
}

pid_t restored_into(const std::string& restore_json, pid_t placeholder_pid) {
  auto doc = json::parse(restore_json, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object() || !doc.contains("copies") || doc["copies"].empty()) {
    ADD_FAILURE() << "no restored copy in: " << restore_json;
    return 0;
  }
  const auto& copy = doc["copies"][0];
  EXPECT_EQ(copy.at("init_pid").get<pid_t>(), placeholder_pid);
  auto restored = copy.at("pid").get<pid_t>();
  for (const char* ns : {"pid", "mnt", "net", "ipc", "uts", "cgroup"}) {
    EXPECT_EQ(namespace_of(restored, ns), namespace_of(placeholder_pid, ns)) << ns;
  }
  EXPECT_EQ(proc::read_process(restored).ppid, placeholder_pid);
  return restored;
}

std::vector<std::string> shimmed_workload() {
  return {"/bin/gpusnap", "init",
          "--",           "/bin/gpusnap-test-workload",
          "--port",       std::to_string(kContainerPort),
          "--mib",        "16",
          "--threads",    "48",
          "--children",   "1"};
}

std::vector<std::string> placeholder_args() { return {"/bin/gpusnap", "init", "--placeholder"}; }

}  // namespace gpusnap::testing
