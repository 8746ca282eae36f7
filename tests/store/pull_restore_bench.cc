// gpusnap-pull-restore-bench: restore on a node that never saw the snapshot, end to end, side by
// side in one run: pull alone, restore alone (from the pulled artifact), and the pull and the
// restore overlapped (store::StreamingPull: CRIU restores from its images while the host images
// still arrive). Real test workload, real CRIU, real docker-registry on loopback, each pull
// into an empty node cache.
//
// No GPU here: StagingDriver (tests/testing/staging_driver.h) plays the driver, so the snapshot
// has the shape of a GPU one: its "GPU memory" (REGION_MIB, a quarter of it zeros) in a host
// image that the driver's restore reads back byte for byte, beside CRIU's images of the process
// (CPU_MIB). A second capture of the same workload without host images (everything in CRIU's
// pages, as a CPU-only snapshot has it) shows what overlap gives where CRIU's images are all
// there is: nothing. Each is pulled at the loopback's full speed (on a small machine the pull
// and CRIU then compete for the same cores) and through a link limited to RATE_MIB per second
// (--max-rate-mib: a node whose network, not its CPU, bounds the pull).
//
//   bench/run pull-restore OUTDIR [REGION_MIB=1024] [CPU_MIB=256] [RUNS=3] [RATE_MIB=256]
//
// A benchmark, not a test: built only with GPUSNAP_BENCH, here because it is made of the tests'
// fixtures. Root. Writes OUTDIR/results.md and OUTDIR/runs.jsonl; logs to stderr as it goes.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "gpusnap/checkpoint.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"
#include "store/registry_fixture.h"
#include "store/stream.h"
#include "store/transfer.h"
#include "testing/harness.h"
#include "testing/staging_driver.h"

namespace gpusnap::testing {
namespace {

namespace sfs = std::filesystem;
using nlohmann::json;
constexpr const char* kGpu = "GPU-0a0a0a0a-1111-2222-3333-444444444444";

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Makes a restore's copies known to the driver when its restore would first see them.
class CopiesToDriver final : public Reporter {
 public:
  CopiesToDriver(gpu::FakeDriver& fake, pid_t source, uint64_t bytes)
      : fake_(fake), source_(source), bytes_(bytes) {}
  void phase_started(std::string_view name) override {
    start_ = std::chrono::steady_clock::now();
    if (name != "gpu-restore") return;
    for (pid_t host : copies_of(source_)) {
      fake_.add_process(host, gpu::ProcessState::kCheckpointed);
      fake_.set_usage(host, kGpu, bytes_);
    }
  }
  void phase_finished(std::string_view name, double seconds) override {
    phases[std::string(name)] = seconds;
  }
  json phases = json::object();

 private:
  gpu::FakeDriver& fake_;
  pid_t source_;
  uint64_t bytes_;
  std::chrono::steady_clock::time_point start_;
};

struct Snapshot {
  std::string name;
  std::string ref;
  uint64_t bytes = 0;
  uint64_t host_image_bytes = 0;
};

int run(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s OUTDIR [REGION_MIB=1024] [CPU_MIB=256] [RUNS=3] [RATE_MIB=256]\n",
                 argv[0]);
    return 2;
  }
  const sfs::path out = sfs::absolute(argv[1]);
  const uint64_t region = std::stoull(argc > 2 ? argv[2] : "1024") << 20;
  const std::string cpu_mib = argc > 3 ? argv[3] : "256";
  const int runs = std::stoi(argc > 4 ? argv[4] : "3");
  const uint64_t link_mib = std::stoull(argc > 5 ? argv[5] : "256");
  sfs::create_directories(out);
  if (auto blocked = system_test_blocker()) throw std::runtime_error(*blocked);
  if (auto blocked = LocalRegistry::blocker()) throw std::runtime_error(*blocked);
  TempDir dir;
  LocalRegistry registry(dir, {});
  Workload source(dir, {"--mib", cpu_mib});
  gpu::FakeDriver fake;
  fake.add_gpu(gpu::FakeDriver::make_gpu(kGpu));
  fake.add_process(source.pid());
  fake.set_usage(source.pid(), kGpu, region);
  StagingDriver driver(fake, 0, region);
  Reporter quiet;

  std::vector<Snapshot> snaps;
  for (bool host_images : {true, false}) {
    Snapshot s;
    s.name = host_images ? "gpu-shaped" : "no-host-images";
    const sfs::path art = dir / s.name;
    CheckpointOptions co = capture_options(dir, source, driver, s.name);
    co.leave_running = true;
    co.host_images = host_images;
    std::fprintf(stderr, "capture %s\n", s.name.c_str());
    auto cp = checkpoint(co, quiet);
    s.bytes = cp.manifest.total_bytes();
    for (const auto& h : cp.manifest.host_images) s.host_image_bytes += h.stored_bytes;
    s.ref = registry.ref("bench/" + s.name + ":v1");
    store::TransferOptions to;
    to.registry.plain_http = true;
    store::push(art, store::OciRef::parse(s.ref), to, quiet);
    fs::remove_tree_noexcept(art);  // the node that restores never saw it
    snaps.push_back(s);
  }

