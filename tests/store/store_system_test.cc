// The store and the OCI registry remote end to end: the built gpusnap against a real
// docker-registry on loopback, captures of the real test workload with real CRIU, restores
// from oci:// references on a node cache that never held them.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/subprocess.h"
#include "criu/criu.h"
#include "gpu/driver.h"
#include "gpusnap/artifact.h"
#include "store/digest.h"
#include "store/registry.h"
#include "store/registry_fixture.h"
#include "store/snapshot_manifest.h"
#include "store/transfer.h"
#include "testing/harness.h"
#include "tier/fake_tier_driver.h"
#include "tier/memory_tier.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
namespace sfs = std::filesystem;

#define SKIP_WITHOUT_REGISTRY()                                            \
  do {                                                                     \
    SKIP_WITHOUT_CRIU();                                                   \
    GPUSNAP_SKIP_IF_BLOCKED(::gpusnap::testing::LocalRegistry::blocker()); \
  } while (0)

// A capture of the test workload (stopped by the capture) and the seed its memory holds.
struct Capture {
  sfs::path path;
  std::string seed;
  uint16_t port = 0;
};

Capture capture(const TempDir& dir, const std::string& name, const std::string& mib,
                const std::string& seed = "", const std::vector<std::string>& more = {}) {
  std::vector<std::string> args{"--mib", mib, "--children", "1"};
  if (!seed.empty()) args.insert(args.end(), {"--seed", seed});
  args.insert(args.end(), more.begin(), more.end());
  Workload w(dir, args);
  Capture c{dir / name, field(ask(w.port(), "INFO"), "seed"), w.port()};
  auto r = gpusnap({"checkpoint", "--pid", std::to_string(w.pid()), "-o", c.path.string(), "-q"});
  if (r.exit_code != 0) throw std::runtime_error("checkpoint failed: " + r.err);
  return c;
}

// gpusnap push --json of a capture to REPO:TAG of the registry (plain HTTP), its document.
json push(const LocalRegistry& registry, const Capture& c, const std::string& repo_and_tag) {
  auto r = gpusnap(
      {"push", c.path.string(), registry.ref(repo_and_tag), "--plain-http", "--json", "-q"});
  if (r.exit_code != 0) throw std::runtime_error("push failed: " + r.err);
  return json::parse(r.out);
}

// Every file of an artifact (manifest included) with its bytes.
std::map<std::string, std::string> contents(const sfs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : sfs::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) out[sfs::relative(e.path(), root).string()] = fs::read_file(e.path());
  }
  return out;
}

size_t files_in(const sfs::path& dir) {
  if (!sfs::exists(dir)) return 0;
  return static_cast<size_t>(
      std::distance(sfs::directory_iterator(dir), sfs::directory_iterator()));
}

// A figure for the test log, as the GPU tests print theirs: "RESULT NAME JSON".
void print_result(const std::string& name, const json& doc) {
  std::printf("RESULT %s %s\n", name.c_str(), doc.dump().c_str());
}

mode_t mode_of(const sfs::path& p) {
  struct stat st {};
  ::stat(p.c_str(), &st);
  return st.st_mode & 07777;
}

