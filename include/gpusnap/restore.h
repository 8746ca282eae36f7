// Restore: start N copies of a captured workload from one artifact. Each copy runs in its own
// fresh PID, mount, network, IPC and UTS namespaces, so copies (and a source still running)
// never clash on PIDs, ports or abstract sockets. Entry point: gpusnap::restore().
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gpusnap/artifact.h"
#include "gpusnap/container.h"
#include "gpusnap/phases.h"

namespace gpusnap {

namespace gpu {
class Driver;
}

// A port of the copy made reachable from the host: host_address:host_port (+ copy index when
// host_port is given) forwards to 127.0.0.1:port inside the copy's network namespace.
struct PortPublish {
  std::string host_address = "127.0.0.1";
  uint16_t host_port = 0;  // 0: any free port, chosen per copy
  uint16_t port = 0;
  // Parses "PORT", "HOSTPORT:PORT" or "ADDR:HOSTPORT:PORT"; throws Error(kUsage).
  static PortPublish parse(const std::string& text);
};

// An artifact whose files are still being written while the restore starts: a snapshot pulled
// from a registry (store/stream.h). The restore waits for each part where it first needs it:
// CRIU's images before criu-restore, the rest (host images, the memory tier) before it
// checks the bytes and hands GPU memory to the driver; the memory tier's fill done ahead takes
// its files as they arrive (watch). Without GPU state CRIU's restore lets the copies run, so
// everything is awaited first.
class ArrivingArtifact {
 public:
  virtual ~ArrivingArtifact() = default;
  // The directory being written: its manifest.json there, every file at its size. Blocks
  // until then; throws the transfer's Error.
  virtual std::filesystem::path staging() = 0;
  // Blocks until CRIU's images (every file but the GPU memory's: host images and the tier's
  // drain files) are written.
  virtual void await_criu_images() = 0;
  // Blocks until every file but the memory tier's drain files is written: CRIU's images and the
  // host images, which the driver's restore reads. The drain files are the tier's fill's alone.
  virtual void await_host_images() = 0;
  // Calls `progress(path, bytes)` each time more of the file at `path` (relative to the
  // artifact) is written from its first byte, each byte checked against its digest: at once
  // for what is written already, then from the pull's threads, one call at a time. It must
  // not block, and is called until the pull ends.
  using Progress = std::function<void(const std::string& path, uint64_t bytes)>;
  virtual void watch(Progress progress) = 0;
  // Blocks until every file is written and the artifact is committed; returns its final path.
  // Called only once nothing reads the staging directory by its path.
  virtual std::filesystem::path complete() = 0;
};

struct RestoreOptions {
  std::filesystem::path artifact;
  int replicas = 1;
  bool verify = true;  // re-check every byte before a copy can run (see restore.cc)
  std::string criu_path;
  std::vector<PortPublish> publish;
  std::filesystem::path run_dir = "/run/gpusnap";  // per-copy logs and state
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  gpu::Driver* driver = nullptr;  // nullptr: the real NVIDIA driver, if any
  // "OLD=NEW" GPU pairs (UUIDs or indexes). Empty: the same GPUs where present, else GPUs of
  // the same model.
  std::vector<std::string> gpu_map;
  // Per-copy settings handed to the workload in its resume context (docs/handshake.md):
  // CRIU restores the old environment, so environment variables cannot carry them.
  std::map<std::string, std::string> settings;
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(60)};
  // The gpusnap binary, which also runs gpusnap's helper processes (the dump guardian, a
  // copy's namespace init). Empty: this program (/proc/self/exe).
  std::string helper_binary;
  // Restore the one copy into the namespaces of this running placeholder container (its PID 1
  // is `gpusnap init --placeholder`) instead of fresh namespaces; the artifact must come from a
  // container capture with the same root filesystem. Then replicas is 1, nothing is published,
  // and the copy's init_pid is the placeholder's PID 1.
  std::optional<ContainerRef> into_container;
  // Set: the artifact still arrives (see ArrivingArtifact); `artifact` is then ignored.
  ArrivingArtifact* arriving = nullptr;
  // Set: the caller ran the host check (engine/compat.h) on this artifact's manifest, as
  // store/reach.h does before the first chunk arrives; the restore then only maps the GPUs.
  bool host_checked = false;
};

struct PublishedPort {
  std::string host_address;
  uint16_t host_port = 0;
  uint16_t port = 0;
};

struct CopyInfo {
  int index = 0;
  pid_t host_pid = 0;         // the restored root process, as the host sees it
  pid_t ns_pid = 0;           // the same process inside its namespace (its original pid)
  pid_t init_pid = 0;         // the copy's namespace init (host pid): kill it to end the copy
  std::filesystem::path dir;  // logs: restore.log (CRIU), output.log (the workload)
  std::vector<PublishedPort> ports;
};

struct RestoreResult {
  Manifest manifest;
  std::vector<CopyInfo> copies;
  std::vector<PhaseTiming> phases;
  bool handshake = false;  // every copy answered RESUMED: it serves
};

// Starts the copies. Either all start, or none is left running (and no namespace remains).
// Throws Error.
RestoreResult restore(const RestoreOptions& options, Reporter& reporter);

// Refuses (Error kIncompatible) an artifact this host cannot run, naming what differs.
void check_host_compatible(const Manifest& manifest, const HostFacts& here);

}  // namespace gpusnap