  std::ofstream jsonl(out / "runs.jsonl");
  // Per link, per snapshot, per mode.
  std::map<std::string, std::map<std::string, std::map<std::string, std::vector<double>>>> seconds;
  int n = 0;
  uint64_t max_rate = 0;
  std::string link;
  auto pull_options = [&](const sfs::path& output) {
    store::PullOptions o;
    o.transfer.registry.plain_http = true;
    o.transfer.registry.max_rate = max_rate;
    o.output = output;
    o.cache = dir / ("cache-" + std::to_string(++n));  // empty: the node never saw it
    return o;
  };
  auto restore_options = [&](const sfs::path& artifact, ArrivingArtifact* arriving) {
    RestoreOptions ro;
    ro.artifact = artifact;
    ro.arriving = arriving;
    ro.driver = &driver;
    ro.helper_binary = gpusnap_bin();
    ro.run_dir = dir / "run";
    ro.timeout = std::chrono::seconds(300);
    return ro;
  };
  auto record = [&](const Snapshot& s, const std::string& mode, double secs, const json& phases) {
    seconds[link][s.name][mode].push_back(secs);
    json line = {{"link", link},
                 {"snapshot", s.name},
                 {"mode", mode},
                 {"seconds", secs},
                 {"phases", phases}};
    jsonl << line.dump() << "\n" << std::flush;
    std::fprintf(stderr, "%s\n", line.dump().c_str());
  };
  for (int r = 0; r < runs; ++r) {
    for (uint64_t rate : {uint64_t{0}, link_mib << 20}) {
      max_rate = rate;
      link = rate == 0 ? "loopback" : std::to_string(link_mib) + " MiB/s";
      for (const auto& s : snaps) {
        // Pull alone, then restore alone from what it pulled.
        const sfs::path pulled = dir / ("pulled-" + std::to_string(n));
        auto t = std::chrono::steady_clock::now();
        store::pull(store::OciRef::parse(s.ref), pull_options(pulled), quiet);
        const double pull_s = since(t);
        record(s, "pull", pull_s, json::object());
        CopiesToDriver watch(fake, source.pid(), region);
        t = std::chrono::steady_clock::now();
        {
          auto rr = restore(restore_options(pulled, nullptr), watch);
          record(s, "restore", since(t), watch.phases);
          Copies reaper{rr.copies};
        }
        record(s, "pull then restore", pull_s + seconds[link][s.name]["restore"].back(),
               json::object());
        fs::remove_tree_noexcept(pulled);
        // Both at once.
        const sfs::path streamed = dir / ("streamed-" + std::to_string(n));
        CopiesToDriver watch2(fake, source.pid(), region);
        t = std::chrono::steady_clock::now();
        {
          store::StreamingPull pull(store::OciRef::parse(s.ref), pull_options(streamed), quiet);
          auto rr = restore(restore_options(streamed, &pull), watch2);
          record(s, "pull+restore overlapped", since(t), watch2.phases);
          Copies reaper{rr.copies};
        }
        for (const auto& [pid, outcome] : driver.outcomes()) {
          if (outcome != "ok")
            throw std::runtime_error("pid " + std::to_string(pid) + ": " + outcome);
        }
        fs::remove_tree_noexcept(streamed);
      }
    }
  }

  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t m = v.size() / 2;
    return v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
  };
  std::ofstream md(out / "results.md");
  char load[64] = {};
  std::ifstream("/proc/loadavg").getline(load, sizeof load);
  md << "gpusnap-pull-restore-bench: " << runs << " runs, median seconds (all runs in runs.jsonl); "
     << "load at the end " << load << "\n\n";
  md << "| link | snapshot | bytes (host images) | pull | restore | pull then restore | "
        "pull+restore overlapped |\n|---|---|---|---|---|---|---|\n";
  for (auto& [l, by_snapshot] : seconds) {
    for (const auto& s : snaps) {
      auto& m = by_snapshot[s.name];
      char row[320];
      std::snprintf(row, sizeof row, "| %s | %s | %s (%s) | %.2f | %.2f | %.2f | %.2f |\n",
                    l.c_str(), s.name.c_str(), fs::human_bytes(s.bytes).c_str(),
                    fs::human_bytes(s.host_image_bytes).c_str(), median(m["pull"]),
                    median(m["restore"]), median(m["pull then restore"]),
                    median(m["pull+restore overlapped"]));
      md << row;
    }
  }
  md.close();
  std::cout << fs::read_file(out / "results.md");
  return 0;
}

}  // namespace
}  // namespace gpusnap::testing

int main(int argc, char** argv) {
  try {
    return gpusnap::testing::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpusnap-pull-restore-bench: %s\n", e.what());
    return 1;
  }
}
