#include "store/reach.h"

#include <cstdio>
#include <future>
#include <utility>

#include "criu/criu.h"
#include "engine/compat.h"
#include "gpu/driver.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "store/digest.h"

namespace gpusnap::store {

namespace {

// check_host() with the driver it opened (when options.driver is null) kept in `owned`.
void check_host_with(const Manifest& manifest, const ReachOptions& options,
                     std::unique_ptr<gpu::Driver>& owned) {
  const auto criu = criu::locate(options.criu_path);
  gpu::Driver& driver = owned ? *owned : gpu::given_or_nvidia(options.driver, owned);
  engine::check_restorable(manifest, criu.version, driver, options.gpu_map, options.replicas);
}

}  // namespace

void check_host(const Manifest& manifest, const ReachOptions& options) {
  std::unique_ptr<gpu::Driver> owned;
  check_host_with(manifest, options, owned);
}

SnapshotSource::SnapshotSource(const std::string& where, const ReachOptions& options,
                               Arrival arrival, Reporter& reporter) {
  if (OciRef::is_oci(where)) {
    reach_remote(where, options, arrival, reporter);
  } else {
    reach_local(where, options);
  }
}

SnapshotSource::~SnapshotSource() = default;

void SnapshotSource::reach_local(const std::string& where, const ReachOptions& options) {
  artifact_ = where;
  if (options.any_host) return;
  check_host_with(Artifact::open(artifact_).manifest(), options, driver_);
  checked_ = true;
}

void SnapshotSource::reach_remote(const std::string& where, const ReachOptions& options,
                                  Arrival arrival, Reporter& reporter) {
  OciRef ref = OciRef::parse(where);
  // The host's facts the check needs (CRIU's version, a process run; the driver opened, NVML
  // initialised, every GPU's facts) gathered while the registry answers for the snapshot:
  // they came after its answers, on the way to the first chunk (`criu --version` alone took
  // ~0.08 s through the CRIU prefix's loader on the development machine). Awaited before the
  // check; a registry that fails first is the error reported.
  std::future<void> host_facts;
  if (!options.any_host) {
    host_facts = std::async(std::launch::async, [&] {
      criu::locate(options.criu_path);  // its version is kept for the check (criu/criu.h)
      gpu::Driver& driver = gpu::given_or_nvidia(options.driver, driver_);
      if (driver.available()) driver.facts();  // NVML initialised; the check asks again
    });
  }
  const auto check = [&](const Manifest& manifest) {
    host_facts.get();
    check_host_with(manifest, options, driver_);
  };
  std::optional<RemoteSnapshot> snap;
  TransferOptions transfer = options.transfer;
  if (!ref.digest.empty() && transfer.policy) {
    // Named by its digest: checked here, before a node copy of it is looked for or pulled, as
    // a tag's is in read_remote below. A copy found here is no exception: the policy may have
    // changed since it was pulled.
    check_signature(*transfer.policy, ref, ref.digest, transfer.registry);
  }
  if (ref.digest.empty()) {
    // A tag is resolved first (its manifest and layout), so that a copy already here is found
    // under its digest whatever name asked for it, and the manifest checked is the one pulled
    // whatever the tag names meanwhile.
    Phases phases(reporter);
    snap = phases.run("resolve", [&] { return read_remote(ref, transfer); });
    ref.digest = snap->digest;
    ref.tag.clear();
  }
  transfer.policy = nullptr;  // checked above, for the digest everything below reads
  reference_ = ref.by_digest(ref.digest);
  digest_ = ref.digest;
  // Taken before the copy is looked for: a pull or restore of the same snapshot on this node
  // pulling now is waited for, and its copy then found complete, not fetched a second time.
  common::UniqueFd pulling = lock_node_copy(options.pulled, digest_hex(digest_), reporter);
  auto copy = node_copy(options.cache, options.pulled, ref, [&] {
    if (!snap) snap = read_remote(ref, transfer);
    return snap->layout;
  });
  artifact_ = copy.path;
  use_ = std::move(copy.use);
  // A copy already here is verified, then checked from its own manifest: by digest, nothing is
  // read from the registry at all. One that fails its verification is set aside and pulled
  // again, under the same lock.
  if (copy.found && (!options.verify_copy || copy_intact(reporter))) {
    pulling.reset();
    verified_ = options.verify_copy;
    if (!options.any_host) {
      check(snap ? Manifest::from_json(snap->layout.manifest)
                 : Artifact::open(artifact_).manifest());
    }
    checked_ = !options.any_host;
    return;
  }
  // Refused here, before any chunk, where the snapshot could not be restored.
  if (!snap) snap = read_remote(ref, transfer);
  if (!options.any_host) check(Manifest::from_json(snap->layout.manifest));
  checked_ = !options.any_host;
  PullOptions o;
  o.transfer = transfer;
  o.output = artifact_;
  o.output_in_cache = true;
  o.cache = options.cache;
  o.cache_budget = options.cache_budget;
  o.snapshot = std::move(snap);
  pulls_ = true;
  if (arrival == Arrival::kBeforeReturning) {
    result_ = pull(ref, o, reporter);
  } else {
    stream_ = std::make_unique<StreamingPull>(ref, std::move(o), reporter, std::move(pulling));
  }
}

bool SnapshotSource::copy_intact(Reporter& reporter) {
  std::string problem;
  try {
    Phases phases(reporter);
    const auto problems = phases.run("verify", [&] {
      return Artifact::open(artifact_).verify({0, &reporter});
    });
    if (problems.empty()) return true;
    problem = problems[0].path + ": " + problems[0].problem;
    if (problems.size() > 1) problem += " (and " + std::to_string(problems.size() - 1) + " more)";
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kBadArtifact) throw;
    problem = e.what();
  }
  set_aside_node_copy(artifact_);
  reporter.note("the node's copy " + artifact_.string() + " is damaged (" + problem +
                "): set aside, pulling it again from the node cache and the registry");
  return false;
}

void SnapshotSource::prepare(RestoreOptions& options) {
  options.artifact = artifact_;
  options.arriving = stream_.get();
  options.host_checked = checked_;
  // The driver the check opened, for the restore: opening it again (NVML's initialisation and
  // every GPU's facts) would cost the restore its time a second time.
  if (options.driver == nullptr && driver_) options.driver = driver_.get();
  // Verified here a moment ago, every byte: not read a second time.
  if (verified_) options.verify = false;
}

const PullResult* SnapshotSource::pulled() const {
  if (result_) return &*result_;
  return stream_ ? stream_->ended() : nullptr;
}

std::string SnapshotSource::summary() const {
  if (!remote()) return "";
  if (!pulls_) {
    return "using " + artifact_.string() + ", pulled before" +
           (verified_ ? " (verified: every byte against its manifest)" : "");
  }
  const PullResult* p = pulled();
  const std::string how = stream_ ? " while restoring" : "";
  if (p == nullptr) return "pulling " + reference_ + how + " did not end";
  char cpu[128];
  std::snprintf(cpu, sizeof cpu, "; CPU %.2f s fetching, %.2f s decompressing, %.2f s writing",
                p->cpu.fetch, p->cpu.decode, p->cpu.write);
  return "pulled " + reference_ + how + ": " + std::to_string(p->chunks_fetched) +
         " chunks fetched, " + std::to_string(p->chunks_from_cache) + " from the node cache" + cpu;
}

}  // namespace gpusnap::store
