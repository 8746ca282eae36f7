#include "store/mirrors.h"

#include <algorithm>
#include <filesystem>
#include <regex>

#include <toml++/toml.h>

#include "common/fs.h"
#include "gpusnap/error.h"
#include "store/peers.h"

namespace gpusnap::store {

namespace {

namespace sfs = std::filesystem;

constexpr size_t kMaxFiles = 64;
constexpr size_t kMaxRegistries = 1024;
constexpr size_t kMaxMirrors = 64;

const char* env(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read before threads start
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// HOST[:PORT][/PATH] with PATH in the repository alphabet; or *.DOMAIN when `wildcard`.
bool valid_location(const std::string& s, bool wildcard) {
  static const std::regex kLocation(
      R"([A-Za-z0-9][A-Za-z0-9.-]{0,252}(:[0-9]{1,5})?(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*)");
  static const std::regex kWildcard(R"(\*\.[A-Za-z0-9][A-Za-z0-9.-]{0,250})");
  if (s.size() > 512) return false;
  return std::regex_match(s, wildcard ? kWildcard : kLocation);
}

// The reference as one string, HOST/REPOSITORY.
std::string full_name(const OciRef& ref) { return ref.host + "/" + ref.repository; }

std::string host_without_port(const std::string& host) { return host.substr(0, host.find(':')); }

}  // namespace

RegistriesConf RegistriesConf::parse(std::string_view text, const std::string& name) {
  auto bad = [&](const std::string& why) {
    return Error(ErrorKind::kUsage, "registries configuration " + name + ": " + why,
                 "fix it as containers-registries.conf(5) says, or name another file with "
                 "--registries-conf");
  };
  if (text.size() > kMaxFileBytes) throw bad("larger than 1 MiB");
  toml::table doc;
  try {
    doc = toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    throw bad(std::string("not TOML: ") + std::string(e.description()) + " at line " +
              std::to_string(e.source().begin.line));
  }
  RegistriesConf conf;
  conf.files_.push_back(name);
  const toml::node* registries = doc.get("registry");
  if (registries == nullptr) return conf;
  const toml::array* list = registries->as_array();
  if (list == nullptr) throw bad("`registry` is not an array of tables ([[registry]])");
  if (list->size() > kMaxRegistries) throw bad("more than 1,024 [[registry]] entries");
  auto string_of = [&](const toml::table& t, const char* key, const std::string& where) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return std::string();
    if (!n->is_string()) throw bad(where + ": `" + key + "` is not a string");
    return std::string(**n->as_string());
  };
  auto bool_of = [&](const toml::table& t, const char* key, const std::string& where) {
    const toml::node* n = t.get(key);
    if (n == nullptr) return false;
    if (!n->is_boolean()) throw bad(where + ": `" + key + "` is not true or false");
    return **n->as_boolean();
  };
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string where = "[[registry]] #" + std::to_string(i + 1);
    const toml::table* t = list->get(i)->as_table();
    if (t == nullptr) throw bad(where + " is not a table");
    RegistryEntry e;
    e.location = string_of(*t, "location", where);
    e.prefix = string_of(*t, "prefix", where);
    if (e.prefix.empty()) e.prefix = e.location;
    if (e.prefix.empty()) throw bad(where + " has neither `prefix` nor `location`");
    const bool wildcard = e.prefix.starts_with("*.");
    if (!valid_location(e.prefix, wildcard))
      throw bad(where + ": prefix '" + e.prefix.substr(0, 100) + "' is not HOST[:PORT][/PATH]");
    if (!e.location.empty() && (wildcard || !valid_location(e.location, false)))
      throw bad(where + ": location '" + e.location.substr(0, 100) +
                "' is not HOST[:PORT][/PATH] (a wildcard prefix takes none)");
    e.insecure = bool_of(*t, "insecure", where);
    e.blocked = bool_of(*t, "blocked", where);
    e.mirror_by_digest_only = bool_of(*t, "mirror-by-digest-only", where);
    if (const toml::node* m = t->get("mirror")) {
      const toml::array* mirrors = m->as_array();
      if (mirrors == nullptr) throw bad(where + ": `mirror` is not an array of tables");
      if (mirrors->size() > kMaxMirrors) throw bad(where + " has more than 64 mirrors");
      for (size_t k = 0; k < mirrors->size(); ++k) {
        const std::string mwhere = where + " mirror #" + std::to_string(k + 1);
        const toml::table* mt = mirrors->get(k)->as_table();
        if (mt == nullptr) throw bad(mwhere + " is not a table");
        MirrorEntry mirror;
        mirror.location = string_of(*mt, "location", mwhere);
        if (!valid_location(mirror.location, false))
          throw bad(mwhere + ": location '" + mirror.location.substr(0, 100) +
                    "' is not HOST[:PORT][/PATH]");
        mirror.insecure = bool_of(*mt, "insecure", mwhere);
        const std::string from = string_of(*mt, "pull-from-mirror", mwhere);
        if (from.empty() || from == "all") {
          mirror.pull_from = PullFrom::kAll;
        } else if (from == "digest-only") {
          mirror.pull_from = PullFrom::kDigestOnly;
        } else if (from == "tag-only") {
          mirror.pull_from = PullFrom::kTagOnly;
        } else {
          throw bad(mwhere + ": pull-from-mirror is not all, digest-only or tag-only");
        }
        e.mirrors.push_back(std::move(mirror));
      }
    }
    conf.entries_.push_back(std::move(e));
  }
  return conf;
}

