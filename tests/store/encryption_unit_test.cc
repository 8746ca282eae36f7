// Encryption's parts on their own (store/encryption.h): real keys made with OpenSSL, a small
// artifact cut by the chunker, its chunks and layout sealed and opened again; what a wrong key,
// a changed byte, a lying layout and a key file others may read get.
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "common/fs.h"
#include "gpusnap/artifact.h"
#include "gpusnap/error.h"
#include "store/chunker.h"
#include "store/digest.h"
#include "store/encryption.h"
#include "store/plain_artifact.h"
#include "store/signature.h"
#include "testing/unit.h"

namespace gpusnap::testing {
namespace {

namespace sfs = std::filesystem;

// A key pair of `algorithm` ("X25519", or "EC" on P-256) as NAME.pem (mode 0600) and NAME.pub.
void make_key(const sfs::path& dir, const std::string& name, const std::string& algorithm) {
  EVP_PKEY* key = algorithm == "EC" ? EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256")
                                    : EVP_PKEY_Q_keygen(nullptr, nullptr, algorithm.c_str());
  ASSERT_NE(key, nullptr);
  for (bool is_private : {true, false}) {
    const sfs::path file = dir / (name + (is_private ? ".pem" : ".pub"));
    FILE* f = std::fopen(file.c_str(), "w");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(is_private ? PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr)
                         : PEM_write_PUBKEY(f, key),
              1);
    std::fclose(f);
    if (is_private) {
      sfs::permissions(file, sfs::perms::owner_read | sfs::perms::owner_write,
                       sfs::perm_options::replace);
    }
  }
  EVP_PKEY_free(key);
}

class EncryptionUnit : public ::testing::Test {
 protected:
  void SetUp() override {
    const sfs::path d = dir_.path();
    make_key(d, "alice", "X25519");
    make_key(d, "carol", "EC");
    make_key(d, "mallory", "X25519");
    // A small artifact: 3 MiB of a CRIU-like pages image, half of it data.
    const sfs::path root = d / "snap";
    sfs::create_directories(root / "criu");
    std::mt19937_64 rng(7);
    std::string pages(3 << 20, '\0');
    for (size_t i = 0; i < pages.size() / 2; i += 8) {
      const uint64_t v = rng();
      std::memcpy(pages.data() + i, &v, 8);
    }
    fs::write_file(root / "criu" / "pages-1.img", pages);
    write_plain_manifest(root);
    Reporter quiet;
    layout_ = store::chunk_artifact(
        Artifact::open(root), {},
        [&](const store::Chunk& c) {
          std::lock_guard lock(mu_);
          plain_[c.extent.digest] = std::string(c.blob);
        },
        quiet);
    ASSERT_GE(plain_.size(), 1u);
  }

  sfs::path path(const std::string& name) const { return dir_.path() / name; }

  // Seals every chunk for RECIPIENTS (names) under the dedup secret SECRET: the sealer, and
  // the sealed bytes by their digest.
  std::unique_ptr<store::ChunkSealer> seal(const std::vector<std::string>& recipients,
                                           const std::string& secret = "secret") {
    std::vector<sfs::path> files;
    for (const auto& r : recipients) files.push_back(path(r + ".pub"));
    auto sealer = std::make_unique<store::ChunkSealer>(files, path(secret));
    for (const auto& [digest, blob] : plain_) {
      auto s = sealer->seal(digest, blob);
      EXPECT_EQ(s.digest, store::sha256_digest(s.bytes));
      stored_[s.digest] = s.bytes;
    }
    return sealer;
  }

  std::shared_ptr<const store::DecryptionKeys> keys(const std::vector<std::string>& names) {
    std::vector<std::string> files;
    for (const auto& n : names) files.push_back(path(n + ".pem"));
    return store::DecryptionKeys::load(files);
  }

  TempDir dir_;
  store::Layout layout_;
  std::mutex mu_;
  std::map<std::string, std::string> plain_;   // chunk blobs by digest
  std::map<std::string, std::string> stored_;  // sealed blobs by digest
};

template <class Fn>
Error error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error";
  return Error(ErrorKind::kInternal, "");
}

