// Signed snapshots end to end: keys made by openssl, real captures of the test workload pushed
// with `gpusnap push --sign` to a real docker-registry, and pulls and restores under a node
// policy (store/signature.h, docs/security.md). The signatures the registry holds are forged
// and replayed through the registry's own API, as an attacker with push rights would.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/subprocess.h"
#include "store/digest.h"
#include "store/registry.h"
#include "store/registry_fixture.h"
#include "store/signature.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
namespace sfs = std::filesystem;

// The registry, two captures pushed as team/a and team/b, and two key pairs; made once for the
// suite (a capture takes seconds), each test signing and checking what it needs.
class Signatures : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (system_test_blocker() || LocalRegistry::blocker()) return;
    dir_ = new TempDir;
    registry_ = new LocalRegistry(*dir_, {});
    const sfs::path d = dir_->path();
    // Two ways of making a P-256 key, as operators do.
    openssl({"ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", (d / "k1.pem")});
    openssl({"ec", "-in", d / "k1.pem", "-pubout", "-out", d / "k1.pub"});
    openssl({"genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out",
             d / "k2.pem"});
    openssl({"pkey", "-in", d / "k2.pem", "-pubout", "-out", d / "k2.pub"});
    for (const std::string& name : {std::string("a"), std::string("b")}) {
      Workload w(*dir_, {"--mib", "8", "--seed", name == "a" ? "1111" : "2222"});
      if (name == "a") {
        port_a_ = w.port();
        seed_a_ = field(ask(w.port(), "INFO"), "seed");
      }
      const auto path = d / ("snap-" + name);
      auto r = gpusnap({"checkpoint", "--pid", std::to_string(w.pid()), "-o", path, "-q"});
      if (r.exit_code != 0) throw std::runtime_error("checkpoint failed: " + r.err);
    }
    digest_a_ = push("a", "team/a:v1", {});
    digest_b_ = push("b", "team/b:v1", {});
  }
  static void TearDownTestSuite() {
    delete registry_;
    delete dir_;
    registry_ = nullptr;
    dir_ = nullptr;
  }
  void SetUp() override {
    SKIP_WITHOUT_CRIU();
    GPUSNAP_SKIP_IF_BLOCKED(LocalRegistry::blocker());
    ASSERT_NE(registry_, nullptr);
  }

  static sfs::path path(const std::string& name) { return dir_->path() / name; }

  // gpusnap push of capture NAME to REPO:TAG with MORE flags; the manifest's digest.
  static std::string push(const std::string& name, const std::string& repo_and_tag,
                          const std::vector<std::string>& more) {
    std::vector<std::string> args{
        "push", path("snap-" + name), registry_->ref(repo_and_tag), "--plain-http", "--json", "-q"};
    args.insert(args.end(), more.begin(), more.end());
    auto r = gpusnap(args);
    if (r.exit_code != 0) throw std::runtime_error("push failed: " + r.err);
    return json::parse(r.out).at("digest");
  }

  // A policy file: default `fallback`, team/ signed by KEYS (public key files in the suite's
  // folder).
  std::string policy(const std::string& fallback, const std::vector<std::string>& keys) {
    json keys_json = json::array();
    for (const auto& k : keys) keys_json.push_back(path(k).string());
    json doc = {{"default", {{"type", fallback}}}};
    if (!keys.empty()) {
      doc["scopes"] = {{registry_->host() + "/team", {{"type", "signed"}, {"keys", keys_json}}}};
    }
    const auto file = local_.path() / ("policy-" + std::to_string(++policies_) + ".json");
    fs::write_file(file, doc.dump());
    return file;
  }

  // gpusnap pull -o of REPO@DIGEST under POLICY, into a fresh folder and cache.
  CliResult pull(const std::string& repo, const std::string& digest, const std::string& policy) {
    out_ = local_.path() / ("pulled-" + std::to_string(++pulls_));
    return gpusnap({"pull", registry_->ref(repo + "@" + digest), "--plain-http", "-o", out_,
                    "--cache", local_.path() / "cache", "--run-dir", local_.path() / "run",
                    "--signature-policy", policy, "-q"});
  }

  // The registry's API, as anyone with push rights to the repository reaches it.
  static store::Registry api(const std::string& repo_and_tag) {
    store::RegistryOptions o;
    o.plain_http = true;
    o.mirrors = false;
    return store::Registry(store::OciRef::parse(registry_->ref(repo_and_tag)), o);
  }

  static inline TempDir* dir_ = nullptr;
  static inline LocalRegistry* registry_ = nullptr;
  static inline std::string digest_a_;
  static inline std::string digest_b_;
  static inline uint16_t port_a_ = 0;
  static inline std::string seed_a_;
  TempDir local_;
  sfs::path out_;
  int policies_ = 0;
  int pulls_ = 0;
};

