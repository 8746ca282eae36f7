// The memory tier's folder: what a drain leaves for gpusnap (docs/memory-tier.md).
// One owner for the format, as writer and readers share it: the tier's drain writes it
// (tier/transfer.cc), gpusnap reads it after the pause (engine/tier_files.cc) and from artifacts
// (restore, prefill), and the test stand-in writes its index through this code too
// (tests/workload/tier_folder_tool.cc).
//
// A process PID that drained leaves, in one folder shared with the other processes of the
// workload:
//   PID-wK.img   worker K's drain file: the contents of the pieces that worker copied
//   PID.layout   every segment and where each piece went (tier/layout.h, binary)
//   PID.json     the index, written last (through PID.json.tmp and a rename):
//     {"format":"gpusnap-tier","version":1,"pid":PID,"bytes":N,
//      "files":[{"path":"PID-wK.img","size":N},...],"gpus":[{"uuid":"GPU-...","bytes":N},...]}
// The folder is written by the workload and read by gpusnap as root, and artifacts bring it from
// elsewhere, so every reader bounds it: the names below and nothing else, the counts and sizes
// below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gpusnap::tier::folder {

// The folder's name, in the staging directory and in the artifact.
inline constexpr const char* kDirName = "tier";

// Bounds on what a reader accepts. A workload writes a few files per process.
inline constexpr std::size_t kMaxEntries = 4096;
inline constexpr std::uint64_t kMaxIndexBytes = 1 << 20;
// PID.layout: fixed-size records, 32 bytes per piece of at most a buffer.
inline constexpr std::uint64_t kMaxLayoutBytes = std::uint64_t{64} << 20;
// Drain files of one process (its workers), and GPUs one index names.
inline constexpr std::size_t kMaxDrainFiles = 1024;
inline constexpr std::size_t kMaxIndexGpus = 256;
inline constexpr std::size_t kMaxUuidChars = 256;
// The digits of a PID and of a worker's number in a name.
inline constexpr std::size_t kMaxPidDigits = 10;
inline constexpr std::size_t kMaxWorkerDigits = 4;

// The names a drain of process `pid` writes; `pid` as a number or as the digits classify() gave.
std::string drain_file_name(std::string_view pid, std::size_t worker);  // PID-wK.img
std::string index_name(std::string_view pid);                           // PID.json
std::string layout_name(std::string_view pid);                          // PID.layout
inline std::string drain_file_name(std::uint64_t pid, std::size_t worker) {
  return drain_file_name(std::to_string(pid), worker);
}
inline std::string index_name(std::uint64_t pid) { return index_name(std::to_string(pid)); }
inline std::string layout_name(std::uint64_t pid) { return layout_name(std::to_string(pid)); }

// What a name in the folder is. Anything else (a PID of more than kMaxPidDigits digits, a
// worker of more than kMaxWorkerDigits, a path with a slash, PID.json.tmp) is kOther.
enum class EntryKind { kOther, kDrainFile, kIndex, kLayout };
struct Entry {
  EntryKind kind = EntryKind::kOther;
  std::string pid;  // the PID's digits as written, for all but kOther
};
Entry classify(std::string_view name);
// The same of a path in an artifact ("tier/NAME"): kOther for anything outside its tier folder.
Entry classify_in_artifact(std::string_view path);

// The index (PID.json).
struct IndexFile {
  std::string path;  // a drain file of the same PID, relative to the folder
  std::uint64_t size = 0;
};
struct IndexGpu {
  std::string uuid;
  std::uint64_t bytes = 0;  // of the process's tier memory on that GPU
};
struct TierIndex {
  std::uint64_t pid = 0;
  std::uint64_t bytes = 0;  // every live byte drained
  std::vector<IndexFile> files;
  std::vector<IndexGpu> gpus;
};

// The index as text: one line of JSON, members in the order above.
std::string index_text(const TierIndex& index);
// Writes dir/PID.json through dir/PID.json.tmp (mode 0600, O_EXCL) and a rename. Throws
// Error(kInternal) naming the file; leaves no .tmp behind.
void write_index(const std::filesystem::path& dir, const TierIndex& index);
// Reads an index's text (already bounded to kMaxIndexBytes by the caller's read). Returns nothing
// and sets *why (one line) when it is not JSON, nests deeper than the format, is of another
// format or version, has a member missing or of the wrong type, a file name that is not one of
// this PID's drain files, a name twice, or more files or GPUs than the bounds. Never throws.
std::optional<TierIndex> parse_index(std::string_view text, std::string* why = nullptr);

}  // namespace gpusnap::tier::folder
