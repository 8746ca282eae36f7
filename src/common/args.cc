#include "common/args.h"

#include <grp.h>

#include <charconv>

#include "gpusnap/error.h"

namespace gpusnap::args {

Args::Args(const std::string& command, const std::vector<FlagSpec>& specs,
           const std::vector<std::string>& argv)
    : command_(command) {
  auto usage_error = [&](const std::string& what) {
    return Error(ErrorKind::kUsage, what, "see `gpusnap " + command + " --help`");
  };
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& arg = argv[i];
    if (arg == "--") {
      rest_.assign(argv.begin() + static_cast<long>(i) + 1, argv.end());
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') {
      positional_.push_back(arg);
      continue;
    }
    std::string name = arg, value;
    bool inline_value = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    const FlagSpec* spec = nullptr;
    for (const auto& s : specs) {
      if (s.name == name || (!s.short_name.empty() && s.short_name == name)) spec = &s;
    }
    // NOLINTNEXTLINE(performance-inefficient-string-concatenation): thrown once, ends the loop
    if (spec == nullptr) throw usage_error("unknown option " + name + " for " + command);
    if (spec->value_name.empty()) {
      if (inline_value) throw usage_error(spec->name + " takes no value");
      value = "1";
    } else if (!inline_value) {
      if (i + 1 >= argv.size()) throw usage_error(spec->name + " needs a " + spec->value_name);
      value = argv[++i];
    }
    auto& slot = values_[spec->name];
    if (!slot.empty() && !spec->repeatable) throw usage_error(spec->name + " given twice");
    slot.push_back(value);
  }
}

Error Args::usage_error(const std::string& what) const {
  return Error(ErrorKind::kUsage, what, "see `gpusnap " + command_ + " --help`");
}

void Args::no_positional() const {
  if (!positional_.empty()) {
    throw usage_error("unexpected argument '" + positional_[0] + "' for " + command_);
  }
}

std::string Args::only_artifact() const {
  if (positional_.size() != 1) throw usage_error(command_ + " needs exactly one ARTIFACT");
  return positional_[0];
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.back();
}

std::vector<std::string> Args::all(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

long Args::get_int(const std::string& name, long fallback, long min, long max) const {
  if (!has(name)) return fallback;
  return whole_number(name, get(name), min, max, "see `gpusnap " + command_ + " --help`");
}

long whole_number(const std::string& flag, const std::string& text, long min, long max,
                  const std::string& fix) {
  // from_chars takes neither blanks nor a '+': " 5" is not a number a user meant to type.
  long v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < min || v > max) {
    throw Error(ErrorKind::kUsage,
                flag + " must be a whole number from " + std::to_string(min) + " to " +
                    std::to_string(max) + ", not '" + text + "'",
                fix);
  }
  return v;
}

gid_t group_id(const std::string& flag, const std::string& name) {
  if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos) {
    // A number: a gid the kernel can hold. (gid_t)-1 means "no change" to chown, and a wider
    // number must not wrap around to another group (4294967296 would be 0, root's).
    uint32_t gid = 0;
    const auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), gid);
    if (ec != std::errc() || end != name.data() + name.size() || gid == UINT32_MAX) {
      throw Error(ErrorKind::kUsage, flag + " " + name + " is not a group id",
                  "give a group of this host, by name or by a number below 4294967295");
    }
    return static_cast<gid_t>(gid);
  }
  const group* g = ::getgrnam(name.c_str());  // NOLINT(concurrency-mt-unsafe): see the header
  if (g == nullptr) {
    throw Error(ErrorKind::kUsage, "no group named '" + name + "' for " + flag,
                "give a group of this host, by name or number");
  }
  return g->gr_gid;
}

std::string format_help(const std::string& usage, const std::string& summary,
                        const std::vector<FlagSpec>& specs) {
  std::string out = "usage: " + usage + "\n\n" + summary + "\n\noptions:\n";
  for (const auto& s : specs) {
    std::string left = "  " + (s.short_name.empty() ? "" : s.short_name + ", ") + s.name;
    if (!s.value_name.empty()) left += " " + s.value_name;
    if (left.size() < 30)
      left.resize(30, ' ');
    else
      left += "\n" + std::string(30, ' ');
    out += left + s.help + "\n";
  }
  return out;
}

}  // namespace gpusnap::args
