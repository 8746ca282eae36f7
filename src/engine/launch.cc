#include "engine/launch.h"

#include <fcntl.h>

#include <cerrno>
#include <sstream>

#include "common/fd.h"
#include "common/fs.h"
#include "engine/handshake.h"
#include "engine/preflight.h"
#include "engine/preload.h"
#include "engine/python_site.h"
#include "gpusnap/error.h"

namespace gpusnap::engine {

LaunchedWorkload::LaunchedWorkload(const std::vector<std::string>& argv,
                                   const std::filesystem::path& run_dir,
                                   const LaunchOptions& options) {
  if (argv.empty()) {
    throw Error(ErrorKind::kUsage, "no command to run",
                "give it after --: gpusnap run -o ART -- CMD");
  }
  // First, as they may refuse (a library or folder named that is not there): nothing is made
  // before.
  auto preload = preload_environment();
  std::vector<std::string> tier_env;
  if (options.memory_tier) {
    python_site_ = find_python_site();
    tier_env = memory_tier_environment(python_site_);
  }
  auto dir = std::filesystem::absolute(run_dir) / "launched" / fs::random_id().substr(0, 12);
  control_dir_ = dir / "control";
  log_ = dir / "output.log";
  std::filesystem::create_directories(control_dir_);
  common::UniqueFd log(::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!log) throw sys_error("create " + log_.string(), errno);
  common::SpawnOptions o;
  o.argv = argv;
  o.env_add = {std::string(kControlDirEnv) + "=" + control_dir_.string()};
  // The driver's checkpoint of this workload then populates its host memory in parallel.
  if (preload) o.env_add.push_back(*preload);
  for (auto& setting : capturable_environment()) o.env_add.push_back(std::move(setting));
  for (auto& setting : tier_env) o.env_add.push_back(std::move(setting));
  o.stdout_fd = log.get();
  o.stderr_fd = log.get();
  // A service's life: no terminal (so no shell-job restore), not killed with gpusnap.
  o.new_session = true;
  o.kill_with_parent = false;
  o.deny_io_uring = true;
  process_.emplace(o);
  pid_ = process_->pid();
}

std::string LaunchedWorkload::output_tail(size_t lines) const {
  std::string text;
  fs::try_read_file(log_, &text);
  std::vector<std::string> all;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) {
    out += (out.empty() ? "" : " | ") + all[i];
  }
  return out.empty() ? "(no output)" : out;
}

}  // namespace gpusnap::engine
