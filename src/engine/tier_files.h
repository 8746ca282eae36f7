// gpusnap's side of the memory tier (docs/memory-tier.md). A workload that opted
// in moves its GPU memory itself: at the pause, into the folder gpusnap names in the request
// (STAGING/tier); at the resume, back from the folder named in the context (ARTIFACT/tier for a
// copy). gpusnap makes the folder, checks what the workload left in it, counts that memory for
// the restore's free-memory check, and names the folder in every resume context. The files are
// then ordinary files of the artifact: checksummed, listed in the manifest, verified.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "gpusnap/artifact.h"
#include "tier/folder_format.h"

namespace gpusnap::engine {

// The tier's folder, relative to the staging directory and to the artifact; its names, bounds and
// index are the tier's folder format's (tier/folder_format.h).
inline constexpr const char* kTierDirName = tier::folder::kDirName;
// A workload in a container reaches the tier's folder (and a copy its prefill's sockets) through
// a mount of that name in its handshake directory, made for the pause or the resume
// (container/mount.h).
inline constexpr const char* kTierMountName = ".gpusnap-tier";
inline constexpr const char* kPrefillMountName = ".gpusnap-tier-prefill";

// What the tier's index files (PID.json) say.
struct TierContents {
  size_t files = 0;                           // every file in the folder
  uint64_t bytes = 0;                         // GPU memory the files hold
  std::map<std::string, uint64_t> gpu_bytes;  // per GPU UUID
};

// Creates STAGING/tier owned by `pid`'s user and group (the workload writes into it; gpusnap
// runs as root), mode 0700, and returns its path. Throws Error(kInternal) naming the folder.
std::filesystem::path make_tier_dir(const std::filesystem::path& staging, pid_t pid);

// After the workload answered `paused`: the folder must hold the tier's files alone, regular
// files named PID-wN.img, PID.json and PID.layout (no links, folders or anything else), at most
// folder::kMaxEntries, every index well-formed (folder::parse_index), its files there at the sizes
// it gives, and every index and layout within the format's bounds. Throws
// Error(kHandshake) naming the first entry that is not so. An empty folder is removed (the
// workload has no tier, or nothing in it), so that artifacts without a tier do not change.
TierContents check_tier_dir(const std::filesystem::path& dir);

// The tier's files (complete once the workload answered `paused`) checksummed in the
// background while CRIU's dump runs and leaves most cores idle: the capture's checksum phase
// then reads CRIU's files alone. Measured on the H200 (docs/memory-tier.md, "Measured: where
// the tier's files are hashed"): hashing inside the drain instead made the drain, already bound
// by the CPU's writes into the files, as much slower as the checksum phase got shorter.
// The destructor stops the hashing (within a chunk per thread) and waits: a failed capture
// resumes its workload without waiting for the rest.
class TierChecksums {
 public:
  // `dir`: STAGING/tier as check_tier_dir() left it (not empty).
  TierChecksums(const std::filesystem::path& dir, uint64_t chunk_bytes, int threads);
  ~TierChecksums() = default;  // the thread is asked to stop, then joined
  TierChecksums(const TierChecksums&) = delete;
  TierChecksums& operator=(const TierChecksums&) = delete;
  // Waits for the sums; the files' records with their paths in the artifact (tier/NAME), for
  // ArtifactWriter::seal. Throws what the hashing threw (a file that cannot be read).
  std::vector<FileRecord> join();

 private:
  std::vector<FileRecord> files_;
  std::exception_ptr failure_;
  std::jthread thread_;  // last: it stops and is joined before the members it writes go
};

// Adds the tier's memory to the GPU facts of the manifest (`gpu`, as describe_gpu_state wrote
// it), to process `pid`'s entry, or to the first process's when `pid` has none: NVML no longer
// counts that memory after the drain, and a restore must find room for it.
void add_tier_memory(std::optional<GpuFacts>& gpu, pid_t pid, const TierContents& tier);

// The tier_dir member of a pause request or a resume context: the folder, or "" without one.
nlohmann::json tier_member(const std::filesystem::path& dir);

// The tier_dir member of a copy's resume context: ARTIFACT/tier as an absolute path (copies see
// gpusnap's mounts) when the manifest lists files there, else "".
nlohmann::json artifact_tier_dir(const std::filesystem::path& artifact, const Manifest& manifest);

// The fill of the copies' memory tiers done ahead (tier/prefill.h): for every copy and every
// process of the artifact with a tier layout, a gpusnap-tier-prefill started before CRIU
// restores the copies, making and filling that memory on the GPU the copy will use while CRIU
// and the driver restore it; at the resume the copy's tier takes it over. The program is found
// by GPUSNAP_TIER_PREFILL (its path; "off": none), else beside gpusnap. Where none can run (no
// program, a process whose tier spans several GPUs) the copies fill by themselves, as before.
class TierPrefills {
 public:
  // `gpu_map`: old GPU UUID -> new, as the restore maps them; `chunk_bytes`: the manifest's
  // checksum chunk, for the sums the prefills compute as they read (0: none). Starts the
  // prefills. `arriving`: the artifact is still being written (its staging directory, its
  // tier's index and layout files there): the prefills read each drain file's bytes once
  // arrived() said they are there, and reach the folder through a descriptor, which its rename
  // to the artifact's final name leaves valid.
  TierPrefills(const std::filesystem::path& artifact,
               const std::map<std::string, std::string>& gpu_map, int copies,
               const std::filesystem::path& run_dir, uint64_t chunk_bytes = 0,
               bool arriving = false);
  // Stops any prefill still running and removes their folder.
  ~TierPrefills();
  TierPrefills(const TierPrefills&) = delete;
  TierPrefills& operator=(const TierPrefills&) = delete;

