// The GPU state of a restore (src/engine/restore/gpu_restore.h).
#include "engine/restore/gpu_restore.h"

namespace gpusnap::engine {

GpuRestore::~GpuRestore() {
  if (ready_.valid()) ready_.wait();
}

std::vector<std::string> GpuRestore::open(const Manifest& manifest, const RestoreOptions& options) {
  plan_ = plan_gpu_restore(manifest.gpu, driver_, options.gpu_map, options.replicas);
  return plan_.notes;
}

void GpuRestore::start_init() {
  ready_ = std::async(std::launch::async, [this] { driver_.prepare_restore(); });
}

void GpuRestore::await_init() { ready_.get(); }

void GpuRestore::restore(const Copies& copies, const Manifest& manifest) {
  std::vector<pid_t> ns_pids;
  for (const auto& p : manifest.gpu->processes) ns_pids.push_back(p.pid);
  restore_gpu_processes(driver_, copies.host_pids(ns_pids), plan_.pairs);
}

std::map<std::string, std::string> GpuRestore::gpu_map() const {
  std::map<std::string, std::string> map;
  for (const auto& p : plan_.pairs) map[p.old_uuid] = p.new_uuid;
  return map;
}

nlohmann::json GpuRestore::context_map() const {
  nlohmann::json map = nlohmann::json::object();
  for (const auto& p : plan_.pairs) map[p.old_uuid] = p.new_uuid;
  return map;
}

}  // namespace gpusnap::engine
