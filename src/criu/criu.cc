#include "criu/criu.h"

#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <regex>
#include <vector>

#include "common/subprocess.h"
#include "gpusnap/error.h"

namespace gpusnap::criu {

namespace {

constexpr const char* kDefaultPrefixBinary = "/opt/gpusnap/criu/criu";
constexpr int kMinMajor = 4;
constexpr int kMinMinor = 2;

// `criu --version` of the file at `path`: its version, empty when it does not answer one.
std::string probe_version_uncached(const std::string& path) {
  common::RunResult r;
  try {
    r = common::run_capture({path, "--version"}, std::chrono::seconds(20));
  } catch (const Error&) {
    return {};
  }
  std::smatch m;
  static const std::regex kVersion(R"(Version:\s*([0-9]+\.[0-9]+(\.[0-9]+)?))");
  if (!r.status.ok() || !std::regex_search(r.output, m, kVersion)) return {};
  return m[1];
}

// `criu --version` of the file at `path`, run once per file a process sees: a restore reached
// through store/reach.h locates CRIU for its host check and again for the restore, and each run
// is a process start on the restore's path (docs/benchmarks.md, "GPU: the memory tier against the
// transparent path", before and after). Keyed by the file's identity, so that a long-running
// agent sees a CRIU replaced in place: its inode, size, mtime and ctime (which no one can set
// back, as `cp -p` or `touch -r` set the mtime, and which any write changes).
std::string probe_version(const std::string& path, const struct stat& st) {
  struct Seen {
    std::string path;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
    struct timespec ctime;
    std::string version;
  };
  static std::mutex mu;
  static std::vector<Seen> seen;
  const auto equal = [](const struct timespec& a, const struct timespec& b) {
    return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
  };
  const auto same = [&](const Seen& s) {
    return s.path == path && s.dev == st.st_dev && s.ino == st.st_ino && s.size == st.st_size &&
           equal(s.mtime, st.st_mtim) && equal(s.ctime, st.st_ctim);
  };
  {
    std::lock_guard lock(mu);
    for (const Seen& s : seen) {
      if (same(s)) return s.version;
    }
  }
  std::string version = probe_version_uncached(path);
  // Only a working CRIU is remembered: one that failed is asked again next time.
  if (!version.empty()) {
    std::lock_guard lock(mu);
    if (seen.size() >= 8) seen.erase(seen.begin());
    seen.push_back({path, st.st_dev, st.st_ino, st.st_size, st.st_mtim, st.st_ctim, version});
  }
  return version;
}

std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/sbin:/usr/bin:/sbin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string candidate = dirs.substr(start, end - start) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    start = end + 1;
  }
  return {};
}

}  // namespace

std::optional<Version> parse_version(std::string_view version) {
  const auto start = version.find_first_not_of(" \t");
  if (start == std::string_view::npos) return std::nullopt;
  const char* p = version.data() + start;
  const char* const end = version.data() + version.size();
  Version v;
  auto [after_major, ec] = std::from_chars(p, end, v.major);
  if (ec != std::errc{}) return std::nullopt;
  if (after_major != end && *after_major == '.') {
    if (std::from_chars(after_major + 1, end, v.minor).ec != std::errc{}) v.minor = 0;
  }
  return v;
}

bool version_at_least(const std::string& version, int major, int minor) {
  const auto v = parse_version(version);
  if (!v) return false;
  return v->major > major || (v->major == major && v->minor >= minor);
}

Binary locate(const std::string& explicit_path) {
  std::vector<std::string> candidates;
  // A path the user named (--criu, GPUSNAP_CRIU) is reported even when nothing is there; a
  // default location only when something unusable is there (else CRIU is just not installed).
  bool named = true;
  if (!explicit_path.empty()) {
    candidates.push_back(explicit_path);
  } else if (const char* env = std::getenv("GPUSNAP_CRIU"); env != nullptr && *env != '\0') {
    candidates.push_back(env);
  } else {
    named = false;
    candidates.push_back(kDefaultPrefixBinary);
    if (auto on_path = find_on_path("criu"); !on_path.empty()) candidates.push_back(on_path);
  }
  std::string seen;
  for (const auto& path : candidates) {
    struct stat st {};
    bool exists = ::stat(path.c_str(), &st) == 0;
    if (!exists || !S_ISREG(st.st_mode) || ::access(path.c_str(), X_OK) != 0) {
      // Skipping it silently would leave "CRIU was not found" for a path the user can see.
      if (named || exists) seen += (seen.empty() ? "" : ", ") + path + " is not an executable file";
      continue;
    }
    auto version = probe_version(path, st);
    if (version_at_least(version, kMinMajor, kMinMinor)) return {path, version};
    seen += (seen.empty() ? "" : ", ") + path + " is " +
            (version.empty() ? std::string("not working") : "version " + version);
  }
  if (seen.empty()) {
    throw Error(ErrorKind::kEnvironment, "CRIU was not found",
                "run scripts/install-criu, or point --criu / GPUSNAP_CRIU at criu >= 4.2");
  }
  throw Error(ErrorKind::kEnvironment, "no usable CRIU >= 4.2: " + seen,
              "run scripts/install-criu, or point --criu / GPUSNAP_CRIU at criu >= 4.2");
}

