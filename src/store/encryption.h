// Encrypted snapshots: what `push --encrypt` stores and what pull, `restore oci://` and the agent
// open with the node's key (docs/security.md "Encryption", docs/store.md "Encrypted snapshots").
//
// Chunks: each chunk's blob (zstd or raw, as the chunker made it) is sealed with AES-256-GCM
// under a key of its own, derived from its plaintext digest by HMAC-SHA256 under the
// recipient set's convergence key (a node secret, --dedup-secret, and the recipients' key
// fingerprints): the same chunk pushed for the same recipients seals to the same bytes, so a
// registry still holds it once and a second push sends only what changed. A key seals one
// plaintext only, so its nonce is fixed (zero). Stored as sealed bytes followed by the 16-byte
// tag, media type application/vnd.gpusnap.chunk.v1[+zstd]+encrypted ("+encrypted" as OCI
// image encryption marks its layers).
//
// Layout (layer 0, application/vnd.gpusnap.snapshot.config.v1+json+encrypted): a JSON envelope
//   {"format":"gpusnap-encrypted-layout","version":1,"cipher":"AES-256-GCM",
//    "recipients":[{"key":"sha256:FPR","ephemeral":B64,"wrapped":B64}...],
//    "nonce":B64,"ciphertext":B64}
// where the ciphertext is {"layout":LAYOUT,"chunks":{"sha256:PLAIN":{"digest":"sha256:SEALED",
// "size":N,"key":B64}}} under a fresh data key of the snapshot, and each recipient's `wrapped`
// is that data key sealed under HKDF-SHA256 of an ECDH agreement between a fresh ephemeral key
// (`ephemeral`, DER SubjectPublicKeyInfo) and the recipient's public key (X25519, X448, or an
// EC curve: P-256, P-384, P-521). FPR is sha256 of the recipient's DER public key.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "store/layout.h"

struct evp_pkey_st;  // OpenSSL's EVP_PKEY

namespace gpusnap::store {

inline constexpr const char* kEncryptedSuffix = "+encrypted";
inline constexpr const char* kEncryptedConfigMediaType =
    "application/vnd.gpusnap.snapshot.config.v1+json+encrypted";
inline constexpr const char* kRecipientsAnnotation = "org.gpusnap.encryption.recipients";
// Where push keeps the node's convergence secret unless --dedup-secret names another file.
inline constexpr const char* kDefaultDedupSecret = "/var/lib/gpusnap/dedup-secret";

// Refuses (Error kKey, naming the file and the fix) a file of secret key material that its
// group or others may read: a private key, the dedup secret. A mounted Secret's file is a
// symlink: the mode of what it points to counts.
void refuse_exposed_key_file(const std::filesystem::path& file, const std::string& what);

// A public key a snapshot is encrypted for (--encrypt FILE, PEM).
struct Recipient {
  std::filesystem::path file;
  std::string fingerprint;  // "sha256:HEX" of its DER SubjectPublicKeyInfo
  std::shared_ptr<evp_pkey_st> key;
  // Throws Error(kUsage) for a file that is not a PEM public key of a kind ECDH takes.
  static Recipient load(const std::filesystem::path& file);
};

// The node's private keys (--decryption-key FILE or DIR, repeatable), read when loaded: every
// file given, and every file of a directory given whose name does not start with a dot (a
// mounted Secret's ..data). Throws Error(kKey) for a file its group or others may read,
// Error(kUsage) for one that is not a PEM private key ECDH takes.
class DecryptionKeys {
 public:
  static std::shared_ptr<const DecryptionKeys> load(const std::vector<std::string>& paths);
  struct Key {
    std::filesystem::path file;
    std::string fingerprint;  // of its public half
    std::shared_ptr<evp_pkey_st> key;
  };
  const std::vector<Key>& keys() const { return keys_; }

 private:
  std::vector<Key> keys_;
};

// Where a chunk of an encrypted snapshot lies in the registry, and the key that opens it.
struct SealedChunk {
  std::string digest;  // of the sealed blob
  uint64_t size = 0;
  std::string key;  // 32 bytes
};
// By the digest of the chunk's plaintext blob (the layout's extents name that one).
using SealedChunks = std::map<std::string, SealedChunk>;

// Seals the chunks and the layout of one push. Reads the recipients and the dedup secret when
// constructed, before anything is uploaded (a key it cannot use costs nothing). The dedup
// secret is made (32 random bytes, mode 0600) where none exists yet.
class ChunkSealer {
 public:
  ChunkSealer(const std::vector<std::filesystem::path>& recipients,
              const std::filesystem::path& dedup_secret_file);
  // The sealed bytes of the chunk whose plaintext blob is `blob` (digest `digest`), and their
  // digest; records them for the layout. Thread-safe.
  struct Sealed {
    std::string digest;
    std::string bytes;
  };
  Sealed seal(const std::string& digest, std::string_view blob);
  const SealedChunks& chunks() const { return chunks_; }  // once the chunks are sealed
  // The layout blob: `layout` and the chunks' keys under a fresh data key, wrapped for each
  // recipient.
  std::string seal_layout(const Layout& layout) const;
  // The recipients' fingerprints, comma-separated (an annotation of the manifest).
  std::string fingerprints() const;

 private:
  std::vector<Recipient> recipients_;
  std::string convergence_key_;
  std::mutex mu_;
  SealedChunks chunks_;
};

// An encrypted snapshot's layout, opened.
struct OpenedLayout {
  Layout layout;
  SealedChunks chunks;
};
// Opens the layout blob of `name` (a reference, for messages) with one of `keys` (null: none
// given). Throws Error(kKey) naming the snapshot's recipients and the keys given when none of
// them is a recipient, Error(kBadArtifact) when the blob is damaged or does not open.
OpenedLayout open_layout(std::string_view blob, const DecryptionKeys* keys,
                         const std::string& name);

// The plaintext blob of chunk `digest` from its sealed bytes, checked against `digest` (a
// snapshot whose chunk opens to other bytes than it names must not reach the node cache under
// that name). Throws Error(kBadArtifact).
std::string open_chunk(const std::string& digest, const SealedChunk& chunk,
                       std::string_view sealed);

}  // namespace gpusnap::store
