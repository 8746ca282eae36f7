// OpenSSL 3's EVP throughout: AES-256-GCM (EVP_aes_256_gcm, AES-NI where present), HMAC-SHA256,
// HKDF (EVP_PKEY_HKDF) and ECDH (EVP_PKEY_derive), the same calls whatever the recipient's curve.
// A GCM tag is always 16 bytes and always checked (EVP_DecryptFinal_ex fails on a wrong one).
#include "store/encryption.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/kdf.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <set>

#include <nlohmann/json.hpp>

#include "common/fd.h"
#include "common/fs.h"
#include "common/json.h"
#include "gpusnap/error.h"
#include "store/digest.h"
#include "store/pem_key.h"

namespace gpusnap::store {

namespace {

using nlohmann::json;

constexpr size_t kKeyBytes = 32;    // AES-256
constexpr size_t kTagBytes = 16;    // GCM's tag
constexpr size_t kNonceBytes = 12;  // GCM's nonce
constexpr size_t kMaxKeyFileBytes = 64 << 10;
constexpr size_t kMaxRecipients = 64;
constexpr const char* kEnvelopeFormat = "gpusnap-encrypted-layout";
constexpr const char* kLayoutAad = "gpusnap encrypted layout v1";
constexpr const char* kWrapInfo = "gpusnap key wrap v1\n";
constexpr const char* kConvergenceInfo = "gpusnap convergence v1\n";
constexpr const char* kChunkInfo = "gpusnap chunk v1\n";

using Ctx = std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)>;
using PkeyCtx = std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)>;

// A failure of OpenSSL where nothing the user gave is wrong.
[[noreturn]] void crypto_failed(const std::string& what) {
  throw Error(ErrorKind::kInternal, what + ": " + openssl_error());
}

const unsigned char* bytes(std::string_view s) {
  return reinterpret_cast<const unsigned char*>(s.data());
}

std::string base64(std::string_view data) {
  std::string out(4 * ((data.size() + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()), bytes(data),
                                static_cast<int>(data.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

// False for text that is not base64. EVP_DecodeBlock counts padding as zero bytes: dropped.
bool unbase64(const std::string& text, std::string* out) {
  if (text.empty() || text.size() % 4 != 0) return false;
  out->assign(3 * text.size() / 4, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out->data()), bytes(text),
                                static_cast<int>(text.size()));
  if (n < 0) return false;
  size_t pad = 0;
  for (size_t i = text.size(); i > 0 && text[i - 1] == '='; --i) ++pad;
  out->resize(static_cast<size_t>(n) - std::min<size_t>(pad, static_cast<size_t>(n)));
  return true;
}

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1) {
    crypto_failed("random bytes");
  }
  return out;
}

std::string hmac_sha256(std::string_view key, std::string_view data) {
  std::string out(32, '\0');
  unsigned int size = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), bytes(data), data.size(),
           reinterpret_cast<unsigned char*>(out.data()), &size) == nullptr) {
    crypto_failed("HMAC-SHA256");
  }
  return out;
}

// AES-256-GCM: the ciphertext followed by the tag.
std::string seal_gcm(std::string_view key, std::string_view nonce, std::string_view aad,
                     std::string_view plain) {
  Ctx ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  std::string out(plain.size() + kTagBytes, '\0');
  auto* o = reinterpret_cast<unsigned char*>(out.data());
  int n = 0;
  int tail = 0;
  if (!ctx ||
      EVP_EncryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, bytes(key), bytes(nonce)) != 1 ||
      EVP_EncryptUpdate(ctx.get(), nullptr, &n, bytes(aad), static_cast<int>(aad.size())) != 1 ||
      EVP_EncryptUpdate(ctx.get(), o, &n, bytes(plain), static_cast<int>(plain.size())) != 1 ||
      EVP_EncryptFinal_ex(ctx.get(), o + n, &tail) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kTagBytes, o + plain.size()) != 1) {
    crypto_failed("AES-256-GCM encryption");
  }
  return out;
}

