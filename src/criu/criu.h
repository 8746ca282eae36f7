// Driving the criu binary. gpusnap runs CRIU as a program (not through libcriu's RPC) because
// restore must run inside namespaces gpusnap creates, and because the CLI is CRIU's most
// stable interface. This file knows CRIU's options; engine/ decides when to use them.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gpusnap::criu {

struct Binary {
  std::string path;     // the criu executable (or the wrapper of a private prefix)
  std::string version;  // "4.2"
};

// Finds CRIU: `explicit_path`, then $GPUSNAP_CRIU, /opt/gpusnap/criu/criu, `criu` on PATH.
// Throws Error(kEnvironment) naming the fix when none is found or it is older than 4.2.
Binary locate(const std::string& explicit_path = {});
// MAJOR[.MINOR] at the start of VERSION ("4.2.1" is 4.2), after any blanks; none when it does
// not start with a number.
struct Version {
  int major = 0;
  int minor = 0;
};
std::optional<Version> parse_version(std::string_view version);

// "4.2.1" >= "4.2"?
bool version_at_least(const std::string& version, int major, int minor);

struct DumpOptions {
  pid_t pid = 0;
  std::filesystem::path images;
  std::filesystem::path log;  // absolute
  bool shell_job = false;
  uint64_t ghost_limit = 256ull << 20;  // unlinked files kept open are stored up to this size
  // Files CRIU records by reference only, "file[MNT_ID:INODE]" (hex): restore must hand each
  // one over as an inherited descriptor under the same key.
  std::vector<std::string> external_files;
};
std::vector<std::string> dump_args(const Binary& criu, const DumpOptions& options);

struct InheritFd {
  int fd;           // descriptor number in the criu process
  std::string key;  // CRIU's resource key: "pipe:[123]", "socket:[45]", "tmp/out.log"
};

struct RestoreOptions {
  std::filesystem::path images;
  std::filesystem::path log;
  std::filesystem::path pidfile;  // CRIU writes the restored root's pid (as it sees it) here
  bool shell_job = false;
  std::vector<InheritFd> inherit;
  // The restored root becomes a child of CRIU's parent (a copy's init). Without: of CRIU,
  // whose exit hands it to the init of the PID namespace CRIU runs in (a placeholder's).
  bool sibling = true;
  // Leave the restored tree in CRIU's own cgroups (false: CRIU may move it, as it dumped it).
  bool keep_cgroups = false;
};
std::vector<std::string> restore_args(const Binary& criu, const RestoreOptions& options);

// The lines of a CRIU log worth showing a person: its errors, without known harmless ones.
// The highest pid or thread id of the tree an image folder holds: CRIU writes a core-ID.img for
// every thread of every process it dumped. 0 when there is none.
pid_t highest_task_id(const std::filesystem::path& images);

std::vector<std::string> log_errors(const std::filesystem::path& log, size_t max_lines = 6);
// One line for an error message: the most telling error of the log, or a fallback.
std::string summarize_failure(const std::filesystem::path& log);

// The CRIU key for an fd target as /proc shows it: paths lose their leading slash, pipes and
// sockets keep their "type:[inode]" form. Empty when CRIU needs no help for it (/dev/null).
std::string inherit_key(const std::string& proc_target);

}  // namespace gpusnap::criu
