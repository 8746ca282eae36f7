#include "gpusnap/error.h"

#include <cerrno>
#include <cstring>
#include <system_error>

namespace gpusnap {

std::string Error::one_line() const {
  std::string line = what();
  if (!hint_.empty()) line += " (fix: " + hint_ + ")";
  return line;
}

const char* Error::kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInternal: return "internal";
    case ErrorKind::kUsage: return "usage";
    case ErrorKind::kNotFound: return "not-found";
    case ErrorKind::kBadArtifact: return "bad-artifact";
    case ErrorKind::kIncompatible: return "incompatible";
    case ErrorKind::kNotCapturable: return "not-capturable";
    case ErrorKind::kCriu: return "criu";
    case ErrorKind::kGpu: return "gpu";
    case ErrorKind::kHandshake: return "handshake";
    case ErrorKind::kEnvironment: return "environment";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kKey: return "key";
  }
  return "internal";
}

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

Error sys_error(const std::string& what, int err) {
  // A full filesystem is the host's state, not a bug: the operator frees space and retries.
  if (err == ENOSPC || err == EDQUOT) {
    return Error(ErrorKind::kEnvironment, what + ": " + errno_text(err),
                 "free some space on that filesystem, or write elsewhere");
  }
  return Error(ErrorKind::kInternal, what + ": " + errno_text(err));
}

}  // namespace gpusnap
