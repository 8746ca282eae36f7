#include "store/signature.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <sys/stat.h>

#include <cstdio>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "gpusnap/error.h"
#include "store/digest.h"
#include "store/pem_key.h"

namespace gpusnap::store {

namespace {

using nlohmann::json;

constexpr const char* kSignatureType = "cosign container image signature";
constexpr size_t kMaxSignatureLayers = 16;  // cosign adds one per signing; more is not a signature

// A file the node's operator names (policy, key): bounded, regular, symlinks followed (a mounted
// ConfigMap or Secret is a symlink into its ..data folder). One its group or others may write
// is refused (kKey): whoever can write the policy or a trusted key decides what the node
// restores. (Private keys are refused when others may read them: store/encryption.h.)
std::string read_bounded(const std::filesystem::path& file, size_t max_bytes,
                         const std::string& what, const std::string& hint) {
  std::error_code ec;
  const auto real = std::filesystem::canonical(file, ec);
  std::string data;
  if (ec || !fs::try_read_regular_file(real, &data, max_bytes)) {
    const int err = ec ? ec.value() : errno;
    throw Error(ErrorKind::kUsage,
                "cannot read " + what + " " + file.string() + ": " +
                    (err == EFBIG ? "larger than " + std::to_string(max_bytes) + " bytes"
                                  : errno_text(err)),
                hint);
  }
  struct stat st {};
  if (::stat(real.c_str(), &st) == 0 && (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw Error(ErrorKind::kKey,
                what + " " + file.string() + " is writable by its group or others (mode " + mode +
                    "): whoever can write it decides what this node trusts",
                "chmod go-w " + file.string());
  }
  return data;
}

std::shared_ptr<EVP_PKEY> read_key(const std::string& pem, const std::filesystem::path& file,
                                   bool is_private) {
  std::shared_ptr<EVP_PKEY> owned = parse_pem_key(pem, is_private);
  EVP_PKEY* key = owned.get();
  if (key == nullptr) {
    throw Error(ErrorKind::kUsage,
                std::string(is_private ? "private" : "public") + " key " + file.string() +
                    " is not an unencrypted PEM key: " + openssl_error(),
                is_private ? "make one with `openssl ecparam -name prime256v1 -genkey -noout "
                             "-out KEY.pem` (its public half: `openssl ec -in KEY.pem -pubout`)"
                           : "write the public key as PEM (`openssl ec -in KEY.pem -pubout`)");
  }
  if (EVP_PKEY_base_id(key) != EVP_PKEY_EC) {
    throw Error(ErrorKind::kUsage, "key " + file.string() + " is not an ECDSA key",
                "use an ECDSA P-256 key, as cosign does (`openssl ecparam -name prime256v1 "
                "-genkey -noout -out KEY.pem`)");
  }
  return owned;
}

std::string base64(const std::string& bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  const int n =
      EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                      reinterpret_cast<const unsigned char*>(bytes.data()), int(bytes.size()));
  out.resize(size_t(n));
  return out;
}

// False for text that is not base64. EVP_DecodeBlock counts padding as zero bytes: dropped.
bool unbase64(const std::string& text, std::string* out) {
  if (text.empty() || text.size() % 4 != 0) return false;
  out->assign(3 * text.size() / 4, '\0');
  const int n =
      EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out->data()),
                      reinterpret_cast<const unsigned char*>(text.data()), int(text.size()));
  if (n < 0) return false;
  size_t pad = 0;
  for (size_t i = text.size(); i > 0 && text[i - 1] == '='; --i) ++pad;
  out->resize(size_t(n) - std::min<size_t>(pad, size_t(n)));
  return true;
}

bool verifies(EVP_PKEY* key, const std::string& payload, const std::string& signature) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  const bool ok =
      ctx && EVP_DigestVerifyInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key) == 1 &&
      EVP_DigestVerify(ctx.get(), reinterpret_cast<const unsigned char*>(signature.data()),
                       signature.size(), reinterpret_cast<const unsigned char*>(payload.data()),
                       payload.size()) == 1;
  ERR_clear_error();
  return ok;
}

std::string sign_payload(EVP_PKEY* key, const std::string& payload,
                         const std::filesystem::path& file) {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  size_t size = 0;
  const auto* data = reinterpret_cast<const unsigned char*>(payload.data());
  if (!ctx || EVP_DigestSignInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key) != 1 ||
      EVP_DigestSign(ctx.get(), nullptr, &size, data, payload.size()) != 1) {
    throw Error(ErrorKind::kUsage, "cannot sign with " + file.string() + ": " + openssl_error());
  }
  std::string der(size, '\0');
  if (EVP_DigestSign(ctx.get(), reinterpret_cast<unsigned char*>(der.data()), &size, data,
                     payload.size()) != 1) {
    throw Error(ErrorKind::kUsage, "cannot sign with " + file.string() + ": " + openssl_error());
  }
  der.resize(size);
  return der;
}