TEST_F(Signatures, SignedByATrustedKeyPullsAndRestores) {
  const std::string digest = push("a", "team/a:v1", {"--sign", path("k1.pem")});
  EXPECT_EQ(digest, digest_a_);  // signing leaves the snapshot's manifest as it was
  // Stored as cosign stores it: a manifest tagged sha256-HEX.sig whose one layer is the payload.
  auto [body, sig_digest] = api("team/a:" + store::signature_tag(digest)).fetch_manifest();
  const json sig = json::parse(body);
  ASSERT_EQ(sig.at("layers").size(), 1u);
  EXPECT_EQ(sig["layers"][0].at("mediaType"), "application/vnd.dev.cosign.simplesigning.v1+json");
  EXPECT_TRUE(sig["layers"][0].at("annotations").contains("dev.cosignproject.cosign/signature"));
  const json payload = json::parse(
      api("team/a:v1").fetch_blob(sig["layers"][0]["digest"], sig["layers"][0]["size"]));
  EXPECT_EQ(payload.at("critical").at("image").at("docker-manifest-digest"), digest);
  EXPECT_EQ(payload["critical"].at("type"), "cosign container image signature");

  const std::string trusting = policy("reject", {"k2.pub", "k1.pub"});
  auto r = pull("team/a", digest, trusting);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(sfs::exists(out_ / "manifest.json"));
  // By tag too: the tag is resolved to the digest the signature must name.
  auto by_tag =
      gpusnap({"pull", registry_->ref("team/a:v1"), "--plain-http", "-o", local_.path() / "by-tag",
               "--cache", local_.path() / "cache", "--signature-policy", trusting, "-q"});
  EXPECT_EQ(by_tag.exit_code, 0) << by_tag.err;

  // restore oci:// under the same policy: the copy restored answers with its seed.
  auto rs =
      gpusnap({"restore", registry_->ref("team/a@" + digest), "--plain-http", "--cache",
               local_.path() / "cache", "--run-dir", local_.path() / "run", "--signature-policy",
               trusting, "--publish", std::to_string(port_a_), "--json", "-q"});
  ASSERT_EQ(rs.exit_code, 0) << rs.err;
  Copies copies{json::parse(rs.out)};
  ASSERT_EQ(copies.copies.size(), 1u);
  EXPECT_EQ(field(ask(copies.port(0), "INFO"), "seed"), seed_a_);

  // skopeo copies the signature with the snapshot: the copy is trusted where it lands.
  for (const std::string& tag : {std::string("v1"), store::signature_tag(digest)}) {
    auto c = common::run_capture({"skopeo", "copy", "--all", "--src-tls-verify=false",
                                  "--dest-tls-verify=false",
                                  "docker://" + registry_->host() + "/team/a:" + tag,
                                  "docker://" + registry_->host() + "/team/copied:" + tag});
    ASSERT_TRUE(c.status.ok()) << c.output;
  }
  auto copied = pull("team/copied", digest, trusting);
  EXPECT_EQ(copied.exit_code, 0) << copied.err;
}

