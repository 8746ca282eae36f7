#include "cli/store_cli.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>

#include <nlohmann/json.hpp>

#include "cli/documents.h"
#include "common/fs.h"
#include "common/stop_signals.h"
#include "common/utc.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "gpusnap/restore.h"
#include "store/blob_store.h"
#include "store/digest.h"
#include "store/flags.h"
#include "store/transfer.h"

namespace gpusnap::cli {

namespace {

using nlohmann::json;
namespace sfs = std::filesystem;

// Progress of a transfer: bytes, rate and time left. On a terminal a redrawn line; with --json
// one JSON line on stderr about every half second (stdout keeps the single result document).
class TransferReporter final : public Reporter {
 public:
  TransferReporter(bool json, bool quiet)
      : json_(json), quiet_(quiet), terminal_(::isatty(STDERR_FILENO) == 1) {}

  void phase_started(std::string_view name) override {
    if (!json_ && !quiet_) terminal_.phase_started(name);
  }
  void phase_finished(std::string_view name, double seconds) override {
    if (!json_ && !quiet_) terminal_.phase_finished(name, seconds);
  }
  void progress(std::string_view name, uint64_t done, uint64_t total) override {
    if (quiet_ || total == 0) return;
    const auto now = std::chrono::steady_clock::now();
    auto& state = phases_[std::string(name)];
    if (state.start == std::chrono::steady_clock::time_point{}) state.start = now;
    const auto every = json_ ? std::chrono::milliseconds(500) : std::chrono::milliseconds(200);
    if (done < total && now - state.last < every) return;
    state.last = now;
    const double seconds = std::chrono::duration<double>(now - state.start).count();
    const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0;
    const double left = rate > 0 ? static_cast<double>(total - done) / rate : -1;
    if (json_) {
      std::fprintf(stderr, "%s\n",
                   json{{"progress",
                         {{"phase", name},
                          {"bytes_done", done},
                          {"bytes_total", total},
                          {"bytes_per_second", static_cast<uint64_t>(rate)},
                          {"seconds_left", left < 0 ? json() : json(left)}}}}
                       .dump()
                       .c_str());
    } else if (::isatty(STDERR_FILENO) == 1) {
      // Rounded by printf, not lround: gpusnap needs no libm, and runs in containers whose
      // root holds only libc (tests/testing/containers.cc builds such a root).
      std::array<char, 32> left_text{};
      std::snprintf(left_text.data(), left_text.size(), "%.0f s", left);
      std::fprintf(stderr, "  %-22.*s %s of %s, %s/s, %s left    \r", static_cast<int>(name.size()),
                   name.data(), fs::human_bytes(done).c_str(), fs::human_bytes(total).c_str(),
                   fs::human_bytes(static_cast<uint64_t>(rate)).c_str(),
                   left < 0 ? "?" : left_text.data());
    }
  }
  void note(std::string_view text) override {
    if (json_) {
      notes.emplace_back(text);
    } else {
      terminal_.note(text);
    }
  }

  std::vector<std::string> notes;

