// A small, strict command-line parser: every subcommand declares its flags; anything else is a
// usage error that names the flag and points at --help.
#pragma once

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gpusnap/error.h"

namespace gpusnap::args {

struct FlagSpec {
  std::string name;        // "--output"
  std::string short_name;  // "-o" or empty
  std::string value_name;  // "PATH"; empty for a boolean flag
  std::string help;
  bool repeatable = false;
};

class Args {
 public:
  // Parses argv after the subcommand. Arguments after "--" are kept as rest().
  Args(const std::string& command, const std::vector<FlagSpec>& specs,
       const std::vector<std::string>& argv);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string get(const std::string& name, const std::string& fallback = {}) const;
  std::vector<std::string> all(const std::string& name) const;
  long get_int(const std::string& name, long fallback, long min, long max) const;
  const std::vector<std::string>& positional() const { return positional_; }
  const std::vector<std::string>& rest() const { return rest_; }
  const std::string& command() const { return command_; }
  // A usage error for this command: `what`, and a hint pointing at its --help.
  Error usage_error(const std::string& what) const;
  // A usage error naming the first positional argument, for a command that takes none.
  void no_positional() const;
  // The single positional ARTIFACT argument, or a usage error.
  std::string only_artifact() const;

 private:
  std::string command_;
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positional_;
  std::vector<std::string> rest_;
};

// `text`, the value of `flag`, as a whole number from `min` to `max` (digits with an optional
// '-': no blanks, no '+'), or Error(kUsage) "FLAG must be a whole number from MIN to MAX, not
// 'TEXT'" with `fix`.
long whole_number(const std::string& flag, const std::string& text, long min, long max,
                  const std::string& fix);

// A group named by name or number, for a flag; Error(kUsage) naming the flag when there is no
// such group. Not thread-safe (getgrnam): call it before starting threads.
gid_t group_id(const std::string& flag, const std::string& name);

std::string format_help(const std::string& usage, const std::string& summary,
                        const std::vector<FlagSpec>& specs);

}  // namespace gpusnap::args