// False when the tag does not match: the key is another, or a byte changed.
bool open_gcm(std::string_view key, std::string_view nonce, std::string_view aad,
              std::string_view sealed, std::string* plain) {
  if (sealed.size() < kTagBytes || key.size() != kKeyBytes) return false;
  const size_t size = sealed.size() - kTagBytes;
  Ctx ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  plain->assign(size, '\0');
  auto* o = reinterpret_cast<unsigned char*>(plain->data());
  std::string tag(sealed.substr(size));
  int n = 0;
  int tail = 0;
  const bool ok =
      ctx &&
      EVP_DecryptInit_ex(ctx.get(), EVP_aes_256_gcm(), nullptr, bytes(key), bytes(nonce)) == 1 &&
      EVP_DecryptUpdate(ctx.get(), nullptr, &n, bytes(aad), static_cast<int>(aad.size())) == 1 &&
      EVP_DecryptUpdate(ctx.get(), o, &n, bytes(sealed), static_cast<int>(size)) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kTagBytes, tag.data()) == 1 &&
      EVP_DecryptFinal_ex(ctx.get(), o + n, &tail) == 1;
  ERR_clear_error();
  return ok;
}

std::string public_der(EVP_PKEY* key) {
  unsigned char* der = nullptr;
  const int n = i2d_PUBKEY(key, &der);
  if (n <= 0) crypto_failed("encode a public key");
  std::string out(reinterpret_cast<char*>(der), static_cast<size_t>(n));
  OPENSSL_free(der);
  return out;
}

std::string fingerprint_of(EVP_PKEY* key) { return sha256_digest(public_der(key)); }

bool agreement_key(EVP_PKEY* key) {
  const int id = EVP_PKEY_base_id(key);
  return id == EVP_PKEY_X25519 || id == EVP_PKEY_X448 || id == EVP_PKEY_EC;
}

// A fresh key of the recipient's kind (and curve), for one ECDH.
std::shared_ptr<EVP_PKEY> ephemeral_for(EVP_PKEY* recipient) {
  EVP_PKEY* k = nullptr;
  switch (EVP_PKEY_base_id(recipient)) {
    case EVP_PKEY_X25519: k = EVP_PKEY_Q_keygen(nullptr, nullptr, "X25519"); break;
    case EVP_PKEY_X448: k = EVP_PKEY_Q_keygen(nullptr, nullptr, "X448"); break;
    default: {
      char group[64] = {};
      size_t len = 0;
      if (EVP_PKEY_get_group_name(recipient, group, sizeof group, &len) != 1) {
        crypto_failed("read the curve of a recipient's key");
      }
      k = EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", group);
    }
  }
  if (k == nullptr) crypto_failed("make an ephemeral key");
  return {k, EVP_PKEY_free};
}

// The key-encryption key of one recipient entry: HKDF-SHA256 of the ECDH secret of `own` and
// `peer`, bound to both public keys. False when the two do not agree (another curve).
bool wrapping_key(EVP_PKEY* own, EVP_PKEY* peer, const std::string& ephemeral_der,
                  const std::string& recipient_der, std::string* kek) {
  PkeyCtx ctx(EVP_PKEY_CTX_new(own, nullptr), EVP_PKEY_CTX_free);
  size_t size = 0;
  if (!ctx || EVP_PKEY_derive_init(ctx.get()) != 1 ||
      EVP_PKEY_derive_set_peer(ctx.get(), peer) != 1 ||
      EVP_PKEY_derive(ctx.get(), nullptr, &size) != 1) {
    ERR_clear_error();
    return false;
  }
  std::string secret(size, '\0');
  if (EVP_PKEY_derive(ctx.get(), reinterpret_cast<unsigned char*>(secret.data()), &size) != 1) {
    ERR_clear_error();
    return false;
  }
  secret.resize(size);
  const std::string info = kWrapInfo + ephemeral_der + recipient_der;
  PkeyCtx kdf(EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr), EVP_PKEY_CTX_free);
  kek->assign(kKeyBytes, '\0');
  size_t out = kKeyBytes;
  if (!kdf || EVP_PKEY_derive_init(kdf.get()) != 1 ||
      EVP_PKEY_CTX_set_hkdf_md(kdf.get(), EVP_sha256()) != 1 ||
      EVP_PKEY_CTX_set1_hkdf_key(kdf.get(), bytes(secret), static_cast<int>(secret.size())) != 1 ||
      EVP_PKEY_CTX_add1_hkdf_info(kdf.get(), bytes(info), static_cast<int>(info.size())) != 1 ||
      EVP_PKEY_derive(kdf.get(), reinterpret_cast<unsigned char*>(kek->data()), &out) != 1) {
    crypto_failed("HKDF-SHA256");
  }
  OPENSSL_cleanse(secret.data(), secret.size());
  return true;
}