TEST(StoreRegistry, PushPullRestoreOverPlainHttp) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  auto snap = capture(dir, "snap", "64");

  auto push = gpusnap(
      {"push", snap.path.string(), registry.ref("team/worker:v1"), "--plain-http", "--json"});
  ASSERT_EQ(push.exit_code, 0) << push.err;
  auto pushed = json::parse(push.out);
  const std::string digest = pushed.at("digest");
  EXPECT_EQ(pushed.at("reference"), registry.ref("team/worker@" + digest));
  EXPECT_GT(pushed.at("chunks").get<int>(), 1);
  EXPECT_EQ(pushed.at("chunks_uploaded"), pushed.at("chunks"));
  // Progress came as JSON lines on stderr.
  EXPECT_NE(push.err.find("{\"progress\":{\"bytes_done\":"), std::string::npos) << push.err;

  // Again: the registry has every chunk; only HEADs, nothing uploaded.
  auto again = gpusnap(
      {"push", snap.path.string(), registry.ref("team/worker:v1"), "--plain-http", "--json"});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(json::parse(again.out).at("chunks_uploaded"), 0);
  EXPECT_EQ(json::parse(again.out).at("digest"), digest);
  // Quiet keeps the result, for `REF=$(gpusnap push -q ...)`: the reference by digest alone.
  auto quiet =
      gpusnap({"push", snap.path.string(), registry.ref("team/worker:v1"), "--plain-http", "-q"});
  ASSERT_EQ(quiet.exit_code, 0) << quiet.err;
  EXPECT_EQ(quiet.out, registry.ref("team/worker@" + digest) + "\n");
  EXPECT_EQ(quiet.err, "");

  // What skopeo, another OCI client, sees.
  auto raw = common::run_capture({"skopeo", "inspect", "--tls-verify=false", "--raw",
                                  "docker://" + registry.host() + "/team/worker:v1"});
  ASSERT_TRUE(raw.status.ok()) << raw.output;
  auto manifest = json::parse(raw.output);
  EXPECT_EQ(manifest.at("artifactType"), "application/vnd.gpusnap.snapshot.v1");
  EXPECT_EQ(manifest.at("layers").at(0).at("mediaType"),
            "application/vnd.gpusnap.snapshot.config.v1+json");
  EXPECT_EQ(manifest.at("annotations").at("org.gpusnap.gpu.model"), "none");
  EXPECT_EQ(manifest.at("annotations").at("org.gpusnap.gpu.driver"), "none");
  EXPECT_EQ(manifest.at("annotations").at("org.gpusnap.bytes.apparent"),
            std::to_string(pushed.at("bytes").get<uint64_t>()));

  // inspect reads the manifest and the layout only.
  auto inspect =
      gpusnap({"inspect", registry.ref("team/worker@" + digest), "--plain-http", "--json"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_EQ(json::parse(inspect.out).at("id"), Artifact::open(snap.path).manifest().id);

  // pull: the same bytes, root-only.
  const auto cache = dir / "cache";
  const auto out = dir / "pulled";
  auto pull = gpusnap({"pull", registry.ref("team/worker:v1"), "-o", out.string(), "--plain-http",
                       "--cache", cache.string(), "--json"});
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  auto pulled = json::parse(pull.out);
  EXPECT_EQ(pulled.at("chunks_fetched"), pushed.at("chunks"));
  EXPECT_EQ(pulled.at("chunks_from_cache"), 0);
  EXPECT_EQ(contents(out), contents(snap.path));
  EXPECT_TRUE(Artifact::open(out).verify().empty());
  EXPECT_EQ(mode_of(out), 0700u);
  EXPECT_EQ(mode_of(cache), 0700u);
  EXPECT_EQ(mode_of(cache / "blobs" / "sha256"), 0700u);
  for (const auto& e : sfs::directory_iterator(cache / "blobs" / "sha256")) {
    EXPECT_EQ(mode_of(e.path()), 0600u) << e.path();
  }

  auto verify = gpusnap({"verify", registry.ref("team/worker@" + digest), "--plain-http", "--cache",
                         (dir / "cache2").string(), "--run-dir", (dir / "run").string()});
  EXPECT_EQ(verify.exit_code, 0) << verify.err;

  // restore straight from the registry, by digest, on an empty node cache.
  auto rs = gpusnap({"restore", registry.ref("team/worker@" + digest), "--plain-http", "--cache",
                     (dir / "cache3").string(), "--run-dir", (dir / "run").string(), "--publish",
                     std::to_string(snap.port), "--json"});
  ASSERT_EQ(rs.exit_code, 0) << rs.err;
  Copies copies{json::parse(rs.out)};
  ASSERT_EQ(copies.copies.size(), 1u);
  EXPECT_EQ(field(ask(copies.port(0), "INFO"), "seed"), snap.seed);
  EXPECT_EQ(ask(copies.port(0), "CHECK").substr(0, 2), "OK");

  auto list = gpusnap({"list", "--cache", (dir / "cache3").string(), "--json"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  auto listed = json::parse(list.out).at("snapshots");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].at("reference"), registry.ref("team/worker@" + digest));
}

// The registry's manifest of a reference (skopeo inspect --raw).
json raw_manifest(const LocalRegistry& registry, const std::string& repo_and_tag) {
  auto raw = common::run_capture({"skopeo", "inspect", "--tls-verify=false", "--raw",
                                  "docker://" + registry.host() + "/" + repo_and_tag});
  if (!raw.status.ok()) throw std::runtime_error("skopeo inspect --raw: " + raw.output);
  return json::parse(raw.output);
}

TEST(StoreRegistry, PlainSkopeoInspectShowsWhatTheSnapshotIs) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  auto pushed = push(registry, capture(dir, "snap", "16"), "team/worker:v1");

  // Plain inspect (not --raw), as a person would run it: the image config's Labels say what it
  // is; every chunk is a layer, the layout first.
  auto plain = common::run_capture({"skopeo", "inspect", "--tls-verify=false",
                                    "docker://" + registry.host() + "/team/worker:v1"});
  ASSERT_TRUE(plain.status.ok()) << plain.output;
  auto shown = json::parse(plain.output);
  EXPECT_EQ(shown.at("Digest"), pushed.at("digest"));
  EXPECT_EQ(shown.at("Os"), "linux");
  EXPECT_EQ(shown.at("Architecture"), "amd64");
  EXPECT_EQ(shown.at("Labels").at("org.gpusnap.gpu.model"), "none");
  EXPECT_EQ(shown.at("Labels").at("org.gpusnap.gpu.driver"), "none");
  EXPECT_EQ(shown.at("Labels").at("org.gpusnap.bytes.apparent"),
            std::to_string(pushed.at("bytes").get<uint64_t>()));
  EXPECT_EQ(shown.at("Layers").size(), pushed.at("chunks").get<size_t>() + 1);

  // The raw manifest keeps gpusnap's media types and the annotations.
  auto manifest = raw_manifest(registry, "team/worker:v1");
  EXPECT_EQ(manifest.at("config").at("mediaType"), "application/vnd.oci.image.config.v1+json");
  EXPECT_EQ(manifest.at("artifactType"), "application/vnd.gpusnap.snapshot.v1");
  EXPECT_EQ(manifest.at("layers").at(0).at("mediaType"),
            "application/vnd.gpusnap.snapshot.config.v1+json");
  EXPECT_EQ(manifest.at("layers")
                .at(1)
                .at("mediaType")
                .get<std::string>()
                .rfind("application/vnd.gpusnap.chunk.v1", 0),
            0u);
  EXPECT_EQ(manifest.at("annotations").at("org.gpusnap.gpu.model"), "none");

  // Copied by skopeo into an OCI layout, it still inspects.
  const std::string layout = "oci:" + (dir / "layout").string() + ":v1";
  auto copy = common::run_capture({"skopeo", "copy", "--src-tls-verify=false",
                                   "docker://" + registry.host() + "/team/worker:v1", layout});
  ASSERT_TRUE(copy.status.ok()) << copy.output;
  auto local = common::run_capture({"skopeo", "inspect", layout});
  ASSERT_TRUE(local.status.ok()) << local.output;
  EXPECT_EQ(json::parse(local.output).at("Labels").at("org.gpusnap.gpu.model"), "none");
}

TEST(StoreRegistry, ManifestOfTheFirstFormatStillPulls) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  auto snap = capture(dir, "snap", "16");
  push(registry, snap, "r/s:new");
  // The same snapshot as version 1 wrote it: the layout as the config, the chunks as layers.
  json v1 = raw_manifest(registry, "r/s:new");
  json layers = v1.at("layers");
  v1["config"] = layers.at(0);
  layers.erase(0);
  v1["layers"] = layers;
  store::RegistryOptions plain;
  plain.plain_http = true;
  store::Registry(store::OciRef::parse(registry.ref("r/s:old")), plain)
      .put_manifest(v1.dump(), "application/vnd.oci.image.manifest.v1+json");
  EXPECT_EQ(raw_manifest(registry, "r/s:old").at("config").at("mediaType"),
            "application/vnd.gpusnap.snapshot.config.v1+json");

  auto pull = gpusnap({"pull", registry.ref("r/s:old"), "-o", (dir / "pulled").string(),
                       "--plain-http", "--cache", (dir / "cache").string()});
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  EXPECT_EQ(contents(dir / "pulled"), contents(snap.path));
  auto inspect = gpusnap({"inspect", registry.ref("r/s:old"), "--plain-http", "--json"});
  ASSERT_EQ(inspect.exit_code, 0) << inspect.err;
  EXPECT_EQ(json::parse(inspect.out).at("id"), Artifact::open(snap.path).manifest().id);
}

