// Encrypted snapshots end to end: keys made by openssl, a real capture of the test workload
// holding a known secret in its environment (as a token in a service's environment is), pushed
// with `gpusnap push --encrypt` to a real docker-registry, and the registry's storage searched
// for the secret as someone who can read it would (zstd-compressed blobs decompressed). Pulls
// and a restore with the node's key; refusals without it (store/encryption.h, docs/security.md).
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/subprocess.h"
#include "store/registry.h"
#include "store/registry_fixture.h"
#include "testing/harness.h"

namespace gpusnap::testing {
namespace {

using nlohmann::json;
namespace sfs = std::filesystem;

// The files of a registry's storage that hold `secret`: in their bytes, or, for a zstd frame
// (gpusnap's compressed chunks), in what `zstd -dc` makes of them.
std::vector<std::string> holding(const sfs::path& storage, const std::string& secret) {
  std::vector<std::string> found;
  for (const auto& e : sfs::recursive_directory_iterator(storage)) {
    if (!e.is_regular_file()) continue;
    const std::string data = fs::read_file(e.path());
    bool has = data.find(secret) != std::string::npos;
    if (!has && data.size() >= 4 && data.compare(0, 4, "\x28\xb5\x2f\xfd") == 0) {
      auto r = common::run_capture({"zstd", "-dc", e.path()});
      has = r.output.find(secret) != std::string::npos;
    }
    if (has) found.push_back(e.path().string());
  }
  return found;
}

// Two registries, one for plain pushes and one for encrypted ones only (so that a search of its
// storage finds what encryption let through, nothing else); one capture of the workload with
// the secret in its environment; three X25519 key pairs and an EC P-256 one.
class Encryption : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (system_test_blocker() || LocalRegistry::blocker()) return;
    dir_ = new TempDir;
    const sfs::path d = dir_->path();
    plain_ = new LocalRegistry(*dir_, {});
    sealed_ = new LocalRegistry(*dir_, {});
    for (const std::string k : {"alice", "bob", "mallory"}) {
      openssl({"genpkey", "-algorithm", "X25519", "-out", d / (k + ".pem")});
      openssl({"pkey", "-in", d / (k + ".pem"), "-pubout", "-out", d / (k + ".pub")});
    }
    openssl({"genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out",
             d / "carol.pem"});
    openssl({"pkey", "-in", d / "carol.pem", "-pubout", "-out", d / "carol.pub"});
    for (const std::string k : {"alice", "bob", "mallory", "carol"}) {
      sfs::permissions(d / (k + ".pem"), sfs::perms::owner_read | sfs::perms::owner_write,
                       sfs::perm_options::replace);
    }
    secret_ = "sk-gpusnap-" + fs::random_id() + "-token";
    // In the workload's environment, so in its stack, so in CRIU's pages image.
    ::setenv("GPUSNAP_TEST_API_TOKEN", secret_.c_str(), 1);  // NOLINT(concurrency-mt-unsafe)
    Workload w(*dir_, {"--mib", "8", "--seed", "4242"});
    ::unsetenv("GPUSNAP_TEST_API_TOKEN");  // NOLINT(concurrency-mt-unsafe)
    port_ = w.port();
    seed_ = field(ask(w.port(), "INFO"), "seed");
    auto r = gpusnap({"checkpoint", "--pid", std::to_string(w.pid()), "-o", d / "snap", "-q"});
    if (r.exit_code != 0) throw std::runtime_error("checkpoint failed: " + r.err);
  }
  static void TearDownTestSuite() {
    delete plain_;
    delete sealed_;
    delete dir_;
    plain_ = sealed_ = nullptr;
    dir_ = nullptr;
  }
  void SetUp() override {
    SKIP_WITHOUT_CRIU();
    GPUSNAP_SKIP_IF_BLOCKED(LocalRegistry::blocker());
    ASSERT_NE(dir_, nullptr);
  }

  static sfs::path path(const std::string& name) { return dir_->path() / name; }

  // gpusnap push of the capture to REPO:TAG of `registry` with MORE flags: its JSON document.
  static json push(const LocalRegistry& registry, const std::string& repo_and_tag,
                   const std::vector<std::string>& more) {
    std::vector<std::string> args{"push",         path("snap"), registry.ref(repo_and_tag),
                                  "--plain-http", "--json",     "-q"};
    args.insert(args.end(), more.begin(), more.end());
    auto r = gpusnap(args);
    if (r.exit_code != 0) throw std::runtime_error("push failed: " + r.err);
    return json::parse(r.out);
  }
  // --encrypt for each of KEYS (their .pub), with the suite's dedup secret.
  static std::vector<std::string> encrypt_for(const std::vector<std::string>& keys) {
    std::vector<std::string> flags;
    for (const auto& k : keys) {
      flags.push_back("--encrypt");
      flags.push_back(path(k + ".pub"));
    }
    flags.push_back("--dedup-secret");
    flags.push_back(path("dedup-secret"));
    return flags;
  }

