#include "engine/dump_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "engine/gpu_state.h"
#include "engine/handshake.h"
#include "gpu/driver.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

namespace {

constexpr int kControlFd = 3;
constexpr int kStatusFd = 4;

}  // namespace

int dump_guard_main(const std::string& spec_json) {
  auto spec = nlohmann::json::parse(spec_json);
  auto argv = spec.at("argv").get<std::vector<std::string>>();
  std::filesystem::path staging = spec.at("staging").get<std::string>();
  std::filesystem::path output = spec.at("output").get<std::string>();
  // gpusnap may be gone by the time we report to it: a write to its closed pipe must fail
  // with EPIPE, not kill us before we clean up.
  ::signal(SIGPIPE, SIG_IGN);
  UniqueFd out(::open(output.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  SpawnOptions o;
  o.argv = argv;
  o.stdout_fd = out.get();
  o.stderr_fd = out.get();
  o.kill_with_parent = false;  // CRIU must finish even if we are killed
  Subprocess criu(o);
  ExitStatus status = *criu.wait();
  int encoded[2] = {status.exited ? 1 : 0, status.code};
  (void)::write(kStatusFd, encoded, sizeof encoded);
  ::close(kStatusFd);
  char word = 0;
  ssize_t n;
  while ((n = ::read(kControlFd, &word, 1)) < 0 && errno == EINTR) {
  }
  if (n != 1 || word != 'C') {
    fs::remove_tree_noexcept(staging);
    // gpusnap died with the workload's GPU state taken away: put it back now rather than
    // leave the workload blocked in its next CUDA call until someone runs gpusnap again.
    auto gpu_pids = spec.at("gpu_pids").get<std::vector<pid_t>>();
    if (!gpu_pids.empty()) {
      auto driver = gpu::open_nvidia_driver();
      if (driver->available()) return_to_running(*driver, gpu_pids);
    }
    // GPU first, then the workload's own resume: the order gpusnap itself keeps.
    if (auto dir = spec.at("control_dir").get<std::string>(); !dir.empty()) {
      Handshake(dir).request_resume_as_source();
    }
  }
  return 0;
}

GuardedDump::GuardedDump(const std::string& helper, std::vector<std::string> criu_argv,
                         std::filesystem::path staging, std::filesystem::path criu_output,
                         const std::vector<pid_t>& gpu_pids,
                         const std::filesystem::path& control_dir) {
  Pipe control = Pipe::make();
  Pipe status = Pipe::make();
  SpawnOptions o;
  // A separate program rather than a forked function: gpusnap may have driver threads by now.
  nlohmann::json spec{{"argv", criu_argv},
                      {"staging", staging.string()},
                      {"output", criu_output.string()},
                      {"gpu_pids", gpu_pids},
                      {"control_dir", control_dir.string()}};
  o.argv = {helper, "__dump-guard", spec.dump()};
  o.keep_fds = {{control.read.get(), kControlFd}, {status.write.get(), kStatusFd}};
  o.kill_with_parent = false;
  o.new_session = true;  // a Ctrl-C meant for gpusnap must not reach CRIU
  guardian_.emplace(o);
  control_ = std::move(control.write);
  status_ = std::move(status.read);
}

GuardedDump::~GuardedDump() {
  control_.reset();  // EOF without 'C': the guardian cleans up after CRIU
  guardian_->wait();
  guardian_->release();
}

ExitStatus GuardedDump::wait() {
  int encoded[2] = {0, 0};
  size_t got = 0;
  while (got < sizeof encoded) {
    ssize_t n = ::read(status_.get(), reinterpret_cast<char*>(encoded) + got, sizeof encoded - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw Error(ErrorKind::kCriu, "the process running CRIU's dump died");
    got += static_cast<size_t>(n);
  }
  return ExitStatus{encoded[0] == 1, encoded[1]};
}

void GuardedDump::commit() {
  char word = 'C';
  if (::write(control_.get(), &word, 1) != 1) throw sys_error("tell the dump guardian", errno);
  control_.reset();
}

}  // namespace gpusnap::engine