TEST_F(EncryptionUnit, EitherRecipientOpensTheLayoutAndEveryChunk) {
  auto sealer = seal({"alice", "carol"});
  const std::string blob = sealer->seal_layout(layout_);
  EXPECT_EQ(blob.find("pages-1.img"), std::string::npos);  // the layout is not readable
  for (const std::string who : {"alice", "carol"}) {
    SCOPED_TRACE(who);
    const store::OpenedLayout opened = store::open_layout(blob, keys({who}).get(), "snap");
    EXPECT_EQ(opened.layout.to_json(), layout_.to_json());
    ASSERT_EQ(opened.chunks.size(), plain_.size());
    for (const auto& [digest, bytes] : plain_) {
      const store::SealedChunk& c = opened.chunks.at(digest);
      EXPECT_EQ(c.size, bytes.size() + 16);
      ASSERT_TRUE(stored_.count(c.digest));
      EXPECT_NE(stored_.at(c.digest).substr(0, 64), bytes.substr(0, 64));
      EXPECT_EQ(store::open_chunk(digest, c, stored_.at(c.digest)), bytes);
    }
  }
}

TEST_F(EncryptionUnit, WithoutARecipientsKeyTheLayoutIsRefusedByName) {
  auto sealer = seal({"alice"});
  const std::string blob = sealer->seal_layout(layout_);
  const std::string alice = sealer->fingerprints();
  Error none = error_of([&] { store::open_layout(blob, nullptr, "oci://r/team/a@sha256:1"); });
  EXPECT_EQ(none.kind(), ErrorKind::kKey);
  EXPECT_EQ(none.one_line(),
            "oci://r/team/a@sha256:1 is encrypted (for " + alice +
                ") and no decryption key was given (fix: give --decryption-key FILE (or a "
                "directory of keys): the private key of one of its recipients)");
  auto mallory = keys({"mallory"});
  Error wrong = error_of([&] { store::open_layout(blob, mallory.get(), "snap"); });
  EXPECT_EQ(wrong.kind(), ErrorKind::kKey);
  EXPECT_EQ(wrong.one_line(),
            "snap is encrypted for " + alice +
                "; none of the decryption keys given is one of "
                "them (" +
                path("mallory.pem").string() + " " + mallory->keys()[0].fingerprint +
                ") (fix: give --decryption-key with the private key of one of its recipients)");
}