// A snapshot of more chunks than one manifest of docker-registry's 4 MiB lists (about 18,000
// with their titles): 4 KiB chunks of a 96 MiB workload, pushed as an index of manifests.
// About 25,000 chunks, each a request to push and to pull: minutes on a busy machine.
TEST(StoreRegistry, SnapshotBeyondOneManifestPushesAsAnIndex) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  auto snap = capture(dir, "snap", "96");
  store::TransferOptions to;
  to.registry.plain_http = true;
  to.chunking.cdc_min = 4096;
  to.chunking.cdc_average = 4096;
  to.chunking.cdc_max = 4096;
  to.chunking.host_image_chunk = 4096;
  to.chunking.tier_glue_below = 4096;
  Reporter quiet;
  auto pushed =
      store::push(snap.path, store::OciRef::parse(registry.ref("big/snap:v1")), to, quiet);
  ASSERT_GT(pushed.sizes.chunks, 20000u);

  json index = raw_manifest(registry, "big/snap:v1");
  ASSERT_EQ(index.at("mediaType"), store::kOciImageIndexMediaType);
  EXPECT_EQ(index.at("artifactType"), store::kArtifactType);
  const json& parts = index.at("manifests");
  ASSERT_GE(parts.size(), 2u);
  size_t layers = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    EXPECT_LE(parts[i].at("size").get<uint64_t>(), store::kMaxManifestBytes);
    json part = raw_manifest(registry, "big/snap@" + parts[i].at("digest").get<std::string>());
    EXPECT_EQ(part.at("annotations").at(store::kPartAnnotation),
              std::to_string(i + 1) + "/" + std::to_string(parts.size()));
    EXPECT_EQ(part.at("layers").at(0).at("annotations").at(store::kTitleAnnotation), "layout.json");
    layers += part.at("layers").size() - 1;
  }
  EXPECT_EQ(layers, pushed.sizes.chunks);  // every chunk listed once: none left to the GC

  const std::vector<std::string> plain{"--plain-http", "--cache", (dir / "cache").string()};
  auto pull = [&](const std::string& ref, const std::string& out) {
    std::vector<std::string> args{"pull", registry.ref(ref), "-o", (dir / out).string()};
    args.insert(args.end(), plain.begin(), plain.end());
    return gpusnap(args);
  };
  auto pulled = pull("big/snap:v1", "pulled");
  ASSERT_EQ(pulled.exit_code, 0) << pulled.err;
  EXPECT_EQ(contents(dir / "pulled"), contents(snap.path));

  // skopeo inspect (not --raw) shows the snapshot under the index's digest.
  auto plain_inspect = common::run_capture(
      {"skopeo", "inspect", "--tls-verify=false", "docker://" + registry.host() + "/big/snap:v1"});
  ASSERT_TRUE(plain_inspect.status.ok()) << plain_inspect.output.substr(0, 2000);
  EXPECT_EQ(json::parse(plain_inspect.output).at("Digest"), pushed.digest);

  // One part alone under a tag, as `skopeo copy` without --all leaves it: the pull says so
  // before it fetches a chunk.
  store::RegistryOptions plain_http;
  plain_http.plain_http = true;
  store::Registry(store::OciRef::parse(registry.ref("big/snap:one")), plain_http)
      .put_manifest(
          raw_manifest(registry, "big/snap@" + parts[0].at("digest").get<std::string>()).dump(),
          store::kOciManifestMediaType);
  auto partial = pull("big/snap:one", "partial");
  EXPECT_EQ(partial.exit_code, 4) << partial.err;
  EXPECT_NE(partial.err.find("is part 1/" + std::to_string(parts.size()) +
                             " of a snapshot split across an image index"),
            std::string::npos)
      << partial.err;
  EXPECT_NE(partial.err.find("skopeo copy --all"), std::string::npos) << partial.err;
}

TEST(StoreRegistry, TlsWithBasicAuth) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {true, "gpusnap", "s3cret-pass"});
  auto snap = capture(dir, "snap", "16");
  const std::string ref = registry.ref("secure/snap:v1");

  auto untrusted = gpusnap({"push", snap.path.string(), ref, "--auth-file", "/dev/null/none"});
  EXPECT_EQ(untrusted.exit_code, 2) << untrusted.err;

  // No CA: the self-signed chain is refused.
  auto no_ca = gpusnap({"push", snap.path.string(), ref, "--retries", "0"});
  EXPECT_EQ(no_ca.exit_code, 10) << no_ca.err;
  EXPECT_NE(no_ca.err.find("(fix: give the registry's CA with --ca-file, or --plain-http for a "
                           "registry without TLS)"),
            std::string::npos)
      << no_ca.err;

  // The CA, but no credentials.
  auto empty_home = dir / "home";
  sfs::create_directories(empty_home);
  auto no_auth = gpusnap({"push", snap.path.string(), ref, "--ca-file", registry.ca_file().string(),
                          "--auth-file", (dir / "none.json").string()});
  EXPECT_EQ(no_auth.exit_code, 2) << no_auth.err;
  fs::write_file(dir / "empty.json", "{\"auths\":{}}");
  auto anonymous =
      gpusnap({"push", snap.path.string(), ref, "--ca-file", registry.ca_file().string(),
               "--auth-file", (dir / "empty.json").string()});
  EXPECT_EQ(anonymous.exit_code, 10) << anonymous.err;
  EXPECT_EQ(anonymous.err,
            "gpusnap: error: registry " + registry.host() + " refused to upload blob " +
                anonymous.err.substr(anonymous.err.find("sha256:"), 71) +
                " (HTTP 401) (fix: log in (`skopeo login HOST`) or give --auth-file)\n");

  // auth.json as skopeo/podman write it: base64 of user:password.
  fs::write_file(dir / "auth.json", "{\"auths\":{\"" + registry.host() +
                                        "\":{\"auth\":\"Z3B1c25hcDpzM2NyZXQtcGFzcw==\"}}}");
  auto push = gpusnap({"push", snap.path.string(), ref, "--ca-file", registry.ca_file().string(),
                       "--auth-file", (dir / "auth.json").string(), "--json"});
  ASSERT_EQ(push.exit_code, 0) << push.err;
  const auto out = dir / "pulled";
  auto pull =
      gpusnap({"pull", ref, "-o", out.string(), "--ca-file", registry.ca_file().string(),
               "--auth-file", (dir / "auth.json").string(), "--cache", (dir / "cache").string()});
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  EXPECT_EQ(contents(out), contents(snap.path));
}