 private:
  struct PhaseState {
    std::chrono::steady_clock::time_point start{};
    std::chrono::steady_clock::time_point last{};
  };
  bool json_;
  bool quiet_;
  TerminalReporter terminal_;
  std::map<std::string, PhaseState> phases_;
};

json sizes_json(const store::SnapshotSizes& s) {
  return {{"bytes", s.apparent_bytes},
          {"data_bytes", s.data_bytes},
          {"stored_bytes", s.stored_bytes},
          {"chunks", s.chunks}};
}

json phases_json(const std::vector<PhaseTiming>& phases) {
  json out = json::array();
  for (const auto& p : phases) out.push_back({{"name", p.name}, {"seconds", p.seconds}});
  return out;
}

double total_seconds(const std::vector<PhaseTiming>& phases) {
  double s = 0;
  for (const auto& p : phases) s += p.seconds;
  return s;
}

std::string rate(uint64_t bytes, double seconds) {
  return seconds > 0
             ? fs::human_bytes(static_cast<uint64_t>(static_cast<double>(bytes) / seconds)) + "/s"
             : "-";
}

store::TransferOptions transfer_options(const Args& args) {
  store::TransferOptions o;
  store::read_registry_flags(args, "--", o.registry);
  o.registry.retries = static_cast<int>(args.get_int("--retries", 5, 0, 100));
  o.registry.max_rate = static_cast<uint64_t>(args.get_int("--max-rate-mib", 0, 0, 1 << 20)) << 20;
  o.jobs = static_cast<int>(args.get_int("--jobs", store::default_jobs(), 1, 256));
  // Read before anything is fetched: a key file others may read is refused first.
  o.decryption = store::decryption_keys(args);
  return o;
}

store::OciRef remote_ref(const std::string& text) { return store::OciRef::parse(text); }

// The node's settings for reaching a snapshot (store/reach.h), from pull's and restore's flags.
store::ReachOptions reach_options(const Args& args) {
  store::ReachOptions o;
  o.pulled = sfs::path(args.get("--run-dir", "/run/gpusnap")) / "pulled";
  o.transfer = transfer_options(args);
  o.cache = store::cache_flag(args);
  o.cache_budget = store::cache_budget_flag(args);
  o.criu_path = args.get("--criu");
  o.transfer.policy = store::signature_policy(args);
  return o;
}

store::PullOptions pull_options(const Args& args) {
  store::PullOptions o;
  o.transfer = transfer_options(args);
  o.cache = store::cache_flag(args);
  o.cache_budget = store::cache_budget_flag(args);
  o.transfer.policy = store::signature_policy(args);
  return o;
}

json pull_document(const store::PullResult& r, const std::vector<std::string>& notes) {
  json doc = sizes_json(r.sizes);
  doc.update(json{
      {"reference", r.reference},
      {"digest", r.digest},
      {"artifact", r.output.string()},
      {"chunks_fetched", r.chunks_fetched},
      {"bytes_fetched", r.bytes_fetched},
      {"chunks_from_cache", r.chunks_from_cache},
      {"bytes_from_cache", r.bytes_from_cache},
      {"cpu_seconds", {{"fetch", r.cpu.fetch}, {"decode", r.cpu.decode}, {"write", r.cpu.write}}},
      {"evicted", r.evicted},
      {"kept_in_use", r.kept_in_use},
      {"phases", phases_json(r.phases)},
      {"seconds", total_seconds(r.phases)},
      {"notes", notes}});
  return doc;
}

}  // namespace

namespace {

std::vector<FlagSpec> remote_flags() {
  auto flags = store::registry_flags("--");
  flags.insert(
      flags.end(),
      {{"--jobs", "-j", "N", "chunks in flight (default: twice the cores, 8 to 32)"},
       {"--retries", "", "N", "attempts after a failed request, with backoff (default 5)"},
       {"--max-rate-mib", "", "MIB", "limit the transfer to MIB per second (default: none)"}});
  return flags;
}

using store::cache_flags;

const FlagSpec kJsonFlag{"--json", "", "", "print the result as one JSON document on stdout"};
const FlagSpec kQuietFlag{"--quiet", "-q", "", "print no progress"};
const FlagSpec kHelpFlag{"--help", "-h", "", "show this help"};
const FlagSpec kCriuFlag{"--criu", "", "PATH", "the criu binary (for the host check)"};

std::vector<FlagSpec> concat(std::vector<FlagSpec> a, const std::vector<FlagSpec>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

int cmd_push(const Args& args);
int cmd_pull(const Args& args);
void print_pull(const Args& args, const store::PullResult& r,
                const std::vector<std::string>& notes);
int cmd_import(const Args& args);

}  // namespace

// The bounds of a request to a registry (RegistryOptions' defaults, docs/store.md "Bounds"):
// push's and pull's help say them, as the total a stalled registry can cost.
constexpr const char* kRequestBounds =
    "\nEach request to the registry is tried at most 1 + --retries times (after 0.2 s, doubling\n"
    "to 5 s between). An attempt ends after 60 s plus 1 s per 64 KiB of its body (188 s for an\n"
    "8 MiB chunk), or when fewer than 1 KiB move in 30 s; a request that stalls twice fails\n"
    "with exit 11. A registry that stops answering fails a request within about 2 minutes; at\n"
    "worst a request takes 1 + --retries times its deadline, plus the waits (6.2 s for 5).";

std::vector<Command> store_commands() {
  return {
      {"push",
       "gpusnap push ARTIFACT oci://HOST[:PORT]/REPO[:TAG] [--sign KEY] [--encrypt PUB]... "
       "[--plain-http] [--ca-file PEM]",
       "Upload an artifact to an OCI registry as content-addressed chunks. Only the chunks the\n"
       "registry lacks are sent (each is asked for first); zeros are not stored. With --encrypt\n"
       "the registry holds no readable byte of the snapshot's memory or files: every chunk and\n"
       "the layout are encrypted, and only a holder of a recipient's private key pulls or\n"
       "restores it (--decryption-key; without one: exit 12). Chunks pushed for the same\n"
       "recipients with the same --dedup-secret encrypt alike and are stored once (the registry\n"
       "then sees which chunks two such snapshots share; docs/security.md)." +
           std::string(kRequestBounds),
       concat(remote_flags(),
              {{"--sign", "", "KEY",
                "sign the snapshot's manifest with KEY, a PEM ECDSA private key (P-256, as "
                "cosign's): stored as cosign stores it, tagged sha256-DIGEST.sig beside it"},
               store::encrypt_flags()[0],
               store::encrypt_flags()[1],
               kJsonFlag,
               kQuietFlag,
               kHelpFlag}),
       cmd_push},
      {"pull", "gpusnap pull oci://HOST[:PORT]/REPO[:TAG|@sha256:HEX] [-o DIR] [--run-dir DIR]",
       "Fetch a snapshot from an OCI registry into a new artifact directory, through the node\n"
       "cache: chunks it holds are not fetched again (a pull that was killed resumes), each\n"
       "fetched chunk is checked against its digest as it arrives. A host that could not\n"
       "restore the snapshot (GPU model, driver, CPU) refuses before fetching any chunk.\n"
       "Without -o it is the node's copy, RUN_DIR/pulled/DIGEST, which `restore oci://` uses\n"
       "and the node cache keeps within its budget (a prefetch); pulls and restores of one\n"
       "snapshot on a node take turns, and a copy already there is verified (one found damaged\n"
       "is pulled again). A pull that would not fit where it writes refuses before its first\n"
       "chunk (exit 10). The node's signature policy (--signature-policy, default\n"
       "/etc/gpusnap/policy.json when present, else every snapshot accepted) is checked before\n"
       "anything but the manifest is read: unsigned, or signed by no trusted key where the\n"
       "policy wants a signature, refuses with exit 4." +
           std::string(kRequestBounds),
       concat(concat({{"--output", "-o", "DIR", "artifact directory to create (must not exist)"},
                      {"--run-dir", "", "DIR",
                       "gpusnap's state directory (default /run/gpusnap): the node's copy goes "
                       "to DIR/pulled"},
                      {"--any-host", "", "", "pull even where the snapshot could not be restored"}},
                     concat(remote_flags(), cache_flags())),
              {store::signature_policy_flag(), store::decryption_key_flag(), kCriuFlag, kJsonFlag,
               kQuietFlag, kHelpFlag}),
       cmd_pull},
      {"import",
       "gpusnap import ARTIFACT [--cache DIR] [--json]",
       "Add a local artifact to the node's store: its chunks, each held once, and say how many\n"
       "bytes it added.",
       {{"--cache", "", "DIR", "the store (default " + std::string(store::kDefaultCache) + ")"},
        kJsonFlag,
        kQuietFlag,
        kHelpFlag},
       cmd_import},
  };
}

void extend_for_store(const std::string& name, std::string& usage, std::string& summary,
                      std::vector<FlagSpec>& flags) {
  std::vector<FlagSpec> more;
  if (name == "restore") {
    more = concat(remote_flags(), cache_flags());
    more.push_back(store::signature_policy_flag());
    more.push_back(store::decryption_key_flag());
    summary +=
        "\nARTIFACT may be oci://HOST/REPO[:TAG|@DIGEST]: pulled (see `gpusnap pull`) while it\n"
        "restores: CRIU's restore starts on CRIU's images while GPU memory still arrives.";
  } else if (name == "inspect") {
    more = remote_flags();
    more.push_back(store::decryption_key_flag());
    summary += "\nOf an oci:// reference only its manifest and layout are read.";
  } else if (name == "verify") {
    more = concat(remote_flags(), cache_flags());
    more.push_back(store::signature_policy_flag());
    more.push_back(store::decryption_key_flag());
    more.push_back(
        {"--run-dir", "", "DIR", "where an oci:// snapshot is checked (default /run/gpusnap)"});
    summary += "\nAn oci:// reference is fetched (each chunk checked against its digest), written\n"
               "to a temporary directory and checked there.";
  } else if (name == "list") {
    more = {{"--cache", "", "DIR",
             "list the snapshots the node cache at DIR holds: size, last use, restore's copy"}};
    usage += " | gpusnap list --cache DIR";
  } else {
    return;
  }
  auto help = std::find_if(flags.begin(), flags.end(),
                           [](const FlagSpec& f) { return f.name == "--help"; });
  flags.insert(help, more.begin(), more.end());
}

bool is_remote(const std::string& artifact) { return store::OciRef::is_oci(artifact); }

namespace {

int cmd_push(const Args& args) {
  if (args.positional().size() != 2) throw args.usage_error("push needs ARTIFACT and oci://...");
  const bool as_json = args.has("--json");
  TransferReporter reporter(as_json, args.has("--quiet"));
  auto transfer = transfer_options(args);
  transfer.sign_key = args.get("--sign");
  store::read_encrypt_flags(args, transfer);
  auto r = store::push(args.positional()[0], remote_ref(args.positional()[1]), transfer, reporter);
  const double upload = [&] {
    for (const auto& p : r.phases) {
      if (p.name == "upload") return p.seconds;
    }
    return 0.0;
  }();
  json doc = sizes_json(r.sizes);
  doc.update(json{{"reference", r.reference},
                  {"digest", r.digest},
                  {"signature", r.signature.empty() ? json() : json(r.signature)},
                  {"chunks_uploaded", r.chunks_uploaded},
                  {"bytes_uploaded", r.bytes_uploaded},
                  {"phases", phases_json(r.phases)},
                  {"seconds", total_seconds(r.phases)},
                  {"notes", reporter.notes}});
  if (as_json) {
    std::cout << doc.dump(2) << "\n";
  } else if (args.has("--quiet")) {
    // Quiet drops the progress and the summary, not the result: `REF=$(gpusnap push -q ...)`.
    std::printf("%s\n", r.reference.c_str());
  } else {
    std::printf("%s\n  %s in %llu chunks (%s stored), %llu chunks (%s) uploaded, the rest already "
                "there; %.2f s (%s read)\n",
                r.reference.c_str(), fs::human_bytes(r.sizes.apparent_bytes).c_str(),
                static_cast<unsigned long long>(r.sizes.chunks),
                fs::human_bytes(r.sizes.stored_bytes).c_str(),
                static_cast<unsigned long long>(r.chunks_uploaded),
                fs::human_bytes(r.bytes_uploaded).c_str(), total_seconds(r.phases),
                rate(r.sizes.data_bytes, upload).c_str());
    if (!r.signature.empty()) std::printf("  signed: %s\n", r.signature.c_str());
  }
  return 0;
}

int cmd_pull(const Args& args) {
  if (args.positional().size() != 1) throw args.usage_error("pull needs one oci:// reference");
  const bool as_json = args.has("--json");
  TransferReporter reporter(as_json, args.has("--quiet"));
  auto reach = reach_options(args);
  reach.any_host = args.has("--any-host");
  if (!args.has("--output")) {
    // The node's copy, as restore oci:// uses it: the one way a node reaches a snapshot. Its
    // staging stays when the pull is stopped: the next pull resumes from it.
    store::SnapshotSource source(args.positional()[0], reach, store::Arrival::kBeforeReturning,
                                 reporter);
    if (source.pulls()) {
      print_pull(args, *source.pulled(), reporter.notes);
    } else if (as_json) {
      std::cout << json{{"reference", source.reference()},
                        {"digest", source.digest()},
                        {"artifact", source.artifact().string()},
                        {"chunks_fetched", 0},
                        {"bytes_fetched", 0},
                        {"verified", source.verified()},
                        {"notes", {"pulled before"}}}
                       .dump(2)
                << "\n";
    } else if (!args.has("--quiet")) {
      std::printf("%s: already at %s, verified (every byte against its manifest)\n",
                  source.reference().c_str(), source.artifact().c_str());
    }
    return 0;
  }
  // Into a directory of the caller's: the same host check, before any chunk. Its staging
  // directory is of no use to a later pull (the chunks are in the cache): a SIGTERM, SIGINT or
  // SIGHUP stops the pull between chunks and it is removed; SIGKILLed, `gpusnap recover` finds
  // it by its record under --run-dir.
  common::StopSignals stop;
  auto o = pull_options(args);
  o.output = sfs::absolute(args.get("--output"));
  o.run_dir = args.get("--run-dir", "/run/gpusnap");
  if (!reach.any_host) o.check = [&](const Manifest& m) { store::check_host(m, reach); };
  o.arrival.before_chunk = [&] {
    if (stop.requested()) {
      const int sig = stop.signal();
      throw Error(ErrorKind::kInternal,
                  std::string("pull stopped by ") + (sig == SIGTERM  ? "SIGTERM"
                                                     : sig == SIGINT ? "SIGINT"
                                                                     : "SIGHUP"));
    }
  };
  try {
    print_pull(args, store::pull(remote_ref(args.positional()[0]), o, reporter), reporter.notes);
  } catch (const Error&) {
    stop.reraise();  // its staging removed, ended by the signal that stopped it
    throw;
  }
  return 0;
}

void print_pull(const Args& args, const store::PullResult& r,
                const std::vector<std::string>& notes) {
  json doc = pull_document(r, notes);
  if (args.has("--json")) {
    std::cout << doc.dump(2) << "\n";
  } else if (!args.has("--quiet")) {
    std::printf(
        "%s -> %s\n  %s: %llu chunks fetched (%s), %llu from the node cache; %.2f s\n",
        r.reference.c_str(), r.output.c_str(), fs::human_bytes(r.sizes.apparent_bytes).c_str(),
        static_cast<unsigned long long>(r.chunks_fetched), fs::human_bytes(r.bytes_fetched).c_str(),
        static_cast<unsigned long long>(r.chunks_from_cache), total_seconds(r.phases));
  }
}

int cmd_import(const Args& args) {
  const bool as_json = args.has("--json");
  TransferReporter reporter(as_json, args.has("--quiet"));
  auto r = store::import_artifact(args.only_artifact(), args.get("--cache", store::kDefaultCache),
                                  store::ChunkingOptions{}, reporter);
  json doc = sizes_json(r.sizes);
  doc.update(json{{"key", r.key},
                  {"new_bytes", r.new_bytes},
                  {"new_chunks", r.new_chunks},
                  {"phases", phases_json(r.phases)},
                  {"seconds", total_seconds(r.phases)}});
  if (as_json) {
    std::cout << doc.dump(2) << "\n";
  } else if (!args.has("--quiet")) {
    std::printf("%s: %s (%s not zeros) in %llu chunks, %s stored; %s of it new to the store\n",
                args.only_artifact().c_str(), fs::human_bytes(r.sizes.apparent_bytes).c_str(),
                fs::human_bytes(r.sizes.data_bytes).c_str(),
                static_cast<unsigned long long>(r.sizes.chunks),
                fs::human_bytes(r.sizes.stored_bytes).c_str(),
                fs::human_bytes(r.new_bytes).c_str());
  }
  return 0;
}

}  // namespace

RestoreSource reach_for_restore(const Args& args, const RestoreOptions& restore) {
  auto reach = reach_options(args);
  reach.pulled = restore.run_dir / "pulled";
  reach.criu_path = restore.criu_path;
  reach.gpu_map = restore.gpu_map;
  reach.replicas = restore.replicas;
  reach.verify_copy = restore.verify;
  RestoreSource r;
  r.progress = std::make_unique<TransferReporter>(args.has("--json"), args.has("--quiet"));
  r.source = std::make_unique<store::SnapshotSource>(restore.artifact.string(), reach,
                                                     store::Arrival::kWhileRestoring, *r.progress);
  return r;
}

std::vector<std::string> RestoreSource::notes() const {
  return static_cast<const TransferReporter&>(*progress).notes;
}

int inspect_remote(const Args& args, const std::string& reference) {
  auto snap = store::read_remote(remote_ref(reference), transfer_options(args));
  json doc = snap.layout.manifest;
  doc["artifact"] = snap.ref.by_digest(snap.digest);
  doc["total_bytes"] = snap.layout.apparent_bytes();
  doc["oci"] = {{"digest", snap.digest},
                {"annotations", snap.oci_manifest.value("annotations", json::object())},
                {"chunks", snap.layout.blobs().size()},
                {"stored_bytes", snap.layout.stored_bytes()}};
  if (args.has("--json")) {
    std::cout << doc.dump(2) << "\n";
  } else {
    print_inspect_human(doc);
    std::printf("registry   %s: %zu chunks, %s stored\n", snap.digest.c_str(),
                snap.layout.blobs().size(), fs::human_bytes(snap.layout.stored_bytes()).c_str());
  }
  return 0;
}

int verify_remote(const Args& args, const std::string& reference) {
  const bool as_json = args.has("--json");
  TransferReporter reporter(as_json, args.has("--quiet"));
  auto o = pull_options(args);
  const sfs::path tmp = sfs::absolute(args.get("--run-dir", "/run/gpusnap")) / "verify";
  sfs::create_directories(tmp);
  sfs::permissions(tmp, sfs::perms::owner_all, sfs::perm_options::replace);
  o.output = tmp / ("verify-" + fs::random_id());
  struct Remove {
    sfs::path p;
    explicit Remove(sfs::path path) : p(std::move(path)) {}
    Remove(const Remove&) = delete;
    Remove& operator=(const Remove&) = delete;
    Remove(Remove&&) = delete;
    Remove& operator=(Remove&&) = delete;
    ~Remove() { fs::remove_tree_noexcept(p); }
  } remove{o.output};
  // Every chunk is checked against its digest on the way in (exit 4 on the first that is not).
  auto r = store::pull(remote_ref(reference), o, reporter);
  auto problems = Artifact::open(o.output).verify({0, &reporter});
  if (as_json) {
    json list = json::array();
    for (const auto& p : problems) list.push_back({{"path", p.path}, {"problem", p.problem}});
    std::cout << json{{"artifact", r.reference},
                      {"ok", problems.empty()},
                      {"bytes", r.sizes.apparent_bytes},
                      {"chunks", r.sizes.chunks},
                      {"problems", list},
                      {"seconds", total_seconds(r.phases)}}
                     .dump(2)
              << "\n";
  } else {
    for (const auto& p : problems) std::printf("%s: %s\n", p.path.c_str(), p.problem.c_str());
    if (problems.empty()) {
      std::printf("%s: ok, %s in %llu chunks verified\n", r.reference.c_str(),
                  fs::human_bytes(r.sizes.apparent_bytes).c_str(),
                  static_cast<unsigned long long>(r.sizes.chunks));
    }
  }
  return problems.empty() ? 0 : static_cast<int>(ErrorKind::kBadArtifact);
}

int list_cache(const Args& args) {
  if (!sfs::is_directory(args.get("--cache"))) {
    throw Error(ErrorKind::kNotFound, "node cache " + args.get("--cache") + " does not exist",
                "name the directory given to pull --cache");
  }
  store::BlobStore cache(args.get("--cache"));
  json list = json::array();
  uint64_t materialised = 0;
  for (const auto& s : cache.list()) {
    materialised += s.materialised_bytes;
    list.push_back({{"key", s.key},
                    {"reference", s.reference},
                    {"bytes", s.apparent_bytes},
                    {"stored_bytes", s.stored_bytes},
                    {"materialised", s.materialised.empty() ? json() : json(s.materialised)},
                    {"materialised_bytes", s.materialised_bytes},
                    {"in_use", cache.in_use(s.key)},
                    {"last_used", s.last_used},
                    {"last_used_utc", utc::at(s.last_used)}});
  }
  const uint64_t chunks = cache.blob_bytes();
  if (args.has("--json")) {
    // bytes: what the node holds for the cache, the figure its budget bounds.
    std::cout << json{{"cache", cache.root().string()},
                      {"bytes", chunks + materialised},
                      {"chunk_bytes", chunks},
                      {"materialised_bytes", materialised},
                      {"snapshots", list}}
                     .dump(2)
              << "\n";
    return 0;
  }
  std::printf("node cache %s: %s (%s of chunks, %s materialised for restore)\n",
              cache.root().c_str(), fs::human_bytes(chunks + materialised).c_str(),
              fs::human_bytes(chunks).c_str(), fs::human_bytes(materialised).c_str());
  for (const auto& s : list) {
    std::printf(
        "  %s  %10s  last used %s%s  %s\n", s["key"].get<std::string>().substr(0, 12).c_str(),
        fs::human_bytes(s["bytes"].get<uint64_t>()).c_str(),
        s["last_used_utc"].get<std::string>().c_str(), s["in_use"].get<bool>() ? " (in use)" : "",
        s["reference"].get<std::string>().c_str());
    if (!s["materialised"].is_null()) {
      std::printf("                materialised at %s (%s)\n",
                  s["materialised"].get<std::string>().c_str(),
                  fs::human_bytes(s["materialised_bytes"].get<uint64_t>()).c_str());
    }
  }
  return 0;
}

}  // namespace gpusnap::cli
