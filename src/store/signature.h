// Snapshot signatures and the node's policy on them (docs/security.md).
//
// A signature is stored as cosign stores one, so that cosign, skopeo and registries' UIs read it
// and `skopeo copy --all` carries it: an OCI image manifest tagged sha256-HEX.sig (HEX: the
// signed manifest's digest) in the snapshot's repository, whose one layer is cosign's "simple
// signing" payload
//   {"critical":{"identity":{"docker-reference":HOST/REPO},
//                "image":{"docker-manifest-digest":"sha256:HEX"},
//                "type":"cosign container image signature"},"optional":null}
// (media type application/vnd.dev.cosign.simplesigning.v1+json) with the annotation
// dev.cosignproject.cosign/signature: base64 of the ECDSA signature (DER) over sha256 of the
// payload's bytes. A tag, not an OCI 1.1 referrer: docker-registry 2.8 has no referrers API,
// and the tag works on every registry.
//
// The policy (a node's JSON file, in the spirit of containers-policy.json) says, per registry
// or repository, whether a snapshot must be signed and by which keys; it is checked where a
// manifest's digest is first known (store/transfer.h read_remote, store/reach.h), before any
// other byte of the snapshot is fetched.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "store/registry.h"

struct evp_pkey_st;  // OpenSSL's EVP_PKEY

namespace gpusnap::store {

inline constexpr const char* kDefaultPolicyFile = "/etc/gpusnap/policy.json";
inline constexpr const char* kSimpleSigningMediaType =
    "application/vnd.dev.cosign.simplesigning.v1+json";
inline constexpr const char* kCosignSignatureAnnotation = "dev.cosignproject.cosign/signature";
// What gpusnap reads from outside for a signature: the policy file, a key, the signature's
// manifest, its payload.
inline constexpr size_t kMaxPolicyBytes = 1 << 20;
inline constexpr size_t kMaxKeyBytes = 64 << 10;
inline constexpr size_t kMaxSignatureManifestBytes = 64 << 10;
inline constexpr size_t kMaxPayloadBytes = 64 << 10;

// The tag a manifest's signature is stored under: "sha256-HEX.sig".
std::string signature_tag(const std::string& digest);

// A public key the policy trusts (a PEM file), loaded once.
struct TrustedKey {
  std::string path;
  std::shared_ptr<evp_pkey_st> key;
};

struct Requirement {
  enum class Type { kAccept, kReject, kSigned };
  Type type = Type::kAccept;
  std::vector<TrustedKey> keys;  // kSigned: any one of them
  std::string scope;             // "default", or the HOST[/REPO] prefix it is written for
};

class SignaturePolicy {
 public:
  // Reads FILE (at most 1 MiB; symlinks followed, as a mounted ConfigMap is one) and every key
  // it names. Throws Error(kUsage), one line naming the file and what is wrong, for a damaged
  // policy or a key that cannot be read.
  static std::shared_ptr<const SignaturePolicy> load(const std::filesystem::path& file);
  // The node's policy: `flag` (--signature-policy) when given, else kDefaultPolicyFile when it
  // exists, else none (null: every snapshot accepted).
  static std::shared_ptr<const SignaturePolicy> for_node(const std::string& flag);

  // The requirement for HOST/REPO: the scope that is the longest prefix of it (whole path
  // components), else the default.
  const Requirement& requirement(const OciRef& ref) const;
  const std::filesystem::path& file() const { return file_; }

 private:
  std::filesystem::path file_;
  Requirement default_;
  std::map<std::string, Requirement> scopes_;
};

// Refuses (Error kBadArtifact, naming the digest, the scope and the keys) the manifest `digest`
// of `ref`'s repository unless the policy accepts it: for a kSigned scope, a signature under
// signature_tag(digest) whose payload names exactly `digest` and verifies with a trusted key.
void check_signature(const SignaturePolicy& policy, const OciRef& ref, const std::string& digest,
                     const RegistryOptions& options);

// A PEM private key (ECDSA, as cosign's default P-256), read when constructed: push reads it
// before its first upload, so that a key it cannot use costs nothing. Throws Error(kUsage).
class SigningKey {
 public:
  explicit SigningKey(const std::filesystem::path& file);
  // Signs the manifest `digest` of `ref`'s repository and stores the signature under
  // signature_tag(digest). Returns its reference (oci://HOST/REPO:sha256-HEX.sig).
  std::string sign(const OciRef& ref, const std::string& digest,
                   const RegistryOptions& options) const;

 private:
  std::filesystem::path file_;
  std::shared_ptr<evp_pkey_st> key_;
};

}  // namespace gpusnap::store