std::vector<std::string> dump_args(const Binary& criu, const DumpOptions& o) {
  std::vector<std::string> args = {
      criu.path,
      "dump",
      "--tree",
      std::to_string(o.pid),
      "--images-dir",
      o.images.string(),
      "--log-file",
      o.log.string(),
      "-v4",
      // gpusnap always keeps the source alive through CRIU; it stops the source itself only
      // after the artifact is committed, so a failure at any point leaves the workload running.
      "--leave-running",
      // What a real server holds: established connections, sockets to the outside world,
      // file locks, files it unlinked but keeps open, and half-accepted connections.
      "--tcp-established",
      "--ext-unix-sk",
      "--file-locks",
      "--skip-in-flight",
      "--ghost-limit",
      std::to_string(o.ghost_limit),
      // iptables/nftables binaries are often absent (they are on the GPU machines); the
      // connections are repaired in place, and copies restore theirs in a fresh network
      // namespace where nothing can race with them.
      "--network-lock",
      "skip",
  };
  if (o.shell_job) args.push_back("--shell-job");
  for (const auto& key : o.external_files) {
    args.push_back("--external");
    args.push_back(key);
  }
  return args;
}

std::vector<std::string> restore_args(const Binary& criu, const RestoreOptions& o) {
  std::vector<std::string> args = {
      criu.path,
      "restore",
      "--images-dir",
      o.images.string(),
      // CRIU writes its statistics into the work directory: by default that is the images
      // directory, i.e. the artifact, which restore must never modify (copies share it).
      "--work-dir",
      o.log.parent_path().string(),
      "--log-file",
      o.log.string(),
      "-v4",
      // The copy runs on after criu exits, as a child of gpusnap's namespace init.
      "--restore-detached",
      "--pidfile",
      o.pidfile.string(),
      // Established connections come back: those between processes of the tree (NCCL's and
      // gloo's between ranks, a server and its workers) must keep working. A connection to a
      // peer outside the tree finds nobody in the copy's fresh network namespace and is reset
      // at its first packet, as after a peer's restart.
      "--tcp-established",
      "--ext-unix-sk",
      "--file-locks",
  };
  if (o.sibling) args.push_back("--restore-sibling");
  if (o.keep_cgroups) args.push_back("--manage-cgroups=ignore");
  if (o.shell_job) args.push_back("--shell-job");
  for (const auto& inherit : o.inherit) {
    args.push_back("--inherit-fd");
    args.push_back("fd[" + std::to_string(inherit.fd) + "]:" + inherit.key);
  }
  return args;
}

std::vector<std::string> log_errors(const std::filesystem::path& log, size_t max_lines) {
  std::ifstream in(log);
  std::vector<std::string> errors;
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("Error") == std::string::npos) continue;
    // Logged as errors by CRIU but harmless, both when it runs inside a container: it cannot
    // raise its own fd limit, and its probe of the kernel finds no /dev/net/tun there (it
    // dumps no tun device then).
    if (line.find("RLIMIT_NOFILE") != std::string::npos) continue;
    if (line.find("tun: Unable to create tun") != std::string::npos) continue;
    errors.push_back(line);
  }
  if (errors.size() > max_lines) {
    errors.erase(errors.begin(), errors.end() - static_cast<std::ptrdiff_t>(max_lines));
  }
  return errors;
}

pid_t highest_task_id(const std::filesystem::path& images) {
  pid_t highest = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(images, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    constexpr std::string_view kPrefix = "core-", kSuffix = ".img";
    if (name.size() <= kPrefix.size() + kSuffix.size() || !name.starts_with(kPrefix) ||
        !name.ends_with(kSuffix)) {
      continue;
    }
    const std::string digits =
        name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
    pid_t id = 0;
    const auto [end_ptr, err] = std::from_chars(digits.data(), digits.data() + digits.size(), id);
    if (err == std::errc() && end_ptr == digits.data() + digits.size() && id > highest) {
      highest = id;
    }
  }
  return highest;
}

std::string summarize_failure(const std::filesystem::path& log) {
  auto errors = log_errors(log, 50);
  // The last lines are often the generic "Dumping FAILED."; the first error is the cause.
  for (const auto& line : errors) {
    if (line.find("FAILED") != std::string::npos) continue;
    auto paren = line.find("): ");
    return paren == std::string::npos ? line : line.substr(paren + 3);
  }
  return errors.empty() ? "no error lines in its log" : errors.back();
}

std::string inherit_key(const std::string& target) {
  if (target.empty() || target == "/dev/null") return {};
  if (target.front() == '/') {
    // A path that was deleted while open cannot be matched by name.
    if (target.size() > 10 && target.compare(target.size() - 10, 10, " (deleted)") == 0) return {};
    return target.substr(1);
  }
  if (target.rfind("pipe:[", 0) == 0 || target.rfind("socket:[", 0) == 0) return target;
  return {};
}

}  // namespace gpusnap::criu
