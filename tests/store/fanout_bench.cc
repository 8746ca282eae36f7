// gpusnap-fanout-bench OUTDIR [NODES] [MIB] [RATE_MBIT] (`bench/run fanout`): NODES nodes, each
// its own network namespace behind a link of RATE_MBIT, pull one capture of the test workload
// (MIB of memory) at once from an origin behind a link of the same rate; without a mirror,
// through a pull-through mirror, through one warmed by one node first, and with a gpusnap-agent
// on every node serving the others (`gpusnap pull --peers`, and the agents' own prefetch)
// (store/fanout.h).
// Prints a table and writes it to OUTDIR/fanout.md. Root.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "store/fanout.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

namespace sfs = std::filesystem;

int run(int argc, char** argv) {
  if (argc < 2 || argc > 5) {
    std::fprintf(stderr, "usage: gpusnap-fanout-bench OUTDIR [NODES] [MIB] [RATE_MBIT]\n");
    return 2;
  }
  const sfs::path out = argv[1];
  FanoutOptions options;
  options.nodes = argc > 2 ? std::stoi(argv[2]) : 8;
  const std::string mib = argc > 3 ? argv[3] : "256";
  options.rate_mbit = argc > 4 ? std::stoi(argv[4]) : 100;
  if (auto b = system_test_blocker()) throw std::runtime_error(*b);
  if (auto b = Fanout::blocker()) throw std::runtime_error(*b);
  sfs::create_directories(out);

  TempDir dir;
  const sfs::path artifact = dir / "snap";
  {
    Workload w(dir, {"--mib", mib, "--children", "1", "--seed", "37"});
    auto r =
        gpusnap({"checkpoint", "--pid", std::to_string(w.pid()), "-o", artifact.string(), "-q"},
                std::chrono::minutes(30));
    if (r.exit_code != 0) throw std::runtime_error("checkpoint failed: " + r.err);
  }
  Fanout fanout(dir, artifact, options);
  const double stored = static_cast<double>(fanout.stored_bytes());
  const FanoutRun alone = fanout.alone();
  std::string table = "fan-out: " + std::to_string(options.nodes) + " nodes, a capture of " + mib +
                      " MiB (" + std::to_string(fanout.stored_bytes()) +
                      " stored bytes), links of " + std::to_string(options.rate_mbit) +
                      " Mbit/s\n\n" +
                      "| configuration | origin bytes | x stored bytes | last node done s | one "
                      "node alone s |\n|---|---:|---:|---:|---:|\n";
  auto row = [&](const FanoutRun& r) {
    // Each node's copy and cache gone before the next run: NODES x 6 runs of them would not fit.
    for (const auto& copy : r.copies) sfs::remove_all(copy.parent_path());
    char line[512];
    std::snprintf(line, sizeof line, "| %s | %llu | %.2f | %.1f | %.1f |\n",
                  r.configuration.c_str(), static_cast<unsigned long long>(r.origin_bytes),
                  r.origin_bytes / stored, r.last_done_s, alone.last_done_s);
    table += line;
    std::fputs(line, stdout);
    std::fflush(stdout);
  };
  row(alone);
  row(fanout.without_mirror());
  row(fanout.with_mirror());
  row(fanout.with_mirror_warmed_by_one());
  row(fanout.with_peers());
  row(fanout.with_peers_through_agents());
  std::ofstream(out / "fanout.md") << table;
  std::printf("\n%s", table.c_str());
  return 0;
}

}  // namespace
}  // namespace gpusnap::testing

int main(int argc, char** argv) {
  try {
    return gpusnap::testing::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpusnap-fanout-bench: %s\n", e.what());
    return 1;
  }
}