// A registry is outside gpusnap's trust: its layout blob may nest JSON as deep as its size
// allows. nlohmann-json parses that, but writing it out again recurses once per level; a node
// agent that pulls must refuse it, not crash on it.
TEST(StoreRegistry, ALayoutNestedDeepByAHostileRegistryIsRefusedWithoutACrash) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  push(registry, capture(dir, "snap", "16"), "r/s:v1");
  json manifest = raw_manifest(registry, "r/s:v1");
  store::RegistryOptions plain;
  plain.plain_http = true;
  store::Registry remote(store::OciRef::parse(registry.ref("r/s:deep")), plain);
  const std::string layout_digest = manifest.at("layers").at(0).at("digest");
  std::string layout = remote.fetch_blob(layout_digest, manifest.at("layers").at(0).at("size"));
  // One more member of the snapshot's manifest, 200,000 levels deep (400 KB).
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  const auto at = layout.find("\"manifest\":{");
  ASSERT_NE(at, std::string::npos) << layout.substr(0, 200);
  layout.insert(at + 12, "\"note\":" + deep + ",");
  const std::string digest = store::sha256_digest(layout);
  remote.upload_blob(digest, layout);
  manifest["layers"][0]["digest"] = digest;
  manifest["layers"][0]["size"] = layout.size();
  remote.put_manifest(manifest.dump(), "application/vnd.oci.image.manifest.v1+json");

  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"pull", registry.ref("r/s:deep"), "-o", (dir / "pulled").string(),
                                 "--plain-http", "--cache", (dir / "cache").string()},
        std::vector<std::string>{"inspect", registry.ref("r/s:deep"), "--plain-http", "--json"}}) {
    auto r = gpusnap(args);
    EXPECT_EQ(r.exit_code, 4) << args[0] << ": " << r.err;
    EXPECT_NE(r.err.find("gpusnap: error: " + registry.ref("r/s:deep") +
                         " is not a gpusnap snapshot: its layout is not JSON: nested deeper "
                         "than 64 levels"),
              std::string::npos)
        << args[0] << ": " << r.err;
  }
  EXPECT_FALSE(sfs::exists(dir / "pulled"));
}

TEST(StoreRegistry, CorruptBlobInTheRegistryIsRefusedAndNothingRestored) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  push(registry, capture(dir, "snap", "32"), "r/s:v1");

  // Flip one byte of the largest chunk in the registry's own storage.
  auto raw = common::run_capture({"skopeo", "inspect", "--tls-verify=false", "--raw",
                                  "docker://" + registry.host() + "/r/s:v1"});
  ASSERT_TRUE(raw.status.ok()) << raw.output;
  std::string victim;
  uint64_t largest = 0;
  const json manifest = json::parse(raw.output);
  for (const auto& l : manifest.at("layers")) {
    if (l.at("size").get<uint64_t>() > largest) {
      largest = l.at("size").get<uint64_t>();
      victim = l.at("digest").get<std::string>();
    }
  }
  {
    std::fstream f(registry.blob_data(victim), std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekg(static_cast<std::streamoff>(largest / 2));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(static_cast<std::streamoff>(largest / 2));
    f.write(&c, 1);
  }

  const auto cache = dir / "cache";
  auto pull = gpusnap({"pull", registry.ref("r/s:v1"), "-o", (dir / "pulled").string(),
                       "--plain-http", "--cache", cache.string()});
  EXPECT_EQ(pull.exit_code, 4) << pull.err;
  EXPECT_NE(pull.err.find("gpusnap: error: blob " + victim + " from registry " + registry.host() +
                          " does not match its digest"),
            std::string::npos)
      << pull.err;
  EXPECT_NE(pull.err.find("(fix: the registry's copy is damaged: push the artifact again)"),
            std::string::npos);
  EXPECT_FALSE(sfs::exists(dir / "pulled"));
  EXPECT_FALSE(sfs::exists(cache / "blobs" / "sha256" / victim.substr(7)));
  for (const auto& e : sfs::directory_iterator(dir.path())) {
    EXPECT_EQ(e.path().filename().string().find(".pulled"), std::string::npos) << e.path();
  }

  auto rs = gpusnap({"restore", registry.ref("r/s:v1"), "--plain-http", "--cache", cache.string(),
                     "--run-dir", (dir / "run").string(), "--json"});
  EXPECT_EQ(rs.exit_code, 4) << rs.err;
  EXPECT_FALSE(sfs::exists(dir / "run" / "copies")) << "a copy was started";
}

TEST(StoreRegistry, KilledPullResumesWithoutFetchingCompleteChunksAgain) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  auto snap = capture(dir, "snap", "48");
  const int chunks = push(registry, snap, "r/s:v1").at("chunks");

  const auto cache = dir / "cache";
  const auto out = dir / "pulled";
  const auto blobs = cache / "blobs" / "sha256";
  {
    // One chunk at a time at 16 MiB/s: killed once a few chunks are complete.
    common::SpawnOptions o;
    o.argv = {gpusnap_bin(), "pull",           registry.ref("r/s:v1"),
              "-o",          out.string(),     "--plain-http",
              "--cache",     cache.string(),   "--jobs",
              "1",           "--max-rate-mib", "16",
              "-q"};
    common::Subprocess slow(o);
    ASSERT_TRUE(eventually([&] { return files_in(blobs) >= 3; }, std::chrono::seconds(30)));
    slow.kill(SIGKILL);
    slow.wait();
  }
  const size_t kept = files_in(blobs);
  ASSERT_LT(kept, static_cast<size_t>(chunks));
  EXPECT_FALSE(sfs::exists(out));

  auto pull = gpusnap({"pull", registry.ref("r/s:v1"), "-o", out.string(), "--plain-http",
                       "--cache", cache.string(), "--json"});
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  auto doc = json::parse(pull.out);
  EXPECT_EQ(doc.at("chunks_from_cache").get<size_t>(), kept);
  EXPECT_EQ(doc.at("chunks_fetched").get<size_t>() + kept, static_cast<size_t>(chunks));
  EXPECT_EQ(contents(out), contents(snap.path));
}

TEST(StoreRegistry, SecondCaptureOfTheSameWorkloadAddsLittle) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  // Two processes holding the same 128 MiB (same seed), captured one after the other.
  auto first = capture(dir, "first", "128", "77");
  auto second = capture(dir, "second", "128", "77");

  const auto store = dir / "store";
  auto a = gpusnap({"import", first.path.string(), "--cache", store.string(), "--json"});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  auto b = gpusnap({"import", second.path.string(), "--cache", store.string(), "--json"});
  ASSERT_EQ(b.exit_code, 0) << b.err;
  auto da = json::parse(a.out);
  auto db = json::parse(b.out);
  EXPECT_EQ(da.at("new_bytes"), da.at("stored_bytes"));
  const double added = db.at("new_bytes").get<double>() / db.at("stored_bytes").get<double>();
  EXPECT_LE(added, 0.10) << b.out;
  print_result("dedup_second_capture", {{"stored_bytes", db.at("stored_bytes")},
                                        {"new_bytes", db.at("new_bytes")},
                                        {"fraction_new", added}});

  // The registry too: the second push uploads only what the first lacked.
  push(registry, first, "r/s:a");
  auto d2 = push(registry, second, "r/s:b");
  EXPECT_LE(d2.at("bytes_uploaded").get<double>() / d2.at("stored_bytes").get<double>(), 0.10)
      << d2.dump();
}

