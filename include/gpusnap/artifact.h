// The artifact: a directory holding a manifest, CRIU's images and logs. It appears under its
// final name only once complete and durable (staging name, fsync, rename), so a reader never
// sees a partial one. Every file it holds is listed in the manifest with its size and checksum.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <stop_token>
#include <string>
#include <utility>
#include <vector>

// The declarations only: the manifest's JSON form (to_json/from_json) is its on-disk
// contract, and the callers that use it include <nlohmann/json.hpp> themselves.
#include <nlohmann/json_fwd.hpp>

#include "gpusnap/phases.h"

namespace gpusnap {

inline constexpr const char* kArtifactFormat = "gpusnap-artifact";
// The only version ever written: 2 (host images) replaced 1 before any artifact of 1 existed.
inline constexpr int kArtifactFormatVersion = 2;
inline constexpr const char* kManifestName = "manifest.json";
inline constexpr const char* kCriuImageDir = "criu";

// What a restore depends on about the machine that took the snapshot.
struct HostFacts {
  std::string hostname;
  std::string kernel;  // uname -r
  std::string arch;    // uname -m
  std::string cpu_model;
  std::vector<std::string> cpu_flags;
  std::string criu_version;
  long page_size = 0;

  static HostFacts probe(const std::string& criu_version);
};

struct StdioTarget {
  int fd = -1;
  std::string target;  // what the fd pointed at in the source: a path, pipe:[..], /dev/pts/..
};

struct ProcessRecord {
  pid_t pid = 0;
  pid_t ppid = 0;
  std::string comm;
  std::vector<std::string> cmdline;
  int threads = 0;
  uint64_t rss_bytes = 0;
  std::vector<StdioTarget> stdio;
  uint64_t gpu_bytes = 0;  // GPU memory the driver moved into this process (0: no CUDA)
};

// A range of a CUDA process's memory that gpusnap stored itself instead of through CRIU: the
// copy of its GPU memory that the driver's checkpoint left in host memory. The file holds the
// range byte for byte (zero blocks as holes); CRIU's images map it back at `start`, privately,
// as the external file `criu_key`.
struct HostImageRecord {
  pid_t pid = 0;
  uint64_t start = 0;
  uint64_t end = 0;
  std::string file;           // relative to the artifact root
  uint64_t file_offset = 0;   // where `start` lies in the file (start's offset in a 2 MiB page)
  std::string criu_key;       // "file[MNT_ID:INODE]" as CRIU's dump named it
  uint64_t stored_bytes = 0;  // bytes not in holes
};

// A GPU the workload could see when it was captured. Every visible GPU is recorded, used or
// not: the driver's restore onto other GPUs takes a map of all of them.
struct GpuRecord {
  int index = 0;
  bool used = true;  // held the workload's memory (true for all when usage was not visible)
  std::string uuid;
  std::string name;  // "NVIDIA H200": the model a target GPU must match
  std::string bus_id;
  std::string compute_capability;  // "9.0"
  uint64_t memory_total = 0;
};

// The GPU memory one GPU held for a process.
struct GpuUsageRecord {
  std::string uuid;
  uint64_t bytes = 0;
};

// A CUDA process of the snapshot: its pid (as ProcessRecord::pid) and its GPU memory.
struct GpuProcessRecord {
  pid_t pid = 0;
  uint64_t bytes = 0;
  std::vector<GpuUsageRecord> gpus;
};

// What a restore checks and maps about the GPUs the snapshot was taken on.
struct GpuFacts {
  std::string driver_version;   // "580.95.05": a restore needs the same
  int cuda_driver_version = 0;  // 13000
  std::vector<GpuRecord> gpus;
  std::vector<GpuProcessRecord> processes;
};

// A file of the captured container's root filesystem that the workload maps: a placeholder
// restored into must hold the same one.
struct RootfsFileRecord {
  std::string path;  // inside the container's root
  uint64_t size = 0;
  std::string xxh3;      // 64-bit xxh3 of the content, hex; "" when build_id identifies it
  std::string build_id;  // an ELF's GNU build-id, hex (container/build_id.h); "" if none
};

// The container a workload was captured from.
struct ContainerRecord {
  std::string runtime;  // "runc"
  std::string id;
  std::string bundle;
  std::string rootfs;
  std::vector<RootfsFileRecord> rootfs_files;
  std::string runtime_root;  // the runtime's state directory it was found in
};

struct FileRecord {
  std::string path;  // relative to the artifact root
  uint64_t size = 0;
  std::vector<std::string> chunks;  // checksum of each chunk, hex
};

struct Manifest {
  std::string format = kArtifactFormat;
  int format_version = kArtifactFormatVersion;
  std::string id;
  std::string created;  // RFC 3339, UTC
  std::string gpusnap_version;
  pid_t source_pid = 0;
  std::vector<std::string> source_cmdline;
  HostFacts host;
  bool shell_job = false;
  std::vector<ProcessRecord> processes;
  std::optional<GpuFacts> gpu;  // none: the snapshot holds no GPU state
  // The workload's handshake control directory at capture time (empty: captured without the
  // handshake). Restored copies get their own directory mounted at this path.
  std::string control_dir;
  // A capture of a container's workload (none: of a host process tree). Its pids are then
  // those of the container's PID namespace.
  std::optional<ContainerRecord> container;
  std::string checksum_algorithm = "xxh3-128";
  uint64_t chunk_bytes = 64ull << 20;
  std::vector<FileRecord> files;
  std::vector<HostImageRecord> host_images;
  std::vector<PhaseTiming> checkpoint_phases;