  // The resume context's tier_prefill_dir for copy `copy`: "" when none runs for it.
  nlohmann::json context_dir(int copy) const;

  // For an arriving artifact: what tells the prefills that the first `bytes` of the file at
  // `path` (relative to the artifact) are written, for ArrivingArtifact::watch. It may outlive
  // this object (then it does nothing), never blocks on a prefill, and is safe from any thread.
  std::function<void(const std::string& path, uint64_t bytes)> arrival_feed() const;

  // The drain files of the manifest ("tier/PID-wK.img") that the first copy's prefills read and
  // checksum (the other copies' prefills read the same files without): with chunk_bytes, their
  // bytes are checked by the sums computed as they are read (checksums()) instead of being read
  // a second time beside CRIU's restore.
  std::set<std::string> files_read(const Manifest& manifest) const;
  // The checksums of the files the first copy's prefills read, as they read them (their SUMS-FD,
  // tier/prefill_main.cc), waiting for each until `deadline`. A prefill that fails, ends or
  // writes anything malformed gives none.
  struct Sums {
    std::string what;  // "copy N, process PID"
    std::vector<FileRecord> files;
  };
  std::vector<Sums> checksums(std::chrono::steady_clock::time_point deadline);

  // After the resume: waits briefly for each prefill (it exits once its memory was taken),
  // stops the others, and returns one line per prefill, from its own report.
  std::vector<std::string> finish();

 private:
  struct Running;
  class Feeds;
  void start(const std::filesystem::path& program, const std::filesystem::path& tier,
             const std::vector<std::string>& pids,
             const std::map<std::string, std::string>& gpu_map, int copies,
             const std::filesystem::path& run_dir, uint64_t chunk_bytes, bool arriving);
  void stop_all() noexcept;
  std::filesystem::path root_;
  uint64_t chunk_bytes_ = 0;
  std::vector<std::filesystem::path> copy_dirs_;
  std::vector<std::unique_ptr<Running>> running_;
  common::UniqueFd tier_dir_;     // arriving: the tier's folder, for the prefills
  std::shared_ptr<Feeds> feeds_;  // arriving: a socket per prefill
};

// Every drain file (tier/PID-wK.img) the manifest lists, by its path in the artifact.
std::set<std::string> drain_files(const Manifest& manifest);

// The check of the tier's `files` the prefills read (TierPrefills::files_read), by the sums the
// first copy's prefills computed as they read them: every sum must match the manifest's, and a
// file they gave none for by `deadline` (one failed: its copy fills from the file itself) is read
// here, as Artifact::verify would. Returns the problems, as verify() names them.
std::vector<VerifyProblem> verify_prefilled(const Artifact& artifact, TierPrefills& prefills,
                                            const std::set<std::string>& files,
                                            std::chrono::steady_clock::time_point deadline);

// What a prefill writes on its SUMS-FD: a line per file it read whole, "NAME SIZE HEX...", NAME
// one of process `pid`'s drain files (PID-wK.img), SIZE its bytes, then the XXH3-128 of each
// chunk of `chunk_bytes`, as the manifest writes them. Returns the records with their paths in the
// artifact (tier/NAME); nothing when any line is malformed, a name repeats or the text is over
// kMaxPrefillSumsBytes.
inline constexpr size_t kMaxPrefillSumsBytes = 4 << 20;
std::optional<std::vector<FileRecord>> parse_prefill_sums(const std::string& text,
                                                          const std::string& pid,
                                                          uint64_t chunk_bytes);

}  // namespace gpusnap::engine