std::string read_key_file(const std::filesystem::path& file, const std::string& what) {
  std::error_code ec;
  const auto real = std::filesystem::canonical(file, ec);
  std::string data;
  if (ec || !fs::try_read_regular_file(real, &data, kMaxKeyFileBytes)) {
    const int err = ec ? ec.value() : errno;
    throw Error(ErrorKind::kUsage,
                "cannot read " + what + " " + file.string() + ": " +
                    (err == EFBIG ? "larger than 64 KiB" : errno_text(err)),
                "give the right file");
  }
  return data;
}

const char* const kMakeKey =
    "make a key pair with `openssl genpkey -algorithm X25519 -out KEY.pem` (its public half: "
    "`openssl pkey -in KEY.pem -pubout -out KEY.pub`)";

std::shared_ptr<EVP_PKEY> parse_key(const std::string& pem, const std::filesystem::path& file,
                                    bool is_private) {
  std::shared_ptr<EVP_PKEY> owned = parse_pem_key(pem, is_private);
  EVP_PKEY* key = owned.get();
  const std::string kind = is_private ? "decryption key " : "recipient key ";
  if (key == nullptr) {
    throw Error(ErrorKind::kUsage,
                kind + file.string() + " is not an unencrypted PEM " +
                    (is_private ? "private" : "public") + " key: " + openssl_error(),
                kMakeKey);
  }
  if (!agreement_key(key)) {
    throw Error(ErrorKind::kUsage,
                kind + file.string() + " is not an X25519, X448 or EC key (ECDH needs one)",
                kMakeKey);
  }
  return owned;
}

std::string text_of(const json& doc, const char* key) {
  return doc.is_object() && doc.contains(key) && doc[key].is_string() ? doc[key].get<std::string>()
                                                                      : std::string();
}

Error damaged(const std::string& name, const std::string& why) {
  return {ErrorKind::kBadArtifact, "the encrypted layout of " + name + " " + why,
          "push the snapshot again; if it keeps failing, someone changed the registry's copy"};
}

// "A, B, C and 2 more": the recipients a message names.
std::string listed(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < 4; ++i) out += (i == 0 ? "" : ", ") + items[i];
  if (items.size() > 4) out += " and " + std::to_string(items.size() - 4) + " more";
  return out;
}

// The node's convergence secret: read, or made where none exists yet.
std::string dedup_secret(const std::filesystem::path& file) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) {
    const auto dir = file.parent_path();
    if (!dir.empty() && !std::filesystem::exists(dir, ec)) {
      std::filesystem::create_directories(dir, ec);
      if (ec) throw sys_error("create " + dir.string(), ec.value());
      std::filesystem::permissions(dir, std::filesystem::perms::owner_all,
                                   std::filesystem::perm_options::replace, ec);
    }
    // O_EXCL: of two pushes making it at once, one writes it and both read the same.
    common::UniqueFd fd(::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (fd) {
      const std::string secret = random_bytes(kKeyBytes);
      if (::write(fd.get(), secret.data(), secret.size()) != static_cast<ssize_t>(secret.size()) ||
          ::fsync(fd.get()) != 0) {
        throw sys_error("write " + file.string(), errno);
      }
    } else if (errno != EEXIST) {
      throw sys_error("create the dedup secret " + file.string(), errno);
    }
  }
  refuse_exposed_key_file(file, "dedup secret");
  std::string secret = read_key_file(file, "dedup secret");
  if (secret.size() < kKeyBytes) {
    throw Error(ErrorKind::kUsage, "dedup secret " + file.string() + " holds fewer than 32 bytes",
                "remove it (push makes a new one; chunks then dedup only with later pushes) or "
                "write 32 random bytes there (`openssl rand 32 > FILE`)");
  }
  return secret;
}

}  // namespace