Requirement read_requirement(const json& doc, const std::string& scope,
                             const std::filesystem::path& file) {
  const auto bad = [&](const std::string& what) {
    return Error(
        ErrorKind::kUsage, "signature policy " + file.string() + ": " + scope + ": " + what,
        R"(write {"type":"accept"}, {"type":"reject"} or {"type":"signed","keys":["PUB.pem"]})");
  };
  if (!doc.is_object() || !doc.contains("type") || !doc["type"].is_string()) {
    throw bad("not an object with a \"type\"");
  }
  Requirement r;
  r.scope = scope;
  const std::string type = doc["type"];
  for (const auto& [k, v] : doc.items()) {
    if (k != "type" && !(k == "keys" && type == "signed")) throw bad("unknown key \"" + k + "\"");
  }
  if (type == "accept") {
    r.type = Requirement::Type::kAccept;
  } else if (type == "reject") {
    r.type = Requirement::Type::kReject;
  } else if (type == "signed") {
    r.type = Requirement::Type::kSigned;
    if (!doc.contains("keys") || !doc["keys"].is_array() || doc["keys"].empty()) {
      throw bad("\"signed\" needs \"keys\", a list of public key files");
    }
    for (const auto& k : doc["keys"]) {
      if (!k.is_string() || k.get<std::string>().empty()) throw bad("a key is not a file name");
      const std::string path = k;
      const std::string pem =
          read_bounded(path, kMaxKeyBytes, "public key", "fix the policy " + file.string());
      r.keys.push_back({path, read_key(pem, path, false)});
    }
  } else {
    throw bad("unknown type \"" + type + "\"");
  }
  return r;
}

std::string key_list(const Requirement& r) {
  std::string out;
  for (const auto& k : r.keys) out += (out.empty() ? "" : ", ") + k.path;
  return out;
}

// Why the signatures at `tag` do not admit `digest`, or empty when one does.
std::string refusal(Registry& registry, const Requirement& r, const std::string& digest) {
  std::string body;
  try {
    body = registry.fetch_manifest(kMaxSignatureManifestBytes).first;
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kNotFound) return "it is not signed (no " + registry.ref().tag + ")";
    throw;
  }
  const json m = json::parse(body, nullptr, false);
  if (!m.is_object() || !m.contains("layers") || !m["layers"].is_array() ||
      m["layers"].size() > kMaxSignatureLayers) {
    return "its signature manifest " + registry.ref().tag + " is not a cosign signature";
  }
  std::string why = "no signature at " + registry.ref().tag;
  for (const auto& layer : m["layers"]) {
    if (!layer.is_object() || layer.value("mediaType", json()) != kSimpleSigningMediaType ||
        !layer.contains("digest") || !layer["digest"].is_string() ||
        !valid_digest(layer["digest"].get<std::string>()) || !layer.contains("size") ||
        !layer["size"].is_number_unsigned()) {
      continue;
    }
    const uint64_t size = layer["size"];
    if (size > kMaxPayloadBytes) {
      why = "its signature payload is larger than " + std::to_string(kMaxPayloadBytes) + " bytes";
      continue;
    }
    const json annotations = layer.value("annotations", json::object());
    std::string signature;
    if (!annotations.is_object() || !annotations.contains(kCosignSignatureAnnotation) ||
        !annotations[kCosignSignatureAnnotation].is_string() ||
        !unbase64(annotations[kCosignSignatureAnnotation], &signature)) {
      why = "its signature at " + registry.ref().tag + " has no readable " +
            kCosignSignatureAnnotation + " annotation";
      continue;
    }
    const std::string payload = registry.fetch_blob(layer["digest"], size);
    const json p = json::parse(payload, nullptr, false);
    const json* named = nullptr;
    if (p.is_object() && p.contains("critical") && p["critical"].is_object() &&
        p["critical"].value("type", json()) == kSignatureType && p["critical"].contains("image") &&
        p["critical"]["image"].is_object() &&
        p["critical"]["image"].contains("docker-manifest-digest")) {
      named = &p["critical"]["image"]["docker-manifest-digest"];
    }
    if (named == nullptr || !named->is_string()) {
      why = "its signature payload is not a cosign simple signing payload";
      continue;
    }
    // The signature is over the payload, and the payload names the digest: a signature of
    // another manifest (replayed, or the manifest swapped under it) names another digest.
    if (*named != digest) {
      why = "its signature is of " + named->get<std::string>() + ", not of " + digest +
            " (a signature of another snapshot)";
      continue;
    }
    for (const auto& k : r.keys) {
      if (verifies(k.key.get(), payload, signature)) return {};
    }
    why = "its signature does not verify with any trusted key (" + key_list(r) + ")";
  }
  return why;
}

}  // namespace

std::string signature_tag(const std::string& digest) {
  return "sha256-" + digest_hex(digest) + ".sig";
}

