#include "container/runtime_root.h"

#include <algorithm>
#include <regex>
#include <system_error>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "gpusnap/error.h"

namespace gpusnap::container {

namespace {

namespace stdfs = std::filesystem;

// A task's options.json is a few runtime options; anything larger is not one.
constexpr size_t kOptionsLimit = 64 << 10;

// The subdirectories of `dir`, sorted; none when it is absent or unreadable.
std::vector<stdfs::path> subdirectories(const stdfs::path& dir) {
  std::vector<stdfs::path> dirs;
  std::error_code ec;
  for (stdfs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->is_directory(ec) && !it->is_symlink(ec)) dirs.push_back(it->path());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

// The runc roots containerd's tasks name in their options (`Root`), one per namespace: the
// shim runs runc with --root ROOT/NAMESPACE.
void roots_from_options(const stdfs::path& state, std::vector<stdfs::path>& roots) {
  for (const auto& ns : subdirectories(state / "io.containerd.runtime.v2.task")) {
    for (const auto& task : subdirectories(ns)) {
      std::error_code ec;
      auto size = stdfs::file_size(task / "options.json", ec);
      std::string text;
      if (ec || size > kOptionsLimit || !fs::try_read_file(task / "options.json", &text)) continue;
      auto doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (!doc.is_object() || !doc.contains("root") || !doc["root"].is_string()) continue;
      stdfs::path root = doc["root"].get<std::string>();
      if (root.is_absolute()) roots.push_back(root / ns.filename());
    }
  }
}

std::string joined(const std::vector<stdfs::path>& paths) {
  std::string s;
  for (const auto& p : paths) s += (s.empty() ? "" : ", ") + p.string();
  return s.empty() ? "none exists" : s;
}

}  // namespace

std::vector<stdfs::path> runtime_roots(const RootSearch& search) {
  std::vector<stdfs::path> candidates = search.runc_roots;
  for (const auto& parent : search.namespaced_roots) {
    for (const auto& ns : subdirectories(parent)) candidates.push_back(ns);
  }
  for (const auto& state : search.containerd_states) roots_from_options(state, candidates);
  std::vector<stdfs::path> roots;
  for (const auto& c : candidates) {
    std::error_code ec;
    if (!stdfs::is_directory(c, ec)) continue;
    if (std::find(roots.begin(), roots.end(), c) == roots.end()) roots.push_back(c);
  }
  return roots;
}

stdfs::path find_runtime_root(const std::string& id, const RootSearch& search) {
  // runc's own rule for an id; it also keeps the id a single path component.
  static const std::regex kId(R"([\w+.-]{1,1024})");
  if (!std::regex_match(id, kId) || id == "." || id == "..") {
    throw Error(ErrorKind::kUsage, "'" + id.substr(0, 200) + "' is not a container id",
                "pass the id as the runtime lists it (`ctr -n k8s.io task ls`, `crictl ps`)");
  }
  auto roots = runtime_roots(search);
  std::vector<stdfs::path> holders;
  for (const auto& root : roots) {
    std::error_code ec;
    if (stdfs::is_regular_file(root / id / "state.json", ec)) holders.push_back(root);
  }
  if (holders.empty()) {
    throw Error(
        ErrorKind::kNotFound,
        "container " + id + " was not found in the runtime roots searched (" + joined(roots) + ")",
        "check the id (`ctr -n k8s.io task ls`, `crictl ps`), or name the runtime's "
        "state directory with --runtime-root");
  }
  if (holders.size() > 1) {
    throw Error(ErrorKind::kUsage,
                "container " + id + " is in " + std::to_string(holders.size()) +
                    " runtime roots (" + joined(holders) + ")",
                "name the one to use with --runtime-root");
  }
  return holders.front();
}

}  // namespace gpusnap::container