void RegistriesConf::merge(RegistriesConf other) {
  for (auto& e : other.entries_) {
    auto same = std::find_if(entries_.begin(), entries_.end(),
                             [&](const RegistryEntry& x) { return x.prefix == e.prefix; });
    if (same != entries_.end()) {
      *same = std::move(e);
    } else {
      entries_.push_back(std::move(e));
    }
  }
  files_.insert(files_.end(), other.files_.begin(), other.files_.end());
}

RegistriesConf RegistriesConf::load(const std::string& explicit_file) {
  std::vector<sfs::path> files;
  bool required = false;
  if (!explicit_file.empty()) {
    files.emplace_back(explicit_file);
    required = true;
  } else if (const char* f = env("CONTAINERS_REGISTRIES_CONF")) {
    files.emplace_back(f);
    required = true;
  } else {
    files.emplace_back("/etc/containers/registries.conf");
    std::vector<sfs::path> dropins;
    std::error_code ec;
    for (const auto& e : sfs::directory_iterator("/etc/containers/registries.conf.d", ec)) {
      if (e.path().extension() == ".conf") dropins.push_back(e.path());
      if (dropins.size() > kMaxFiles) break;
    }
    std::sort(dropins.begin(), dropins.end());
    files.insert(files.end(), dropins.begin(), dropins.end());
  }
  RegistriesConf conf;
  for (const auto& file : files) {
    std::error_code ec;
    const auto size = sfs::file_size(file, ec);
    if (ec) {
      if (required) {
        throw Error(ErrorKind::kUsage,
                    "cannot read registries configuration " + file.string() + ": " + ec.message(),
                    "name an existing file with --registries-conf or CONTAINERS_REGISTRIES_CONF");
      }
      continue;
    }
    if (size > kMaxFileBytes) {
      throw Error(ErrorKind::kUsage,
                  "registries configuration " + file.string() + ": larger than 1 MiB",
                  "fix it as containers-registries.conf(5) says");
    }
    conf.merge(parse(fs::read_file(file), file.string()));
  }
  return conf;
}

const RegistryEntry* RegistriesConf::match(const OciRef& ref) const {
  const std::string full = full_name(ref);
  const std::string host = host_without_port(ref.host);
  const RegistryEntry* best = nullptr;
  size_t best_len = 0;
  for (const auto& e : entries_) {
    bool hit = false;
    if (e.prefix.starts_with("*.")) {
      const std::string domain = e.prefix.substr(1);  // ".DOMAIN"
      hit = host.size() > domain.size() && host.ends_with(domain);
    } else {
      hit = full == e.prefix || full.starts_with(e.prefix + "/");
    }
    if (hit && e.prefix.size() > best_len) {
      best = &e;
      best_len = e.prefix.size();
    }
  }
  return best;
}