void refuse_exposed_key_file(const std::filesystem::path& file, const std::string& what) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) {
    throw Error(ErrorKind::kUsage,
                "cannot read " + what + " " + file.string() + ": " + errno_text(errno),
                "give the right file");
  }
  if ((st.st_mode & (S_IRGRP | S_IROTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw Error(ErrorKind::kKey,
                what + " " + file.string() + " is readable by its group or others (mode " + mode +
                    "): a key others can read is no secret",
                "chmod 600 " + file.string() +
                    " (from a Kubernetes Secret: mount it with defaultMode 0400, as the chart "
                    "does)");
  }
}

Recipient Recipient::load(const std::filesystem::path& file) {
  Recipient r;
  r.file = file;
  r.key = parse_key(read_key_file(file, "recipient key"), file, false);
  r.fingerprint = fingerprint_of(r.key.get());
  return r;
}

std::shared_ptr<const DecryptionKeys> DecryptionKeys::load(const std::vector<std::string>& paths) {
  auto keys = std::make_shared<DecryptionKeys>();
  auto add = [&](const std::filesystem::path& file) {
    refuse_exposed_key_file(file, "decryption key");
    Key k;
    k.file = file;
    k.key = parse_key(read_key_file(file, "decryption key"), file, true);
    k.fingerprint = fingerprint_of(k.key.get());
    keys->keys_.push_back(std::move(k));
  };
  for (const std::string& path : paths) {
    std::error_code ec;
    if (!std::filesystem::is_directory(path, ec)) {
      add(path);
      continue;
    }
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(path, ec)) {
      if (e.path().filename().string().starts_with(".")) continue;  // a Secret's ..data
      if (std::filesystem::is_regular_file(e.path(), ec)) files.push_back(e.path());
    }
    if (ec) throw sys_error("read the directory of decryption keys " + path, ec.value());
    std::sort(files.begin(), files.end());
    if (files.empty()) {
      throw Error(ErrorKind::kUsage, "the directory of decryption keys " + path + " holds none",
                  "put the node's private keys there, one PEM file each");
    }
    for (const auto& f : files) add(f);
  }
  return keys;
}

ChunkSealer::ChunkSealer(const std::vector<std::filesystem::path>& recipients,
                         const std::filesystem::path& dedup_secret_file) {
  std::set<std::string> fingerprints;
  for (const auto& file : recipients) {
    Recipient r = Recipient::load(file);
    if (fingerprints.insert(r.fingerprint).second) recipients_.push_back(std::move(r));
  }
  if (recipients_.size() > kMaxRecipients) {
    throw Error(ErrorKind::kUsage, "more than 64 recipients", "encrypt for fewer keys");
  }
  // The recipient set's own key: snapshots for the same set share chunks, snapshots for
  // another set share none (their sealed chunks cannot be matched across sets).
  std::string set = kConvergenceInfo;
  for (const auto& f : fingerprints) set += f + "\n";
  std::string secret = dedup_secret(dedup_secret_file);
  convergence_key_ = hmac_sha256(secret, set);
  OPENSSL_cleanse(secret.data(), secret.size());
}

ChunkSealer::Sealed ChunkSealer::seal(const std::string& digest, std::string_view blob) {
  const std::string key = hmac_sha256(convergence_key_, kChunkInfo + digest);
  const std::string nonce(kNonceBytes, '\0');  // the key seals this plaintext only
  Sealed out{"", seal_gcm(key, nonce, {}, blob)};
  out.digest = sha256_digest(out.bytes);
  std::lock_guard lock(mu_);
  chunks_[digest] = {out.digest, out.bytes.size(), key};
  return out;
}