// The transparent path's view of a model loaded twice: the same tensors (1-26 MiB mappings) in
// another allocation order, so at other addresses and at other offsets of CRIU's page images.
// The kernel merges the mappings into one VMA, so nothing in the images says where a tensor
// starts: the content-defined cuts find the same chunks again inside each tensor, and each
// tensor boundary that moved costs the one chunk that straddles it (3.8 MiB on average here,
// a chunk being 2.7 MiB on average: the straddling one is the longer kind). 24 tensors in 250
// MiB are a boundary per 10 MiB, denser than a model's weights; the bound is per boundary.
TEST(StoreRegistry, ASecondCaptureOfTheSameTensorsInAnotherOrderCostsAChunkPerMovedBoundary) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  auto first = capture(dir, "first", "16", "91", {"--tensors", "24", "--order", "1"});
  auto second = capture(dir, "second", "16", "91", {"--tensors", "24", "--order", "2"});

  const json d1 = push(registry, first, "model/cpu:a");
  const json d2 = push(registry, second, "model/cpu:b");
  const double added = d2.at("bytes_uploaded").get<double>() / d2.at("stored_bytes").get<double>();
  print_result("dedup_tensors_second_capture", {{"stored_bytes", d2.at("stored_bytes")},
                                                {"bytes_uploaded", d2.at("bytes_uploaded")},
                                                {"chunks_uploaded", d2.at("chunks_uploaded")},
                                                {"fraction_new", added}});
  EXPECT_GT(d1.at("stored_bytes").get<double>(), 200e6) << "the tensors are in the capture";
  // 24 tensors and the pattern memory: 25 boundaries, at most 5 MiB each (1.3 average chunks).
  EXPECT_LE(d2.at("bytes_uploaded").get<double>(), 25.0 * 5 * (1 << 20)) << d2.dump();
  // Without the content-defined cuts (fixed chunks from each image's start), everything after
  // the first moved boundary would be new: most of the capture.
  EXPECT_LT(added, 0.55) << d2.dump();
}

// A capture of a model's memory tier, as an artifact of the tier's folder alone: the tensors of
// tensor_bytes() allocated from the tier (the tier's own allocator and drain, on the fake driver:
// host memory in place of the GPU) in an order of `seed`, each filled with its own bytes, and
// drained by the tier's racing workers into tier/PID-wK.img, PID.layout and PID.json.
std::vector<size_t> tensor_bytes() {
  constexpr size_t kMiB = 1 << 20;
  std::vector<size_t> sizes;
  // Weights: large tensors, each in a segment of its own (a piece per 4 MiB of it).
  for (int i = 0; i < 6; ++i) sizes.insert(sizes.end(), {32 * kMiB, 12 * kMiB + 4096, 16 * kMiB});
  // Embeddings, projections of small layers, buffers: medium tensors (1-10 MiB), which share
  // segments, so that their neighbours depend on the allocation order.
  for (size_t i = 0; i < 24; ++i) sizes.push_back(kMiB + (i * 397 % 37) * 256 * 1024);
  // Norms and biases: small tensors, packed into shared segments in allocation order.
  for (size_t i = 0; i < 96; ++i) sizes.push_back(512 * (8 + (i * 37) % 120));
  return sizes;
}

sfs::path capture_tier(const sfs::path& root, pid_t pid, uint32_t seed) {
  tier::FakeTierDriver driver(1, size_t{1} << 30);
  tier::TierSettings settings;
  settings.streams = 8;
  auto t = std::make_unique<tier::Tier>(driver, settings, pid);
  const auto sizes = tensor_bytes();
  std::vector<size_t> order(sizes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t i : order) {
    void* p = t->allocate(sizes[i], 0, nullptr);
    std::mt19937_64 bytes(i);  // the tensor's bytes, whatever its address
    std::vector<uint64_t> w(sizes[i] / 8);
    for (auto& v : w) v = bytes();
    driver.write(reinterpret_cast<tier::DevicePtr>(p), w.data(), sizes[i]);
  }
  sfs::create_directories(root / "tier");
  t->drain(root / "tier");
  Manifest m;
  m.id = fs::random_id();
  m.created = "2026-12-05T00:00:00Z";
  m.gpusnap_version = "test";
  m.host = HostFacts::probe("");  // pulled and checked against this host
  m.files = checksum_tree(root, m.chunk_bytes);
  fs::write_file(root / kManifestName, m.to_json().dump(2));
  return root;
}

// The memory tier's drain puts each piece in whichever worker's file takes it next: two captures
// of the same memory hold the same pieces in other files, at other offsets, next to other pieces.
TEST(StoreRegistry, ASecondCaptureOfTheSameTierInAnotherOrderAddsAtMostFivePercent) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  const Capture first{capture_tier(dir / "first", 1001, 1), "", 0};
  const Capture second{capture_tier(dir / "second", 2002, 2), "", 0};
  // The same memory, placed otherwise.
  EXPECT_NE(fs::read_file(first.path / "tier" / "1001.layout"),
            fs::read_file(second.path / "tier" / "2002.layout"));

  const json d1 = push(registry, first, "model/tier:a");
  const json d2 = push(registry, second, "model/tier:b");
  const double added = d2.at("bytes_uploaded").get<double>() / d2.at("stored_bytes").get<double>();
  print_result("dedup_tier_second_capture", {{"stored_bytes", d2.at("stored_bytes")},
                                             {"bytes_uploaded", d2.at("bytes_uploaded")},
                                             {"chunks", d2.at("chunks")},
                                             {"chunks_uploaded", d2.at("chunks_uploaded")},
                                             {"fraction_new", added}});
  EXPECT_LE(added, 0.05) << d2.dump();
  EXPECT_EQ(d1.at("bytes_uploaded"), d1.at("stored_bytes"));

  // Cut anywhere, it is still the capture: pulled back byte for byte.
  const auto out = dir / "pulled";
  auto pull = gpusnap({"pull", registry.ref("model/tier:b"), "-o", out.string(), "--plain-http",
                       "--cache", (dir / "cache").string(), "-q"});
  ASSERT_EQ(pull.exit_code, 0) << pull.err;
  for (const auto& e : sfs::directory_iterator(second.path / "tier")) {
    const auto name = e.path().filename();
    EXPECT_TRUE(fs::read_file(out / "tier" / name) == fs::read_file(e.path())) << name;
  }
}

// How many times a registry served a blob of REPO, from its access log.
size_t blob_gets(const LocalRegistry& registry, const std::string& repo) {
  const std::string log = registry.log();
  const std::string needle = "\"GET /v2/" + repo + "/blobs/";
  size_t n = 0;
  for (size_t at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) ++n;
  return n;
}