std::vector<PullSource> RegistriesConf::sources_for(const OciRef& ref,
                                                    bool origin_plain_http) const {
  const RegistryEntry* e = match(ref);
  if (e == nullptr) return {{ref, origin_plain_http, false}};
  if (e->blocked) {
    throw Error(ErrorKind::kUsage,
                ref.host + "/" + ref.repository + " is blocked by the registries configuration (" +
                    e->prefix + ")",
                "pull from a registry the node allows, or change its registries.conf");
  }
  const bool wildcard = e->prefix.starts_with("*.");
  const std::string full = full_name(ref);
  // The reference with its first `matched` characters replaced by `location`.
  auto rewrite = [&](const std::string& location) {
    const size_t matched = wildcard ? ref.host.size() : e->prefix.size();
    std::string text = std::string(kOciScheme) + location + full.substr(matched);
    if (!ref.tag.empty()) text += ":" + ref.tag;
    if (!ref.digest.empty()) text += "@" + ref.digest;
    return OciRef::parse(text);
  };
  std::vector<PullSource> out;
  const bool by_digest = !ref.digest.empty();
  for (const auto& m : e->mirrors) {
    if (e->mirror_by_digest_only && !by_digest) continue;
    if (m.pull_from == PullFrom::kDigestOnly && !by_digest) continue;
    if (m.pull_from == PullFrom::kTagOnly && by_digest) continue;
    out.push_back({rewrite(m.location), m.insecure, true});
  }
  PullSource origin{e->location.empty() ? ref : rewrite(e->location),
                    origin_plain_http || e->insecure, false};
  out.push_back(std::move(origin));
  return out;
}

struct PullRegistries::Source {
  Source(const PullSource& s, RegistryOptions o)
      : registry(s.ref, std::move(o)), mirror(s.mirror) {}
  Registry registry;
  bool mirror;
  std::atomic<bool> down{false};  // failed to answer: left out for the rest of the pull
};

PullRegistries::PullRegistries(const OciRef& ref, const RegistryOptions& options)
    : ref_(ref), peers_(options.peers) {
  std::vector<PullSource> sources{{ref, options.plain_http, false}};
  if (options.mirrors) {
    sources = RegistriesConf::load(options.registries_conf).sources_for(ref, options.plain_http);
  }
  for (const auto& s : sources) {
    RegistryOptions o = options;
    o.peers = nullptr;
    o.plain_http = s.plain_http;
    if (o.plain_http) o.ca_file.clear();
    // A mirror that fails costs one attempt: the origin is behind it.
    if (s.mirror) o.retries = std::min(o.retries, 1);
    sources_.push_back(std::make_unique<Source>(s, o));
  }
}

PullRegistries::~PullRegistries() = default;

void PullRegistries::note(const std::string& text) {
  std::lock_guard lock(notes_mu_);
  if (std::find(notes_.begin(), notes_.end(), text) == notes_.end()) notes_.push_back(text);
}

std::vector<std::string> PullRegistries::take_notes() {
  std::lock_guard lock(notes_mu_);
  return std::exchange(notes_, {});
}

std::pair<std::string, std::string> PullRegistries::fetch_manifest(const std::string& digest) {
  for (auto& s : sources_) {
    if (!s->mirror) return s->registry.fetch_manifest(kMaxManifestBytes, digest);
    if (s->down) continue;
    try {
      auto got = s->registry.fetch_manifest(kMaxManifestBytes, digest);
      note("manifest from mirror " + s->registry.ref().host);
      return got;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kNotFound) s->down = true;
      note("mirror " + s->registry.ref().host + " did not serve the manifest (" + e.what() +
           "): trying the next");
    }
  }
  throw Error(ErrorKind::kInternal, "no origin among the registries of " + ref_.str());
}

std::string PullRegistries::fetch_blob(const std::string& digest, uint64_t size) {
  if (peers_) {
    // Checked against the digest and size by Peers; nullopt: the registries serve it.
    auto data = peers_->fetch(ref_, digest, size, [this](const std::string& t) { note(t); });
    if (data) {
      from_peers_ += data->size();
      return std::move(*data);
    }
  }
  for (auto& s : sources_) {
    if (!s->mirror) return s->registry.fetch_blob(digest, size);
    if (s->down) continue;
    try {
      std::string data = s->registry.fetch_blob(digest, size);  // checked against its digest
      from_mirrors_ += data.size();
      return data;
    } catch (const Error& e) {
      // Unreachable or failing: not asked again. A chunk it lacks or damaged: the next serves
      // that one.
      if (e.kind() != ErrorKind::kNotFound && e.kind() != ErrorKind::kBadArtifact) s->down = true;
      note("mirror " + s->registry.ref().host + ": " + e.what() + "; fetched from the next");
    }
  }
  throw Error(ErrorKind::kInternal, "no origin among the registries of " + ref_.str());
}

}  // namespace gpusnap::store