std::string ChunkSealer::seal_layout(const Layout& layout) const {
  json chunks = json::object();
  for (const auto& [plain, c] : chunks_) {
    chunks[plain] = {{"digest", c.digest}, {"size", c.size}, {"key", base64(c.key)}};
  }
  const std::string plain = json{{"layout", layout.to_json()}, {"chunks", chunks}}.dump();
  std::string data_key = random_bytes(kKeyBytes);
  const std::string nonce = random_bytes(kNonceBytes);
  json recipients = json::array();
  for (const Recipient& r : recipients_) {
    auto ephemeral = ephemeral_for(r.key.get());
    const std::string ephemeral_der = public_der(ephemeral.get());
    std::string kek;
    if (!wrapping_key(ephemeral.get(), r.key.get(), ephemeral_der, public_der(r.key.get()), &kek)) {
      crypto_failed("ECDH with recipient key " + r.file.string());
    }
    // A fresh ephemeral key, so a fresh wrapping key: the zero nonce is used once.
    recipients.push_back({{"key", r.fingerprint},
                          {"ephemeral", base64(ephemeral_der)},
                          {"wrapped", base64(seal_gcm(kek, std::string(kNonceBytes, '\0'),
                                                      r.fingerprint, data_key))}});
    OPENSSL_cleanse(kek.data(), kek.size());
  }
  json envelope = {{"format", kEnvelopeFormat},
                   {"version", 1},
                   {"cipher", "AES-256-GCM"},
                   {"recipients", std::move(recipients)},
                   {"nonce", base64(nonce)},
                   {"ciphertext", base64(seal_gcm(data_key, nonce, kLayoutAad, plain))}};
  OPENSSL_cleanse(data_key.data(), data_key.size());
  return envelope.dump();
}

std::string ChunkSealer::fingerprints() const {
  std::string out;
  for (const Recipient& r : recipients_) out += (out.empty() ? "" : ",") + r.fingerprint;
  return out;
}