  uint64_t total_bytes() const;
  nlohmann::json to_json() const;
  // Validates the whole document, every section typed: throws Error(kBadArtifact) naming the
  // field when it is not a manifest this gpusnap reads, never a JSON library exception.
  static Manifest from_json(const nlohmann::json& doc);
};

// One problem found by verification: the file and what is wrong with it.
struct VerifyProblem {
  std::string path;
  std::string problem;
};

struct VerifyOptions {
  // A constructor, not an aggregate: callers pass the leading members they need, `{0, &r}`,
  // without a warning for those they leave out. Not explicit, so that braces convert.
  // NOLINTNEXTLINE(google-explicit-constructor)
  VerifyOptions(int threads_ = 0, Reporter* reporter_ = nullptr, std::stop_token stop_ = {})
      : threads(threads_), reporter(reporter_), stop(std::move(stop_)) {}
  int threads = 0;  // 0: one per core
  Reporter* reporter = nullptr;
  // Once requested, no further chunk is read and checksum_tree throws Error(kInternal): a
  // capture that fails stops the checksums it runs in the background (engine/tier_files.h).
  std::stop_token stop;
};

// Which files a verification reads (paths relative to the root). By default every file.
struct VerifyScope {
  // Files whose bytes are left to the caller, who checks them another way (their presence and
  // size are still checked): a restore compares the sums its prefills compute as they read the
  // tier's files (Artifact::compare).
  std::set<std::string> deferred;
  // When not empty, only these files are checked (nothing else, not even for presence).
  std::set<std::string> only;
};

// An artifact opened for reading. open() performs the format checks (manifest present and
// well-formed, a known format version, every listed file present with its size); bytes are
// checked only by verify().
class Artifact {
 public:
  static Artifact open(const std::filesystem::path& root);

  const std::filesystem::path& root() const { return root_; }
  const Manifest& manifest() const { return manifest_; }
  std::filesystem::path criu_dir() const { return root_ / kCriuImageDir; }

  // Re-reads every byte and compares it with the manifest. Returns the problems found; empty
  // means the artifact is intact.
  std::vector<VerifyProblem> verify(const VerifyOptions& options = {},
                                    const VerifyScope& scope = {}) const;
  // Compares a file's checksums computed by whoever read it with the manifest's: the problems,
  // as verify() names them; empty when they match.
  std::vector<VerifyProblem> compare(const FileRecord& got) const;

 private:
  // compare() with the manifest's record of the file already found.
  std::vector<VerifyProblem> compare_with(const FileRecord& want, const FileRecord& got) const;

  std::filesystem::path root_;
  Manifest manifest_;
};

// Computes the file records (sizes and chunk checksums) of every file under root, in parallel.
// Files listed in `known` (same path, size and chunk count) take their checksums from there
// and are not read: their writer hashed the bytes as it wrote them.
std::vector<FileRecord> checksum_tree(const std::filesystem::path& root, uint64_t chunk_bytes,
                                      const VerifyOptions& options = {},
                                      const std::vector<FileRecord>& known = {});

}  // namespace gpusnap
