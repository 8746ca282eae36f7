#include "engine/death_watch.h"

#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "common/fs.h"

namespace gpusnap::engine {

namespace {

// Bounds on what is read from the kernel log: records per check, kept lines, and the text
// quoted from one line.
constexpr int kMaxRecordsPerRead = 20000;
constexpr size_t kMaxKeptLines = 4096;
constexpr size_t kMaxQuotedChars = 240;
// /proc/PID/stat field numbers (proc(5)), counted from 1.
constexpr size_t kStartTimeField = 22;
constexpr size_t kExitCodeField = 52;

std::string field(const std::vector<std::string>& fields, size_t number) {
  return number >= 3 && number - 3 < fields.size() ? fields[number - 3] : std::string();
}

std::set<pid_t> threads_of(pid_t pid) {
  std::set<pid_t> out{pid};
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    auto tid = static_cast<pid_t>(std::strtol(e.path().filename().c_str(), nullptr, 10));
    if (tid > 0) out.insert(tid);
  }
  return out;
}

uint64_t to_u64(const std::string& text) { return std::strtoull(text.c_str(), nullptr, 10); }

}  // namespace

std::vector<std::string> stat_fields(pid_t pid) {
  std::string stat;
  if (!fs::try_read_file("/proc/" + std::to_string(pid) + "/stat", &stat)) return {};
  // The command name (field 2) may hold spaces and parentheses: the fields start after the
  // last ')'.
  auto close = stat.rfind(')');
  if (close == std::string::npos) return {};
  std::vector<std::string> out;
  std::istringstream in(stat.substr(close + 1));
  for (std::string f; in >> f;) out.push_back(f);
  return out;
}

std::string describe_wait_status(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* abbrev = ::sigabbrev_np(sig);
    std::string text = "was killed by " + (abbrev != nullptr ? "SIG" + std::string(abbrev)
                                                             : "signal " + std::to_string(sig));
    if (WCOREDUMP(status)) text += " (core dumped)";
    return text;
  }
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

DeathWatch::DeathWatch(const std::vector<proc::Process>& tree) {
  for (const auto& p : tree) {
    Watched w;
    w.pid = p.pid;
    w.comm = p.comm;
    w.start_time = to_u64(field(stat_fields(p.pid), kStartTimeField));
    w.threads = threads_of(p.pid);
    watched_.push_back(std::move(w));
  }
  // Only what the kernel logs from now on matters. Unreadable (no CAP_SYSLOG, no /dev/kmsg in
  // a container): deaths are then told from /proc alone.
  kmsg_ = common::UniqueFd(::open("/dev/kmsg", O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (kmsg_ && ::lseek(kmsg_.get(), 0, SEEK_END) < 0) kmsg_.reset();
}

void DeathWatch::read_kernel_log() noexcept {
  if (!kmsg_) return;
  char record[8192];
  for (int i = 0; i < kMaxRecordsPerRead; ++i) {
    ssize_t n = ::read(kmsg_.get(), record, sizeof record - 1);
    if (n < 0 && (errno == EINTR || errno == EPIPE)) continue;  // EPIPE: records overwritten
    if (n <= 0) return;                                         // EAGAIN: nothing more
    // "prio,seq,usec,flags;message\n continuation lines": the message is what is kept.
    std::string text(record, static_cast<size_t>(n));
    auto semi = text.find(';');
    if (semi == std::string::npos) continue;
    auto message = text.substr(semi + 1, text.find('\n', semi) - semi - 1);
    if (kernel_lines_.size() < kMaxKeptLines) kernel_lines_.push_back(std::move(message));
  }
}

std::string DeathWatch::kernel_says(const Watched& w) const {
  for (const auto& line : kernel_lines_) {
    for (pid_t tid : w.threads) {
      // Fault reports name the thread as "comm[tid]" (segfault, traps, general protection).
      if (line.find("[" + std::to_string(tid) + "]") == std::string::npos) continue;
      return line.size() > kMaxQuotedChars ? line.substr(0, kMaxQuotedChars) + "..." : line;
    }
  }
  return {};
}

void DeathWatch::forget(pid_t pid) noexcept {
  std::erase_if(watched_, [&](const Watched& w) { return w.pid == pid; });
}

std::vector<std::string> DeathWatch::deaths() noexcept {
  std::vector<std::string> out;
  try {
    std::vector<const Watched*> dead;
    std::vector<std::string> how;
    for (auto& w : watched_) {
      auto fields = stat_fields(w.pid);
      bool same = !fields.empty() && to_u64(field(fields, kStartTimeField)) == w.start_time;
      if (same && field(fields, 3) != "Z") {
        // Alive: its threads of now are the ones a later fault line may name.
        auto threads = threads_of(w.pid);
        w.threads.insert(threads.begin(), threads.end());
        continue;
      }
      dead.push_back(&w);
      if (same) {
        auto status = std::strtol(field(fields, kExitCodeField).c_str(), nullptr, 10);
        how.push_back(describe_wait_status(static_cast<int>(status)));
      } else {
        how.push_back("exited (reaped by its parent before gpusnap could read how)");
      }
    }
    if (dead.empty()) return out;
    read_kernel_log();
    for (size_t i = 0; i < dead.size(); ++i) {
      std::string line =
          "process " + std::to_string(dead[i]->pid) + " (" + dead[i]->comm + ") " + how[i];
      if (auto said = kernel_says(*dead[i]); !said.empty()) line += " (kernel: " + said + ")";
      out.push_back(std::move(line));
    }
  } catch (const std::exception&) {
    // Out of memory while formatting: what was gathered stands.
  }
  return out;
}

}  // namespace gpusnap::engine