  // gpusnap pull -o of REPO@DIGEST from the encrypted registry with MORE flags, into a fresh
  // folder and cache.
  CliResult pull(const std::string& ref, const std::vector<std::string>& more) {
    out_ = local_.path() / ("pulled-" + std::to_string(++pulls_));
    std::vector<std::string> args{"pull",
                                  ref,
                                  "--plain-http",
                                  "-o",
                                  out_,
                                  "--cache",
                                  local_.path() / "cache",
                                  "--run-dir",
                                  local_.path() / "run",
                                  "-q"};
    args.insert(args.end(), more.begin(), more.end());
    return gpusnap(args);
  }

  static inline TempDir* dir_ = nullptr;
  static inline LocalRegistry* plain_ = nullptr;
  static inline LocalRegistry* sealed_ = nullptr;
  static inline std::string secret_;
  static inline uint16_t port_ = 0;
  static inline std::string seed_;
  TempDir local_;
  sfs::path out_;
  int pulls_ = 0;
};

TEST_F(Encryption, TheRegistryHoldsTheSecretOnlyWithoutEncrypt) {
  // The check can fail: pushed plain, the secret is there for anyone who reads the storage.
  push(*plain_, "team/plain:v1", {});
  EXPECT_FALSE(holding(plain_->storage(), secret_).empty());

  const json r = push(*sealed_, "team/sealed:v1", encrypt_for({"alice", "bob"}));
  EXPECT_GT(r.at("chunks_uploaded").get<uint64_t>(), 0u);
  EXPECT_EQ(holding(sealed_->storage(), secret_), std::vector<std::string>{});
  // Nor is the layout readable (it names the process, its files and its environment's size).
  EXPECT_EQ(holding(sealed_->storage(), "\"processes\""), std::vector<std::string>{});

  // Read by other tools: skopeo shows the encrypted layers' media types and the recipients.
  auto inspect = common::run_capture({"skopeo", "inspect", "--raw", "--tls-verify=false",
                                      "docker://" + sealed_->host() + "/team/sealed:v1"});
  ASSERT_TRUE(inspect.status.ok()) << inspect.output;
  const json m = json::parse(inspect.output);
  EXPECT_EQ(m.at("layers").at(0).at("mediaType"),
            "application/vnd.gpusnap.snapshot.config.v1+json+encrypted");
  for (size_t i = 1; i < m["layers"].size(); ++i) {
    const std::string type = m["layers"][i].at("mediaType");
    EXPECT_TRUE(type == "application/vnd.gpusnap.chunk.v1+encrypted" ||
                type == "application/vnd.gpusnap.chunk.v1+zstd+encrypted")
        << type;
  }
  const std::string recipients = m.at("annotations").at("org.gpusnap.encryption.recipients");
  EXPECT_EQ(std::count(recipients.begin(), recipients.end(), ','), 1) << recipients;
}

TEST_F(Encryption, EitherRecipientsKeyPullsAndRestores) {
  const std::string ref =
      push(*sealed_, "team/sealed:v2", encrypt_for({"alice", "carol"})).at("reference");
  // Bob's key and Carol's (P-256) in a directory, as a mounted Secret holds them.
  const sfs::path keys = local_.path() / "keys";
  sfs::create_directories(keys / "..data");
  for (const std::string k : {"bob", "carol"}) sfs::copy_file(path(k + ".pem"), keys / k);
  auto r = pull(ref, {"--decryption-key", keys});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // The same files as the capture: verify checks every byte against the manifest.
  auto v = gpusnap({"verify", out_, "-q"});
  EXPECT_EQ(v.exit_code, 0) << v.out << v.err;
  EXPECT_EQ(fs::read_file(out_ / "manifest.json"), fs::read_file(path("snap") / "manifest.json"));

  // skopeo copies it as any other snapshot (the +encrypted layers as they are), and the copy
  // opens with the same keys.
  auto c = common::run_capture({"skopeo", "copy", "--all", "--src-tls-verify=false",
                                "--dest-tls-verify=false",
                                "docker://" + sealed_->host() + "/team/sealed:v2",
                                "docker://" + sealed_->host() + "/team/copied:v2"});
  ASSERT_TRUE(c.status.ok()) << c.output;
  const std::string digest = ref.substr(ref.find('@'));
  auto copied = pull(sealed_->ref("team/copied" + digest), {"--decryption-key", keys});
  EXPECT_EQ(copied.exit_code, 0) << copied.err;

  // restore oci:// with Alice's key: the copy answers with the workload's seed.
  auto rs = gpusnap({"restore", ref, "--plain-http", "--cache", local_.path() / "cache2",
                     "--run-dir", local_.path() / "run2", "--decryption-key", path("alice.pem"),
                     "--publish", std::to_string(port_), "--json", "-q"});
  ASSERT_EQ(rs.exit_code, 0) << rs.err;
  Copies copies{json::parse(rs.out)};
  ASSERT_EQ(copies.copies.size(), 1u);
  EXPECT_EQ(field(ask(copies.port(0), "INFO"), "seed"), seed_);
}