// A node's registries.conf names a pull-through cache (docker-registry with `proxy:`) in front
// of the origin: pulls go through it, a second node's pull costs the origin nothing, a damaged
// chunk in the mirror and a mirror that is down still give the snapshot, byte for byte.
TEST(StoreRegistry, PullsGoThroughTheMirrorsOfRegistriesConfAndNeverTrustThem) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry origin(dir, {});
  LocalRegistry::Options mo;
  mo.proxy_remote = "http://" + origin.host();
  std::optional<LocalRegistry> mirror(std::in_place, dir, mo);
  auto c = capture(dir, "snap", "24", "5");
  push(origin, c, "team/snap:v1");
  const size_t pushed_gets = blob_gets(origin, "team/snap");
  const auto conf = dir / "registries.conf";
  fs::write_file(conf, "[[registry]]\nlocation = \"" + origin.host() +
                           "\"\n\n[[registry.mirror]]\nlocation = \"" + mirror->host() +
                           "\"\ninsecure = true\n");
  auto pull = [&](const std::string& name) {
    auto r = gpusnap({"pull", origin.ref("team/snap:v1"), "-o", (dir / name).string(),
                      "--plain-http", "--cache", (dir / ("cache-" + name)).string(),
                      "--registries-conf", conf.string(), "--json"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(contents(dir / name), contents(c.path)) << name;
    return json::parse(r.out);
  };
  const json first = pull("first");
  const size_t through_mirror = blob_gets(origin, "team/snap") - pushed_gets;
  EXPECT_GT(first.at("chunks_fetched").get<size_t>(), 2u);
  // docker-registry's proxy fetches a blob it lacks twice from its remote: once streamed to
  // the client, once to keep (its storeLocal). So the first node costs the origin 2x.
  EXPECT_LE(through_mirror, 2 * (first.at("chunks_fetched").get<size_t>() + 1)) << origin.log();
  EXPECT_TRUE(Contains(first.at("notes").dump(), "came from mirrors")) << first.dump();

  // A second node: the mirror holds every chunk now, the origin serves none.
  pull("second");
  EXPECT_EQ(blob_gets(origin, "team/snap") - pushed_gets, through_mirror);

  // The mirror's copy of a chunk damaged: refused by its digest, fetched from the origin.
  // Any chunk the mirror keeps will do: its largest blob file.
  sfs::path victim;
  uintmax_t largest = 0;
  for (const auto& e : sfs::recursive_directory_iterator(mirror->storage())) {
    if (e.is_regular_file() && e.path().filename() == "data" && e.file_size() > largest) {
      largest = e.file_size();
      victim = e.path();
    }
  }
  ASSERT_FALSE(victim.empty());
  {
    std::string bytes = fs::read_file(victim);
    bytes[bytes.size() / 2] ^= 0x5a;
    fs::write_file(victim, bytes);
  }
  const json third = pull("third");
  EXPECT_TRUE(Contains(third.at("notes").dump(), "fetched from the next")) << third.dump();

  // The mirror down: the origin alone, with a note.
  mirror.reset();
  const json fourth = pull("fourth");
  EXPECT_TRUE(Contains(fourth.at("notes").dump(), "did not serve the manifest")) << fourth.dump();
}

TEST(StoreRegistry, NodeCacheKeepsItsBudgetLeastRecentlyUsedFirst) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  std::vector<std::string> refs;
  uint64_t largest = 0;
  for (const char* seed : {"11", "22", "33"}) {
    auto c = capture(dir, std::string("s") + seed, "24", seed);
    auto p = push(registry, c, std::string("r/s:") + seed);
    refs.push_back(p.at("reference"));
    largest = std::max(largest, p.at("stored_bytes").get<uint64_t>());
  }
  // Room for two of them, not three (their chunks differ: other seeds).
  const std::string budget = std::to_string((largest * 5 / 2) >> 20);
  const auto cache = dir / "cache";
  auto pull = [&](size_t i, const std::string& budget_mib) {
    auto r = gpusnap({"pull", refs[i], "-o",
                      (dir / ("out" + std::to_string(i) + budget_mib)).string(), "--plain-http",
                      "--cache", cache.string(), "--cache-budget-mib", budget_mib, "--json"});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return json::parse(r.out);
  };
  EXPECT_EQ(pull(0, budget).at("evicted"), json::array());
  EXPECT_EQ(pull(1, budget).at("evicted"), json::array());
  auto third = pull(2, budget);
  EXPECT_EQ(third.at("evicted"), json::array({refs[0].substr(refs[0].find("sha256:") + 7)}));
  auto list = gpusnap({"list", "--cache", cache.string(), "--json"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  auto doc = json::parse(list.out);
  ASSERT_EQ(doc.at("snapshots").size(), 2u);
  EXPECT_EQ(doc.at("snapshots")[0].at("reference"), refs[2]);
  EXPECT_EQ(doc.at("snapshots")[1].at("reference"), refs[1]);
  EXPECT_LE(doc.at("bytes").get<uint64_t>(), std::stoull(budget) << 20);
  // Pulled again, the evicted one is fetched again; the others were not touched.
  auto again = pull(0, "1000");
  EXPECT_GT(again.at("chunks_fetched").get<int>(), 0);
}

// The node cache's view (`gpusnap list --cache DIR --json`).
json cache_list(const sfs::path& cache) {
  auto r = gpusnap({"list", "--cache", cache.string(), "--json"});
  if (r.exit_code != 0) throw std::runtime_error("list --cache: " + r.err);
  return json::parse(r.out);
}

std::vector<std::string> listed_references(const json& list) {
  std::vector<std::string> out;
  for (const auto& s : list.at("snapshots")) out.push_back(s.at("reference"));
  return out;
}

// What restore oci:// materialises under RUN_DIR/pulled counts in the cache's budget with the
// chunks: three snapshots restored where the budget holds two. The least recently used leaves
// with its copy; one whose restore is running stays, even as the least recently used.
TEST(StoreRegistry, RestoreCopiesStayWithinTheCacheBudgetAndTheOneInUseStays) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  std::vector<Capture> caps;
  std::vector<std::string> refs;
  for (const char* seed : {"11", "22", "33"}) {
    caps.push_back(capture(dir, std::string("s") + seed, "24", seed));
    refs.push_back(push(registry, caps.back(), std::string("r/s:") + seed).at("reference"));
  }
  const auto cache = dir / "cache";
  const auto run = dir / "run";
  const auto pulled = run / "pulled";
  auto key = [&](size_t i) { return refs[i].substr(refs[i].find("sha256:") + 7); };
  // A restore of snapshot i from the registry: its copy answers with the snapshot's seed.
  auto restore_args = [&](size_t i, const std::string& budget_mib) {
    return std::vector<std::string>{"restore",
                                    refs[i],
                                    "--plain-http",
                                    "--cache",
                                    cache.string(),
                                    "--run-dir",
                                    run.string(),
                                    "--publish",
                                    std::to_string(caps[i].port),
                                    "--cache-budget-mib",
                                    budget_mib,
                                    "--json",
                                    "-q"};
  };
  auto restore = [&](size_t i, const std::string& budget_mib) {
    auto r = gpusnap(restore_args(i, budget_mib));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    auto doc = json::parse(r.out);
    Copies copies{doc};
    EXPECT_EQ(field(ask(copies.port(0), "INFO"), "seed"), caps[i].seed);
    return doc;
  };

  restore(0, "100000");
  const auto one = cache_list(cache);
  ASSERT_EQ(one.at("snapshots").size(), 1u);
  const auto& first = one.at("snapshots")[0];
  // The copy restore made is the cache's: recorded where it is, and counted.
  EXPECT_EQ(first.at("materialised"), (pulled / key(0)).string());
  EXPECT_GT(first.at("materialised_bytes").get<uint64_t>(), 16ull << 20);
  EXPECT_EQ(one.at("bytes").get<uint64_t>(),
            one.at("chunk_bytes").get<uint64_t>() + one.at("materialised_bytes").get<uint64_t>());
  EXPECT_FALSE(first.at("in_use").get<bool>());
  // Room for two such snapshots, not three (their memory differs: other seeds).
  const uint64_t budget_bytes = one.at("bytes").get<uint64_t>() * 5 / 2;
  const std::string budget = std::to_string(budget_bytes >> 20);

  // A restore of snapshot 0 held before CRIU's restore (a criu that waits while a gate file
  // exists): the snapshot is in use for as long as the test keeps the gate.
  const auto gate = dir / "gate";
  const auto reached = dir / "reached";
  const auto slow_criu = dir / "slow-criu";
  fs::write_file(gate, "");
  fs::write_file(slow_criu, "#!/bin/sh\nif [ \"$1\" = restore ]; then\n  : > " + reached.string() +
                                "\n  while [ -e " + gate.string() +
                                " ]; do sleep 0.05; done\nfi\nexec " + criu::locate("").path +
                                " \"$@\"\n");
  ::chmod(slow_criu.c_str(), 0700);
  const auto held_out = dir / "held.out";
  common::UniqueFd out_fd(::open(held_out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  common::SpawnOptions o;
  o.argv = restore_args(0, budget);
  o.argv.insert(o.argv.begin(), gpusnap_bin());
  o.argv.insert(o.argv.end(), {"--criu", slow_criu.string()});
  o.stdout_fd = out_fd.get();
  const auto held_err = dir / "held.err";
  common::UniqueFd err_fd(::open(held_err.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  o.stderr_fd = err_fd.get();
  common::Subprocess held(o);
  // Whatever happens below, the held restore goes on and ends (its criu never left waiting).
  struct OpenGate {
    const sfs::path& gate;
    common::Subprocess& held;
    ~OpenGate() {
      ::unlink(gate.c_str());
      held.wait(std::chrono::seconds(60));
    }
  } open_gate{gate, held};
  ASSERT_TRUE(eventually([&] { return sfs::exists(reached); }, std::chrono::seconds(60)));
  EXPECT_TRUE(cache_list(cache).at("snapshots")[0].at("in_use").get<bool>());

  // Snapshot 1 fits beside it; snapshot 2 does not fit beside both: snapshot 1 leaves, though
  // snapshot 0 was used before it, because snapshot 0's restore is still running.
  restore(1, budget);
  EXPECT_EQ(listed_references(cache_list(cache)), (std::vector<std::string>{refs[1], refs[0]}));
  restore(2, budget);
  auto two = cache_list(cache);
  EXPECT_EQ(listed_references(two), (std::vector<std::string>{refs[2], refs[0]}));
  EXPECT_LE(two.at("bytes").get<uint64_t>(), budget_bytes);
  EXPECT_FALSE(sfs::exists(pulled / key(1)));
  EXPECT_TRUE(sfs::exists(pulled / key(0) / "manifest.json"));

  // The held restore ends well: its copy has snapshot 0's memory.
  ::unlink(gate.c_str());
  auto status = held.wait(std::chrono::seconds(120));
  ASSERT_TRUE(status && status->ok()) << fs::read_file(held_err);
  {
    Copies copies{json::parse(fs::read_file(held_out))};
    EXPECT_EQ(field(ask(copies.port(0), "INFO"), "seed"), caps[0].seed);
  }

  // In use no more, snapshot 0 is the least recently used: snapshot 1, restored again, takes its
  // place (fetched again: its chunks had left with it).
  auto again = gpusnap(restore_args(1, budget));
  ASSERT_EQ(again.exit_code, 0) << again.err;
  Copies copies{json::parse(again.out)};
  auto three = cache_list(cache);
  EXPECT_EQ(listed_references(three), (std::vector<std::string>{refs[1], refs[2]}));
  EXPECT_LE(three.at("bytes").get<uint64_t>(), budget_bytes);
  EXPECT_FALSE(sfs::exists(pulled / key(0)));
  EXPECT_TRUE(sfs::exists(pulled / key(2) / "manifest.json"));
  // Nothing of the evicted snapshots is left in the run directory, hidden or not.
  EXPECT_EQ(files_in(pulled), 2u);
  for (const auto& s : three.at("snapshots")) {
    EXPECT_EQ(mode_of(s.at("materialised").get<std::string>()), 0700u);
  }
}

// The digests of a pushed snapshot's chunks stored compressed (media type ...+zstd).
std::set<std::string> zstd_chunks(const json& manifest) {
  std::set<std::string> out;
  for (const auto& l : manifest.at("layers")) {
    if (l.at("mediaType") == "application/vnd.gpusnap.chunk.v1+zstd") {
      out.insert(l.at("digest").get<std::string>().substr(7));
    }
  }
  return out;
}

std::set<std::string> names_in(const sfs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : sfs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// Bytes allocated to the files under `dir` (0 when it does not exist).
uint64_t allocated(const sfs::path& dir) {
  uint64_t n = 0;
  std::error_code ec;
  for (sfs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0 && S_ISREG(st.st_mode)) n += st.st_blocks * 512ull;
  }
  return n;
}

// A pull into the node's copy (RUN_DIR/pulled/HEX, as restore oci:// and the agent make it)
// writes each uncompressed chunk once, into the copy: the cache's blobs hold only compressed
// ones. Killed, it resumes from what it had written; a snapshot sharing chunks with a copy
// there reads them from it.
TEST(StoreRegistry, ANodeCopyHoldsItsChunksOnceAndAKilledPullOfItResumes) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  auto snap = capture(dir, "snap", "48", "5");
  const json pushed = push(registry, snap, "r/s:v1");
  const size_t chunks = pushed.at("chunks");
  const std::string key = pushed.at("digest").get<std::string>().substr(7);
  const auto compressed = zstd_chunks(raw_manifest(registry, "r/s:v1"));
  ASSERT_LT(compressed.size(), chunks) << "no uncompressed chunk to test";

  const auto cache = dir / "cache";
  const auto run = dir / "run";
  const auto pulled = run / "pulled";
  const auto blobs = cache / "blobs" / "sha256";
  auto pull_args = [&](const std::string& ref) {
    return std::vector<std::string>{
        "pull", ref, "--run-dir", run.string(), "--cache", cache.string(), "--plain-http"};
  };
  {
    // One chunk at a time at 16 MiB/s: killed once several chunks are in its staging directory.
    common::SpawnOptions o;
    o.argv = pull_args(registry.ref("r/s:v1"));
    o.argv.insert(o.argv.begin(), gpusnap_bin());
    o.argv.insert(o.argv.end(), {"--jobs", "1", "--max-rate-mib", "16", "-q"});
    common::Subprocess slow(o);
    ASSERT_TRUE(eventually([&] { return sfs::exists(pulled) && allocated(pulled) >= (12u << 20); },
                           std::chrono::seconds(30)));
    slow.kill(SIGKILL);
    slow.wait();
  }
  ASSERT_FALSE(sfs::exists(pulled / key));
  for (const auto& name : names_in(blobs)) EXPECT_TRUE(compressed.count(name)) << name;

  auto args = pull_args(registry.ref("r/s:v1"));
  args.push_back("--json");
  auto again = gpusnap(args);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  auto doc = json::parse(again.out);
  EXPECT_EQ(doc.at("artifact"), (pulled / key).string());
  EXPECT_GT(doc.at("chunks_from_cache").get<size_t>(), 2u) << "fetched again: " << again.out;
  EXPECT_EQ(doc.at("chunks_fetched").get<size_t>() + doc.at("chunks_from_cache").get<size_t>(),
            chunks);
  EXPECT_EQ(contents(pulled / key), contents(snap.path));
  EXPECT_EQ(mode_of(pulled / key), 0700u);
  // Written once: nothing but the compressed chunks in the cache, nothing left of the killed
  // pull beside the copy.
  for (const auto& name : names_in(blobs)) EXPECT_TRUE(compressed.count(name)) << name;
  EXPECT_EQ(names_in(pulled), std::set<std::string>{key});
  auto list = cache_list(cache);
  EXPECT_EQ(list.at("materialised_bytes").get<uint64_t>(), allocated(pulled / key));
  // Pulled again: already there.
  EXPECT_EQ(json::parse(gpusnap(args).out).at("chunks_fetched"), 0);

  // A second capture of the same workload: what the first copy holds is read from it.
  auto second = capture(dir, "second", "48", "5");
  const json pushed2 = push(registry, second, "r/s:v2");
  args = pull_args(registry.ref("r/s:v2"));
  args.push_back("--json");
  auto d2 = gpusnap(args);
  ASSERT_EQ(d2.exit_code, 0) << d2.err;
  auto doc2 = json::parse(d2.out);
  const double fetched =
      doc2.at("bytes_fetched").get<double>() / doc2.at("stored_bytes").get<double>();
  EXPECT_LE(fetched, 0.25) << d2.out;
  print_result("node_copy_dedup", {{"stored_bytes", doc2.at("stored_bytes")},
                                   {"bytes_fetched", doc2.at("bytes_fetched")},
                                   {"fraction_fetched", fetched}});
  EXPECT_EQ(contents(pulled / pushed2.at("digest").get<std::string>().substr(7)),
            contents(second.path));
}

TEST(StoreRegistry, AnotherGpuRefusesAfterTheManifestAlone) {
  SKIP_WITHOUT_REGISTRY();
  TempDir dir;
  LocalRegistry registry(dir, {});
  auto snap = capture(dir, "snap", "16");
  // The same capture as if taken on an H200 with driver 580 (this host has no NVIDIA driver).
  auto doc = json::parse(fs::read_file(snap.path / "manifest.json"));
  doc["gpu"] = {{"driver_version", "580.95.05"},
                {"cuda_driver_version", 13000},
                {"gpus",
                 {{{"index", 0},
                   {"uuid", "GPU-00000000-1111-2222-3333-444444444444"},
                   {"name", "NVIDIA H200"},
                   {"bus_id", "00000000:19:00.0"},
                   {"compute_capability", "9.0"},
                   {"memory_total", 150754820096},
                   {"used", true}}}},
                {"processes", json::array()}};
  fs::write_file(snap.path / "manifest.json", doc.dump(2));
  auto push = gpusnap({"push", snap.path.string(), registry.ref("r/gpu:v1"), "--plain-http"});
  ASSERT_EQ(push.exit_code, 0) << push.err;
  auto raw = common::run_capture({"skopeo", "inspect", "--tls-verify=false", "--raw",
                                  "docker://" + registry.host() + "/r/gpu:v1"});
  EXPECT_EQ(json::parse(raw.output).at("annotations").at("org.gpusnap.gpu.model"), "NVIDIA H200");
  EXPECT_EQ(json::parse(raw.output).at("annotations").at("org.gpusnap.gpu.driver"), "580.95.05");

  const auto cache = dir / "cache";
  auto pull = gpusnap({"pull", registry.ref("r/gpu:v1"), "-o", (dir / "pulled").string(),
                       "--plain-http", "--cache", cache.string()});
  if (gpu::open_nvidia_driver()->available()) {
    EXPECT_EQ(pull.exit_code, 5) << pull.err;  // another driver version than 580.95.05
  } else {
    EXPECT_EQ(pull.exit_code, 10) << pull.err;
    EXPECT_EQ(pull.err.substr(0, pull.err.find(": libcuda.so.1")),
              "gpusnap: error: the artifact holds GPU state but this host has no usable NVIDIA "
              "driver");
    EXPECT_NE(pull.err.find("(fix: restore it on a host with the NVIDIA driver 580.95.05)\n"),
              std::string::npos);
  }
  EXPECT_FALSE(sfs::exists(dir / "pulled"));
  EXPECT_EQ(files_in(cache / "blobs" / "sha256"), 0u) << "a chunk was fetched";
}

}  // namespace
}  // namespace gpusnap::testing
