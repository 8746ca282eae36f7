#include "tier/folder_format.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/json.h"
#include "gpusnap/error.h"

namespace gpusnap::tier::folder {
namespace {

// The index nests three levels ({"files":[{...}]}); anything deeper is not an index, and is
// refused before the parser builds it.
constexpr int kIndexDepth = 3;

bool all_digits(std::string_view s, std::size_t max) {
  if (s.empty() || s.size() > max) return false;
  for (const char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

Error file_error(const std::string& what, const std::filesystem::path& path, int err) {
  return Error(ErrorKind::kInternal,
               "memory tier: " + what + " " + path.string() + ": " + errno_text(err));
}

// The count `key` of `obj`: a whole number of at least 0 (nlohmann would turn -1 into 2^64 - 1).
std::uint64_t count_at(const nlohmann::json& obj, const char* key) {
  const nlohmann::json& v = obj.at(key);
  if (!v.is_number_unsigned()) {
    throw std::invalid_argument(std::string(key) + ": " + json_text::brief(v) +
                                " is not a whole number of at least 0");
  }
  return v.get<std::uint64_t>();
}

// Reads the members of a parsed index; throws nlohmann's type and out-of-range errors, or
// std::invalid_argument with the reason for a value the format does not allow.
TierIndex index_from(const nlohmann::json& doc) {
  if (!doc.is_object() || doc.at("format") != "gpusnap-tier" || doc.at("version") != 1) {
    throw std::invalid_argument("an index of another format than gpusnap-tier version 1");
  }
  TierIndex index;
  index.pid = count_at(doc, "pid");
  index.bytes = count_at(doc, "bytes");
  const auto& files = doc.at("files");
  const auto& gpus = doc.at("gpus");
  if (!files.is_array() || files.size() > kMaxDrainFiles) {
    throw std::invalid_argument("files: not an array of at most " + std::to_string(kMaxDrainFiles));
  }
  if (!gpus.is_array() || gpus.size() > kMaxIndexGpus) {
    throw std::invalid_argument("gpus: not an array of at most " + std::to_string(kMaxIndexGpus));
  }
  const std::string pid = std::to_string(index.pid);
  std::set<std::string> seen;
  for (const auto& f : files) {
    IndexFile file{f.at("path").get<std::string>(), count_at(f, "size")};
    const Entry e = classify(file.path);
    if (e.kind != EntryKind::kDrainFile || e.pid != pid) {
      throw std::invalid_argument("files: " + json_text::brief(f.at("path")) +
                                  " is not a drain file of process " + pid);
    }
    if (!seen.insert(file.path).second) {
      throw std::invalid_argument("files: " + file.path + " twice");
    }
    index.files.push_back(std::move(file));
  }
  seen.clear();
  for (const auto& g : gpus) {
    IndexGpu gpu{g.at("uuid").get<std::string>(), count_at(g, "bytes")};
    if (gpu.uuid.empty() || gpu.uuid.size() > kMaxUuidChars) {
      throw std::invalid_argument("gpus: a UUID of 1 to " + std::to_string(kMaxUuidChars) +
                                  " characters expected");
    }
    if (!seen.insert(gpu.uuid).second) throw std::invalid_argument("gpus: " + gpu.uuid + " twice");
    index.gpus.push_back(std::move(gpu));
  }
  return index;
}

}  // namespace

std::string drain_file_name(std::string_view pid, std::size_t worker) {
  return std::string(pid) + "-w" + std::to_string(worker) + ".img";
}

std::string index_name(std::string_view pid) { return std::string(pid) + ".json"; }

std::string layout_name(std::string_view pid) { return std::string(pid) + ".layout"; }

Entry classify(std::string_view name) {
  const auto with = [&](EntryKind kind, std::string_view pid) {
    return all_digits(pid, kMaxPidDigits) ? Entry{kind, std::string(pid)} : Entry{};
  };
  if (name.ends_with(".json")) return with(EntryKind::kIndex, name.substr(0, name.size() - 5));
  if (name.ends_with(".layout")) return with(EntryKind::kLayout, name.substr(0, name.size() - 7));
  if (name.ends_with(".img")) {
    const std::string_view stem = name.substr(0, name.size() - 4);
    const auto dash = stem.find("-w");
    if (dash == std::string_view::npos || !all_digits(stem.substr(dash + 2), kMaxWorkerDigits)) {
      return {};
    }
    return with(EntryKind::kDrainFile, stem.substr(0, dash));
  }
  return {};
}

Entry classify_in_artifact(std::string_view path) {
  const std::string_view dir(kDirName);
  if (!path.starts_with(dir) || path.size() <= dir.size() || path[dir.size()] != '/') return {};
  return classify(path.substr(dir.size() + 1));
}

std::string index_text(const TierIndex& index) {
  // ordered_json: the members in the order the format documents, as every drain wrote them.
  nlohmann::ordered_json doc = {{"format", "gpusnap-tier"},
                                {"version", 1},
                                {"pid", index.pid},
                                {"bytes", index.bytes},
                                {"files", nlohmann::ordered_json::array()},
                                {"gpus", nlohmann::ordered_json::array()}};
  for (const auto& f : index.files) doc["files"].push_back({{"path", f.path}, {"size", f.size}});
  for (const auto& g : index.gpus) doc["gpus"].push_back({{"uuid", g.uuid}, {"bytes", g.bytes}});
  return doc.dump() + "\n";
}

void write_index(const std::filesystem::path& dir, const TierIndex& index) {
  const std::string text = index_text(index);
  const auto path = dir / index_name(index.pid);
  const auto tmp = dir / (index_name(index.pid) + ".tmp");
  common::UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw file_error("cannot create", tmp, errno);
  try {
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw file_error("cannot write", tmp, n < 0 ? errno : ENOSPC);
      done += static_cast<std::size_t>(n);
    }
    if (const int err = fd.close_checked(); err != 0) throw file_error("cannot write", tmp, err);
    if (::rename(tmp.c_str(), path.c_str()) != 0) throw file_error("cannot rename", tmp, errno);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

std::optional<TierIndex> parse_index(std::string_view text, std::string* why) {
  const auto refuse = [why](const std::string& reason) -> std::optional<TierIndex> {
    if (why != nullptr) *why = reason;
    return std::nullopt;
  };
  if (text.size() > kMaxIndexBytes) return refuse("larger than 1 MiB");
  if (json_text::nesting_depth(text, kIndexDepth) > kIndexDepth) {
    return refuse("nested deeper than an index");
  }
  std::string parse_why;
  const std::optional<nlohmann::json> doc = json_text::parse(text, &parse_why);
  if (!doc) return refuse(parse_why);
  try {
    return index_from(*doc);
  } catch (const nlohmann::json::exception& e) {
    return refuse(e.what());
  } catch (const std::invalid_argument& e) {
    return refuse(e.what());
  }
}

}  // namespace gpusnap::tier::folder
