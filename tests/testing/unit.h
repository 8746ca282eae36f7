// Helpers shared by the tests (header-only): a scratch directory, catching gpusnap::Error, and
// the small assertions and file writes the unit tests repeat. The system tests get these through
// testing/harness.h.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include "gpusnap/error.h"

namespace gpusnap::testing {

// A fresh directory under the temporary directory, removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "gpusnap-test-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& leaf) const { return path_ / leaf; }

 private:
  std::filesystem::path path_;
};

// Runs `body`; the gpusnap::Error it throws, or nullopt when it throws none.
template <typename Body>
std::optional<Error> error_of(Body&& body) {
  try {
    body();
  } catch (const Error& e) {
    return e;
  }
  return std::nullopt;
}

// Runs `body`, which must throw gpusnap::Error, and returns the error; a test failure if it
// throws none.
template <typename Body>
Error catch_error(Body&& body) {
  if (auto e = error_of(std::forward<Body>(body))) return *std::move(e);
  ADD_FAILURE() << "no gpusnap::Error thrown";
  return Error(ErrorKind::kInternal, "no error");
}

// Whether `text` contains `part`; on failure the assertion prints both.
inline ::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

// Writes `data` to `path` (creating its parent directories), replacing what was there.
inline void write(const std::filesystem::path& path, const std::string& data) {
  std::filesystem::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
  ASSERT_TRUE(out.good()) << path;
}

// A pid that certainly belonged to a process which is gone: a child we forked and reaped.
inline pid_t dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// Sets an environment variable for one test and puts the old value (or its absence) back.
// Tests set it before they start any thread.
// NOLINTBEGIN(concurrency-mt-unsafe)
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};
// NOLINTEND(concurrency-mt-unsafe)

}  // namespace gpusnap::testing