std::shared_ptr<const SignaturePolicy> SignaturePolicy::load(const std::filesystem::path& file) {
  const std::string text = read_bounded(file, kMaxPolicyBytes, "signature policy",
                                        "name a readable policy file (--signature-policy)");
  const json doc = json::parse(text, nullptr, false);
  const auto bad = [&](const std::string& what) {
    return Error(
        ErrorKind::kUsage, "signature policy " + file.string() + ": " + what,
        R"(write {"default":{"type":"reject"},"scopes":{"HOST/REPO":{"type":"signed","keys":["PUB.pem"]}}})");
  };
  if (doc.is_discarded()) throw bad("not JSON");
  if (!doc.is_object() || !doc.contains("default")) throw bad("no \"default\"");
  auto policy = std::make_shared<SignaturePolicy>();
  policy->file_ = file;
  for (const auto& [k, v] : doc.items()) {
    if (k != "default" && k != "scopes") throw bad("unknown key \"" + k + "\"");
  }
  policy->default_ = read_requirement(doc["default"], "default", file);
  if (doc.contains("scopes")) {
    if (!doc["scopes"].is_object()) throw bad("\"scopes\" is not an object");
    for (const auto& [scope, v] : doc["scopes"].items()) {
      if (scope.empty() || scope.ends_with('/') || scope.find("://") != std::string::npos) {
        throw bad("scope \"" + scope + "\" is not HOST[:PORT][/REPOSITORY]");
      }
      policy->scopes_[scope] = read_requirement(v, scope, file);
    }
  }
  return policy;
}

std::shared_ptr<const SignaturePolicy> SignaturePolicy::for_node(const std::string& flag) {
  if (!flag.empty()) return load(flag);
  std::error_code ec;
  if (std::filesystem::exists(kDefaultPolicyFile, ec)) return load(kDefaultPolicyFile);
  return nullptr;
}

const Requirement& SignaturePolicy::requirement(const OciRef& ref) const {
  const std::string name = ref.host + "/" + ref.repository;
  const Requirement* best = &default_;
  size_t best_length = 0;
  for (const auto& [scope, r] : scopes_) {
    const bool covers = name == scope || (name.starts_with(scope) && name[scope.size()] == '/');
    if (covers && scope.size() > best_length) {
      best = &r;
      best_length = scope.size();
    }
  }
  return *best;
}

void check_signature(const SignaturePolicy& policy, const OciRef& ref, const std::string& digest,
                     const RegistryOptions& options) {
  const Requirement& r = policy.requirement(ref);
  const std::string what = ref.host + "/" + ref.repository + "@" + digest;
  const std::string rule = "policy " + policy.file().string() + ", scope " + r.scope;
  if (r.type == Requirement::Type::kAccept) return;
  if (r.type == Requirement::Type::kReject) {
    throw Error(ErrorKind::kBadArtifact, "refused " + what + ": " + rule + " rejects it",
                "add a scope for the repository to " + policy.file().string());
  }
  OciRef at = ref;
  at.tag = signature_tag(digest);
  at.digest.clear();
  RegistryOptions o = options;
  o.mirrors = false;  // the signature from the repository the policy names
  Registry registry(at, o);
  const std::string why = refusal(registry, r, digest);
  if (why.empty()) return;
  throw Error(ErrorKind::kBadArtifact, "refused " + what + ": " + why + " (" + rule + ")",
              "push it signed by a trusted key (`gpusnap push --sign KEY`), or trust its key in " +
                  policy.file().string());
}

SigningKey::SigningKey(const std::filesystem::path& file)
    : file_(file),
      key_(read_key(read_bounded(file, kMaxKeyBytes, "signing key",
                                 "name a readable PEM private key (--sign KEY)"),
                    file, true)) {}

std::string SigningKey::sign(const OciRef& ref, const std::string& digest,
                             const RegistryOptions& options) const {
  const json payload_doc = {{"critical",
                             {{"identity", {{"docker-reference", ref.host + "/" + ref.repository}}},
                              {"image", {{"docker-manifest-digest", digest}}},
                              {"type", kSignatureType}}},
                            {"optional", nullptr}};
  const std::string payload = payload_doc.dump();
  const std::string signature = base64(sign_payload(key_.get(), payload, file_));
  const std::string payload_digest = sha256_digest(payload);
  // cosign's config: an empty image whose one diff_id is the payload's.
  const std::string config = json{{"architecture", ""},
                                  {"os", ""},
                                  {"config", json::object()},
                                  {"rootfs", {{"type", "layers"}, {"diff_ids", {payload_digest}}}}}
                                 .dump();
  OciRef at = ref;
  at.tag = signature_tag(digest);
  at.digest.clear();
  Registry registry(at, options);
  const std::string config_digest = sha256_digest(config);
  for (const auto& [d, blob] : {std::pair{payload_digest, payload}, {config_digest, config}}) {
    if (!registry.blob_exists(d)) registry.upload_blob(d, blob);
  }
  const json manifest = {{"schemaVersion", 2},
                         {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
                         {"config",
                          {{"mediaType", "application/vnd.oci.image.config.v1+json"},
                           {"digest", config_digest},
                           {"size", config.size()}}},
                         {"layers",
                          {{{"mediaType", kSimpleSigningMediaType},
                            {"digest", payload_digest},
                            {"size", payload.size()},
                            {"annotations", {{kCosignSignatureAnnotation, signature}}}}}}};
  registry.put_manifest(manifest.dump(), "application/vnd.oci.image.manifest.v1+json");
  return at.str();
}

}  // namespace gpusnap::store