TEST_F(Signatures, UnsignedIsRefusedBeforeAnythingIsFetched) {
  const std::string trusting = policy("reject", {"k1.pub"});
  auto r = pull("team/b", digest_b_, trusting);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("refused " + registry_->host() + "/team/b@" + digest_b_ +
                       ": it is not signed (no " + store::signature_tag(digest_b_) + ")"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(sfs::exists(out_));
  EXPECT_FALSE(sfs::exists(local_.path() / "cache" / "blobs")) << "a chunk was fetched";

  // A restore likewise: nothing restored, no node copy made.
  auto rs = gpusnap({"restore", registry_->ref("team/b:v1"), "--plain-http", "--cache",
                     local_.path() / "cache", "--run-dir", local_.path() / "run",
                     "--signature-policy", trusting, "-q"});
  EXPECT_EQ(rs.exit_code, 4) << rs.err;
  EXPECT_NE(rs.err.find("it is not signed"), std::string::npos) << rs.err;
  EXPECT_FALSE(sfs::exists(local_.path() / "run" / "pulled" / store::digest_hex(digest_b_)));

  // The policy's default for another repository of the registry.
  push("b", "elsewhere/b:v1", {"--sign", path("k1.pem")});
  auto other = pull("elsewhere/b", digest_b_, trusting);
  EXPECT_EQ(other.exit_code, 4);
  EXPECT_NE(other.err.find("scope default rejects it"), std::string::npos) << other.err;
}

TEST_F(Signatures, AcceptLetsUnsignedThrough) {
  auto r = pull("team/b", digest_b_, policy("accept", {}));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(sfs::exists(out_ / "manifest.json"));
}

TEST_F(Signatures, SignedByAnotherKeyIsRefused) {
  push("b", "team/b:v1", {"--sign", path("k2.pem")});
  auto r = pull("team/b", digest_b_, policy("reject", {"k1.pub"}));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("its signature does not verify with any trusted key (" +
                       path("k1.pub").string() + ")"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(sfs::exists(out_));
}

TEST_F(Signatures, ForgedSignatureIsRefused) {
  push("a", "team/a:v1", {"--sign", path("k1.pem")});
  auto sig_api = api("team/a:" + store::signature_tag(digest_a_));
  json sig = json::parse(sig_api.fetch_manifest().first);
  // Flip bytes in the middle of the base64 signature: still base64, no longer the signature.
  std::string& s =
      sig["layers"][0]["annotations"]["dev.cosignproject.cosign/signature"].get_ref<std::string&>();
  for (size_t i = s.size() / 2; i < s.size() / 2 + 4; ++i) s[i] = s[i] == 'A' ? 'B' : 'A';
  sig_api.put_manifest(sig.dump(), "application/vnd.oci.image.manifest.v1+json");
  auto r = pull("team/a", digest_a_, policy("reject", {"k1.pub"}));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("does not verify with any trusted key"), std::string::npos) << r.err;
  EXPECT_FALSE(sfs::exists(out_));
  push("a", "team/a:v1", {"--sign", path("k1.pem")});  // mended for the other tests
}

TEST_F(Signatures, SignatureOfAnotherSnapshotIsRefused) {
  // A's genuine signature, replayed as B's: the same repository, so its payload blob is there.
  push("a", "team/a:v1", {"--sign", path("k1.pem")});
  push("b", "team/a:b", {});
  const std::string body = api("team/a:" + store::signature_tag(digest_a_)).fetch_manifest().first;
  api("team/a:" + store::signature_tag(digest_b_))
      .put_manifest(body, "application/vnd.oci.image.manifest.v1+json");
  auto r = pull("team/a", digest_b_, policy("reject", {"k1.pub"}));
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_NE(r.err.find("its signature is of " + digest_a_ + ", not of " + digest_b_),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(sfs::exists(out_));
  // The tag moved to another manifest under a signed tag: the manifest pulled is B's, whose
  // digest the signature does not name.
  push("b", "team/a:v1", {});
  auto swapped = gpusnap({"pull", registry_->ref("team/a:v1"), "--plain-http", "-o",
                          local_.path() / "swapped", "--cache", local_.path() / "cache",
                          "--signature-policy", policy("reject", {"k1.pub"}), "-q"});
  EXPECT_EQ(swapped.exit_code, 4) << swapped.err;
  EXPECT_FALSE(sfs::exists(local_.path() / "swapped"));
  push("a", "team/a:v1", {});  // mended for the other tests
}

TEST_F(Signatures, UnusableSigningKeyIsRefusedBeforeAnyUpload) {
  // A public key where the private one belongs: refused before the first chunk goes up.
  auto r = gpusnap({"push", path("snap-b"), registry_->ref("fresh/b:v1"), "--plain-http", "--sign",
                    path("k1.pub"), "-q"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("private key " + path("k1.pub").string() + " is not an unencrypted PEM key"),
            std::string::npos)
      << r.err;
  const std::string log = registry_->log();
  ASSERT_NE(log.find("/v2/team/a/blobs/"), std::string::npos) << "the log names requests";
  EXPECT_EQ(log.find("/v2/fresh/b/blobs/"), std::string::npos) << "a chunk went up";
}

TEST_F(Signatures, DamagedPolicyIsAUsageError) {
  const auto file = local_.path() / "policy.json";
  fs::write_file(file, R"({"default": {"type": "signed"}})");
  auto r = pull("team/a", digest_a_, file);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("signature policy " + file.string() +
                       ": default: \"signed\" needs \"keys\", a list of public key files"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  fs::write_file(file, "{\"default\": ");
  auto truncated = pull("team/a", digest_a_, file);
  EXPECT_EQ(truncated.exit_code, 2) << truncated.err;
  EXPECT_NE(truncated.err.find(file.string() + ": not JSON"), std::string::npos) << truncated.err;
  auto missing_key = pull("team/a", digest_a_, policy("reject", {"absent.pub"}));
  EXPECT_EQ(missing_key.exit_code, 2) << missing_key.err;
  EXPECT_NE(missing_key.err.find("cannot read public key " + path("absent.pub").string()),
            std::string::npos)
      << missing_key.err;
}

}  // namespace
}  // namespace gpusnap::testing