TEST_F(EncryptionUnit, AChangedByteOrALyingLayoutIsRefused) {
  auto sealer = seal({"alice"});
  std::string blob = sealer->seal_layout(layout_);
  auto alice = keys({"alice"});
  // A byte of the layout's ciphertext (base64 'A' <-> 'B' flips bits of one byte).
  const size_t at = blob.find("\"ciphertext\":\"") + 20;
  blob[at] = blob[at] == 'A' ? 'B' : 'A';
  Error changed = error_of([&] { store::open_layout(blob, alice.get(), "snap"); });
  EXPECT_EQ(changed.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(changed.what(), std::string("the encrypted layout of snap does not open with its "
                                        "data key (a byte changed)"));

  const auto opened = store::open_layout(sealer->seal_layout(layout_), alice.get(), "snap");
  const auto& [digest, chunk] = *opened.chunks.begin();
  std::string sealed = stored_.at(chunk.digest);
  sealed[sealed.size() / 2] ^= 1;
  Error flipped = error_of([&] { store::open_chunk(digest, chunk, sealed); });
  EXPECT_EQ(flipped.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(flipped.what(),
            "chunk " + digest + " (sealed as " + chunk.digest + ") does not open with its key");
  // A layout that names a chunk for bytes that are another's (to plant them in a node cache
  // under that name) is caught by the plaintext's digest.
  const std::string other = store::sha256_digest("another chunk");
  Error lying = error_of([&] { store::open_chunk(other, chunk, stored_.at(chunk.digest)); });
  EXPECT_EQ(lying.kind(), ErrorKind::kBadArtifact);
  EXPECT_EQ(lying.what(), "chunk " + chunk.digest + " opens to bytes that are not the chunk " +
                              other + " its layout names");
}

TEST_F(EncryptionUnit, ChunksSealAlikeForTheSameRecipientsAndSecretOnly) {
  auto first = seal({"alice", "carol"});
  auto again = seal({"carol", "alice"});  // the order does not matter
  auto other_set = seal({"alice"});
  auto other_secret = seal({"alice", "carol"}, "another-secret");
  for (const auto& [digest, bytes] : plain_) {
    const std::string sealed = first->chunks().at(digest).digest;
    EXPECT_EQ(again->chunks().at(digest).digest, sealed);
    EXPECT_NE(other_set->chunks().at(digest).digest, sealed);
    EXPECT_NE(other_secret->chunks().at(digest).digest, sealed);
  }
  // Each layout has a data key of its own, though.
  EXPECT_NE(first->seal_layout(layout_), again->seal_layout(layout_));
  struct stat st {};
  ASSERT_EQ(::stat(path("secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(fs::read_file(path("secret")).size(), 32u);
}

TEST_F(EncryptionUnit, AKeyFileOthersMayReadIsRefused) {
  sfs::permissions(path("alice.pem"), sfs::perms::others_read, sfs::perm_options::add);
  Error e = error_of([&] { keys({"alice"}); });
  EXPECT_EQ(e.kind(), ErrorKind::kKey);
  EXPECT_EQ(e.exit_code(), 12);
  EXPECT_EQ(e.one_line(), "decryption key " + path("alice.pem").string() +
                              " is readable by its group or others (mode 0604): a key others "
                              "can read is no secret (fix: chmod 600 " +
                              path("alice.pem").string() +
                              " (from a Kubernetes Secret: mount it with defaultMode 0400, as "
                              "the chart does))");
  // So is a dedup secret, and a key in a directory of keys; a dot entry (a Secret's ..data)
  // is not a key.
  fs::write_file(path("loose-secret"), std::string(32, 's'));
  sfs::permissions(path("loose-secret"), sfs::perms::group_read, sfs::perm_options::add);
  EXPECT_EQ(error_of([&] { seal({"alice"}, "loose-secret"); }).kind(), ErrorKind::kKey);
  const sfs::path dir = path("keys");
  sfs::create_directories(dir / "..data");
  sfs::copy_file(path("carol.pem"), dir / "carol");
  EXPECT_EQ(store::DecryptionKeys::load({dir.string()})->keys().size(), 1u);
  sfs::copy_file(path("alice.pem"), dir / "alice");
  EXPECT_EQ(error_of([&] { store::DecryptionKeys::load({dir.string()}); }).kind(), ErrorKind::kKey);
}

TEST_F(EncryptionUnit, APolicyOrTrustedKeyOthersMayWriteIsRefused) {
  // A public key may be read by anyone; whoever may write it decides what the node trusts.
  const sfs::path policy = path("policy.json");
  fs::write_file(
      policy, R"({"default":{"type":"signed","keys":[")" + path("carol.pub").string() + R"("]}})");
  sfs::permissions(policy,
                   sfs::perms::owner_read | sfs::perms::owner_write | sfs::perms::group_read |
                       sfs::perms::others_read,
                   sfs::perm_options::replace);
  sfs::permissions(path("carol.pub"),
                   sfs::perms::owner_read | sfs::perms::group_read | sfs::perms::others_read,
                   sfs::perm_options::replace);
  EXPECT_NE(store::SignaturePolicy::load(policy), nullptr);
  sfs::permissions(path("carol.pub"), sfs::perms::others_write, sfs::perm_options::add);
  Error key = error_of([&] { store::SignaturePolicy::load(policy); });
  EXPECT_EQ(key.kind(), ErrorKind::kKey);
  EXPECT_EQ(key.one_line(), "public key " + path("carol.pub").string() +
                                " is writable by its group or others (mode 0446): whoever can "
                                "write it decides what this node trusts (fix: chmod go-w " +
                                path("carol.pub").string() + ")");
  sfs::permissions(path("carol.pub"), sfs::perms::others_write, sfs::perm_options::remove);
  sfs::permissions(policy, sfs::perms::group_write, sfs::perm_options::add);
  EXPECT_EQ(error_of([&] { store::SignaturePolicy::load(policy); }).kind(), ErrorKind::kKey);
}

}  // namespace
}  // namespace gpusnap::testing
