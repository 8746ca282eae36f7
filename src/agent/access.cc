#include "agent/access.h"

#include <cctype>
#include <cstddef>

namespace gpusnap::agent {

bool token_matches(std::string_view given, std::string_view expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff |= static_cast<unsigned char>(g ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0 && !expected.empty();
}

bool bearer_matches(std::string_view authorization, std::string_view expected) {
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() <= kScheme.size()) return false;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(authorization[i])) != kScheme[i]) return false;
  }
  return token_matches(authorization.substr(kScheme.size()), expected);
}

int http_status(const Error& error) {
  switch (error.kind()) {
    case ErrorKind::kUsage: return 400;
    case ErrorKind::kNotFound: return 404;
    case ErrorKind::kBadArtifact: return 422;
    case ErrorKind::kEnvironment: return 501;
    case ErrorKind::kKey: return 403;  // the node lacks the key the snapshot needs
    default: return 500;
  }
}

}  // namespace gpusnap::agent
