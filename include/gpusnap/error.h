// gpusnap's one error type. Every failure the user can see is an Error: a kind (which picks the
// process exit code), a one-line message naming the cause, and a hint naming the fix.
#pragma once

#include <stdexcept>
#include <string>

namespace gpusnap {

// The kinds double as the CLI's exit codes, so they are stable: tools script against them.
enum class ErrorKind : int {
  kInternal = 1,       // a bug or an unexpected system failure
  kUsage = 2,          // bad flags or arguments
  kNotFound = 3,       // no such process or artifact
  kBadArtifact = 4,    // corrupt, truncated or foreign artifact
  kIncompatible = 5,   // the artifact cannot run on this host (arch, CPU, GPU, driver)
  kNotCapturable = 6,  // the workload holds something that cannot be captured
  kCriu = 7,           // CRIU failed
  kGpu = 8,            // the GPU driver failed or refused
  kHandshake = 9,      // the workload answered FAILED or did not answer in time
  kEnvironment = 10,   // the host lacks something gpusnap needs (CRIU, root, a GPU)
  kTimeout = 11,       // an operation ran out of time
  kKey = 12,           // no key that opens the snapshot, or a key file others may read
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message, std::string hint = {})
      : std::runtime_error(message), kind_(kind), hint_(std::move(hint)) {}

  ErrorKind kind() const { return kind_; }
  int exit_code() const { return static_cast<int>(kind_); }
  const std::string& hint() const { return hint_; }
  // "message (fix: hint)" or just the message: the single line the CLI prints.
  std::string one_line() const;
  // A stable machine-readable name for --json output ("bad-artifact", ...).
  static const char* kind_name(ErrorKind kind);

 private:
  ErrorKind kind_;
  std::string hint_;
};

// Builds an Error from errno for a failed system call: "what: strerror(errno)". kInternal, but
// kEnvironment (with a hint) for a full filesystem or quota.
Error sys_error(const std::string& what, int err);

// The text of an errno value. Unlike strerror(), safe to call from several threads at once.
std::string errno_text(int err);

}  // namespace gpusnap
