#include "agent/registry_storage.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "gpusnap/error.h"
#include "store/blob_store.h"
#include "store/digest.h"
#include "store/transfer.h"

namespace gpusnap::agent {

namespace {

using nlohmann::json;
namespace sfs = std::filesystem;

// The store's phases (open, upload, manifest; manifest, fetch, cache) as the operation shows
// them: "push-upload", "pull-fetch", apart from the engine's own phases of the same operation.
class PrefixReporter final : public Reporter {
 public:
  PrefixReporter(Reporter& to, std::string prefix) : to_(to), prefix_(std::move(prefix)) {}
  void phase_started(std::string_view name) override { to_.phase_started(named(name)); }
  void phase_finished(std::string_view name, double seconds) override {
    to_.phase_finished(named(name), seconds);
  }
  void progress(std::string_view name, uint64_t done, uint64_t total) override {
    to_.progress(named(name), done, total);
  }
  void note(std::string_view text) override { to_.note(text); }

 private:
  std::string named(std::string_view name) const { return prefix_ + std::string(name); }
  Reporter& to_;
  std::string prefix_;
};

Error bad_setting(const std::string& what, const std::string& hint) {
  return Error(ErrorKind::kUsage, what, hint);
}

// A directory only root may enter: what it will hold are workloads' memories.
void private_dir(const sfs::path& dir) {
  std::error_code ec;
  sfs::create_directories(dir, ec);
  if (ec) throw sys_error("create " + dir.string(), ec.value());
  if (::chmod(dir.c_str(), 0700) != 0) throw sys_error("chmod " + dir.string(), errno);
}

void readable_file(const std::string& file, const std::string& flag) {
  if (file.empty()) return;
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || ::access(file.c_str(), R_OK) != 0) {
    throw bad_setting(flag + " " + file + " is not a readable file",
                      "name the mounted file, e.g. the registry Secret's auth.json");
  }
}

}  // namespace

json Fetched::to_json() const {
  return {{"reference", reference},
          {"artifact", artifact.string()},
          {"pulled", pulled},
          {"chunks_fetched", chunks_fetched},
          {"bytes_fetched", bytes_fetched},
          {"chunks_from_cache", chunks_from_cache},
          {"bytes_from_cache", bytes_from_cache}};
}

RegistryStorage::RegistryStorage(RegistryStorageSettings settings)
    : settings_(std::move(settings)) {
  const std::string& text = settings_.repository;
  repository_ = store::OciRef::parse(text);
  // parse() takes "latest" for a reference without a tag: the text itself says whether one
  // was given.
  const auto path = text.substr(std::string_view(store::kOciScheme).size());
  const auto repo = path.substr(path.find('/') + 1);
  if (repo.find(':') != std::string::npos || !repository_.digest.empty()) {
    throw bad_setting("--registry " + text + " names a tag or a digest",
                      "give the repository alone, oci://HOST[:PORT]/REPO: each snapshot is "
                      "tagged with its name");
  }
  repository_.tag.clear();
  readable_file(settings_.registry.auth_file, "--registry-auth-file");
  readable_file(settings_.registry.ca_file, "--registry-ca-file");
  private_dir(settings_.cache);
  private_dir(settings_.pulled);
  // The node cache records the copies by this path and removes only what it recorded.
  settings_.pulled = sfs::absolute(settings_.pulled).lexically_normal();
}

store::OciRef RegistryStorage::tag_of(const std::string& name) const {
  store::OciRef ref = repository_;
  try {
    ref = store::OciRef::parse(repository_.str() + ":" + name);
  } catch (const Error&) {
    throw Error(ErrorKind::kUsage,
                "artifact name '" + name.substr(0, 200) +
                    "' cannot be a registry tag, which the agent's registry storage needs",
                "name the snapshot with at most 128 letters, digits, '.', '-' or '_', not "
                "starting with '.' or '-'");
  }
  return ref;
}

store::OciRef RegistryStorage::check_reference(const std::string& text) const {
  auto ref = store::OciRef::parse(text);
  if (ref.host != repository_.host || ref.repository != repository_.repository) {
    throw Error(ErrorKind::kUsage,
                "reference " + text.substr(0, 200) + " is not in the agent's registry storage " +
                    repository_.str(),
                "name a snapshot of " + repository_.str() +
                    " (the agent pulls only from its own repository, with its own credentials)");
  }
  return ref;
}

json RegistryStorage::push(const sfs::path& artifact, const std::string& name,
                           Reporter& reporter) const {
  store::TransferOptions o;
  o.registry = settings_.registry;
  o.jobs = settings_.jobs;
  PrefixReporter prefixed(reporter, "push-");
  auto r = store::push(artifact, tag_of(name), o, prefixed);
  return {{"reference", r.reference},
          {"digest", r.digest},
          {"chunks", r.sizes.chunks},
          {"stored_bytes", r.sizes.stored_bytes},
          {"chunks_uploaded", r.chunks_uploaded},
          {"bytes_uploaded", r.bytes_uploaded}};
}

Fetched RegistryStorage::fetch(const store::OciRef& ref, const RestorableCheck& check,
                               Reporter& reporter) const {
  store::PullOptions o;
  o.transfer.registry = settings_.registry;
  o.transfer.jobs = settings_.jobs;
  o.cache = settings_.cache;
  o.cache_budget = settings_.cache_budget;
  o.check = check;
  PrefixReporter prefixed(reporter, "pull-");
  // By digest: a tag is resolved first (its manifest and layout only), so that a snapshot
  // already materialised here is found under its digest whatever name it was asked by.
  store::OciRef by_digest = ref;
  if (by_digest.digest.empty()) {
    Phases phases(prefixed);
    by_digest.digest =
        phases.run("resolve", [&] { return store::read_remote(ref, o.transfer); }).digest;
    by_digest.tag.clear();
  }
  Fetched f;
  f.reference = by_digest.by_digest(by_digest.digest);
  auto copy = store::node_copy(settings_.cache, settings_.pulled, by_digest,
                               [&] { return store::read_remote(by_digest, o.transfer).layout; });
  f.artifact = copy.path;
  f.use = std::move(copy.use);
  if (copy.found) {
    reporter.note("using " + f.artifact.string() + ", pulled before");
    return f;
  }
  o.output = f.artifact;
  o.output_in_cache = true;
  auto r = store::pull(by_digest, o, prefixed);
  f.pulled = true;
  f.chunks_fetched = r.chunks_fetched;
  f.bytes_fetched = r.bytes_fetched;
  f.chunks_from_cache = r.chunks_from_cache;
  f.bytes_from_cache = r.bytes_from_cache;
  reporter.note("pulled " + f.reference + ": " + std::to_string(r.chunks_fetched) +
                " chunks fetched, " + std::to_string(r.chunks_from_cache) + " from the node cache");
  return f;
}

}  // namespace gpusnap::agent