TEST_F(Encryption, WithoutTheKeyNothingIsWritten) {
  const json pushed = push(*sealed_, "team/sealed:v3", encrypt_for({"alice"}));
  const std::string ref = pushed.at("reference");
  const std::string digest = pushed.at("digest");

  auto none = pull(ref, {});
  EXPECT_EQ(none.exit_code, 12) << none.err;
  EXPECT_NE(none.err.find("is encrypted (for sha256:"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("and no decryption key was given (fix: give --decryption-key FILE"),
            std::string::npos)
      << none.err;
  EXPECT_EQ(std::count(none.err.begin(), none.err.end(), '\n'), 1) << none.err;
  EXPECT_FALSE(sfs::exists(out_));

  auto wrong = pull(ref, {"--decryption-key", path("mallory.pem")});
  EXPECT_EQ(wrong.exit_code, 12) << wrong.err;
  EXPECT_NE(wrong.err.find("none of the decryption keys given is one of them (" +
                           path("mallory.pem").string() + " sha256:"),
            std::string::npos)
      << wrong.err;
  EXPECT_FALSE(sfs::exists(out_));
  // Nothing in the node cache either: refused before the first chunk.
  EXPECT_FALSE(sfs::exists(local_.path() / "cache" / "blobs") &&
               !sfs::is_empty(local_.path() / "cache" / "blobs"));

  // restore oci:// refuses the same way, before anything is pulled.
  auto rs =
      gpusnap({"restore", ref, "--plain-http", "--cache", local_.path() / "cache", "--run-dir",
               local_.path() / "run", "--decryption-key", path("bob.pem"), "-q"});
  EXPECT_EQ(rs.exit_code, 12) << rs.err;
  EXPECT_FALSE(sfs::exists(local_.path() / "run" / "pulled" / digest.substr(7)));

  // A key file others may read is refused before anything is fetched.
  const sfs::path exposed = local_.path() / "exposed.pem";
  sfs::copy_file(path("alice.pem"), exposed);
  sfs::permissions(exposed, sfs::perms::group_read, sfs::perm_options::add);
  auto e = pull(ref, {"--decryption-key", exposed});
  EXPECT_EQ(e.exit_code, 12) << e.err;
  EXPECT_NE(e.err.find("decryption key " + exposed.string() +
                       " is readable by its group or others (mode 0640)"),
            std::string::npos)
      << e.err;
  EXPECT_FALSE(sfs::exists(out_));
}

TEST_F(Encryption, ChunksDedupForTheSameRecipientsOnly) {
  const json first = push(*sealed_, "team/dedup:a", encrypt_for({"alice", "bob"}));
  // The same recipients in another order and the same secret: every chunk is there already.
  const json again = push(*sealed_, "team/dedup:b", encrypt_for({"bob", "alice"}));
  EXPECT_EQ(again.at("chunks_uploaded"), 0) << again.dump();
  EXPECT_EQ(again.at("bytes_uploaded"), 0);
  // Another recipient set seals every chunk differently: nothing is shared, nothing linkable.
  const json other = push(*sealed_, "team/dedup:c", encrypt_for({"alice"}));
  EXPECT_EQ(other.at("chunks_uploaded"), first.at("chunks")) << other.dump();
  // Another dedup secret too.
  auto own = encrypt_for({"alice", "bob"});
  own.back() = local_.path() / "other-secret";
  const json elsewhere = push(*sealed_, "team/dedup:d", own);
  EXPECT_EQ(elsewhere.at("chunks_uploaded"), first.at("chunks")) << elsewhere.dump();
  struct stat st {};
  ASSERT_EQ(::stat((local_.path() / "other-secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);  // made by push, for root alone
}

}  // namespace
}  // namespace gpusnap::testing
