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
  o.recipients = settings_.recipients;
  o.dedup_secret = settings_.dedup_secret;
  o.counters = settings_.counters;
  PrefixReporter prefixed(reporter, "push-");
  auto r = store::push(artifact, tag_of(name), o, prefixed);
  return {{"reference", r.reference},
          {"digest", r.digest},
          {"chunks", r.sizes.chunks},
          {"stored_bytes", r.sizes.stored_bytes},
          {"chunks_uploaded", r.chunks_uploaded},
          {"bytes_uploaded", r.bytes_uploaded}};
}

store::ReachOptions RegistryStorage::reach_options() const {
  store::ReachOptions o;
  o.pulled = settings_.pulled;
  o.transfer.registry = settings_.registry;
  o.transfer.jobs = settings_.jobs;
  o.transfer.policy = settings_.policy;
  o.transfer.decryption = settings_.decryption;
  o.transfer.counters = settings_.counters;
  o.cache = settings_.cache;
  o.cache_budget = settings_.cache_budget;
  return o;
}

}  // namespace gpusnap::agent