OpenedLayout open_layout(std::string_view blob, const DecryptionKeys* keys,
                         const std::string& name) {
  std::string why;
  const std::optional<json> parsed = json_text::parse(blob, &why);
  if (!parsed) throw damaged(name, "is not JSON: " + why);
  const json& env = *parsed;
  if (text_of(env, "format") != kEnvelopeFormat || !env.contains("version") ||
      env.at("version") != 1 || text_of(env, "cipher") != "AES-256-GCM" ||
      !env.contains("recipients") || !env.at("recipients").is_array() ||
      env.at("recipients").empty() || env.at("recipients").size() > kMaxRecipients) {
    throw damaged(name, "is not a version 1 AES-256-GCM envelope with recipients");
  }
  std::vector<std::string> recipients;
  for (const json& r : env.at("recipients")) recipients.push_back(text_of(r, "key"));
  std::string data_key;
  for (const json& r : env.at("recipients")) {
    if (keys == nullptr || !data_key.empty()) break;
    for (const DecryptionKeys::Key& k : keys->keys()) {
      if (k.fingerprint != text_of(r, "key")) continue;
      std::string ephemeral_der;
      std::string wrapped;
      if (!unbase64(text_of(r, "ephemeral"), &ephemeral_der) ||
          !unbase64(text_of(r, "wrapped"), &wrapped)) {
        throw damaged(name, "has a recipient entry for " + k.fingerprint + " that is not base64");
      }
      const unsigned char* p = bytes(ephemeral_der);
      std::shared_ptr<EVP_PKEY> ephemeral(
          d2i_PUBKEY(nullptr, &p, static_cast<long>(ephemeral_der.size())), EVP_PKEY_free);
      ERR_clear_error();
      std::string kek;
      if (!ephemeral || EVP_PKEY_base_id(ephemeral.get()) != EVP_PKEY_base_id(k.key.get()) ||
          !wrapping_key(k.key.get(), ephemeral.get(), ephemeral_der, public_der(k.key.get()),
                        &kek) ||
          !open_gcm(kek, std::string(kNonceBytes, '\0'), k.fingerprint, wrapped, &data_key) ||
          data_key.size() != kKeyBytes) {
        throw damaged(name, "holds a data key for " + k.fingerprint + " (" + k.file.string() +
                                ") that does not open with it");
      }
      OPENSSL_cleanse(kek.data(), kek.size());
      break;
    }
  }
  if (data_key.empty()) {
    if (keys == nullptr || keys->keys().empty()) {
      throw Error(
          ErrorKind::kKey,
          name + " is encrypted (for " + listed(recipients) + ") and no decryption key was given",
          "give --decryption-key FILE (or a directory of keys): the private key of one "
          "of its recipients");
    }
    std::vector<std::string> given;
    for (const auto& k : keys->keys()) given.push_back(k.file.string() + " " + k.fingerprint);
    throw Error(ErrorKind::kKey,
                name + " is encrypted for " + listed(recipients) +
                    "; none of the decryption keys given is one of them (" + listed(given) + ")",
                "give --decryption-key with the private key of one of its recipients");
  }
  std::string nonce;
  std::string sealed;
  std::string plain;
  if (!unbase64(text_of(env, "nonce"), &nonce) || nonce.size() != kNonceBytes ||
      !unbase64(text_of(env, "ciphertext"), &sealed)) {
    throw damaged(name, "has no base64 nonce of 12 bytes and ciphertext");
  }
  const bool opened = open_gcm(data_key, nonce, kLayoutAad, sealed, &plain);
  OPENSSL_cleanse(data_key.data(), data_key.size());
  if (!opened) throw damaged(name, "does not open with its data key (a byte changed)");
  const std::optional<json> doc = json_text::parse(plain, &why);
  if (!doc || !doc->is_object() || !doc->contains("layout") || !doc->contains("chunks") ||
      !doc->at("chunks").is_object()) {
    throw damaged(name, "opens to no layout and chunks");
  }
  OpenedLayout out{Layout::from_json(doc->at("layout")), {}};
  const json& chunks = doc->at("chunks");
  for (const BlobInfo& b : out.layout.blobs()) {
    const std::string at = "chunk " + b.digest;
    if (!chunks.contains(b.digest)) throw damaged(name, "names no sealed blob for " + at);
    const json& c = chunks.at(b.digest);
    SealedChunk s;
    s.digest = text_of(c, "digest");
    if (!valid_digest(s.digest) || !c.contains("size") || !c.at("size").is_number_unsigned() ||
        c.at("size").get<uint64_t>() != b.size + kTagBytes ||
        !unbase64(text_of(c, "key"), &s.key) || s.key.size() != kKeyBytes) {
      throw damaged(name,
                    "has no sealed digest, size (the chunk's and 16) and 32-byte key for " + at);
    }
    s.size = c.at("size").get<uint64_t>();
    out.chunks.emplace(b.digest, std::move(s));
  }
  return out;
}

std::string open_chunk(const std::string& digest, const SealedChunk& chunk,
                       std::string_view sealed) {
  std::string plain;
  if (!open_gcm(chunk.key, std::string(kNonceBytes, '\0'), {}, sealed, &plain)) {
    throw Error(ErrorKind::kBadArtifact,
                "chunk " + digest + " (sealed as " + chunk.digest + ") does not open with its key",
                "push the snapshot again; if it keeps failing, someone changed the registry's "
                "copy");
  }
  if (sha256_digest(plain) != digest) {
    throw Error(ErrorKind::kBadArtifact,
                "chunk " + chunk.digest + " opens to bytes that are not the chunk " + digest +
                    " its layout names",
                "the snapshot was made to mislead: push it again from a trusted node");
  }
  return plain;
}

}  // namespace gpusnap::store
