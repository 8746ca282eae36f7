#include "store/digest.h"

#include "gpusnap/error.h"

namespace gpusnap::store {

Sha256::Sha256() : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) {
  if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) {
    throw Error(ErrorKind::kInternal, "cannot initialise sha256 (OpenSSL)");
  }
}

void Sha256::update(const void* data, size_t size) {
  if (size > 0) EVP_DigestUpdate(ctx_.get(), data, size);
}

std::string Sha256::finish() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx_.get(), md, &len);
  EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kSha256Prefix);
  for (unsigned i = 0; i < len; ++i) {
    out += kHex[md[i] >> 4];
    out += kHex[md[i] & 15];
  }
  return out;
}

std::string sha256_digest(std::string_view data) {
  Sha256 h;
  h.update(data.data(), data.size());
  return h.finish();
}

bool valid_digest(std::string_view digest) {
  if (digest.size() != kSha256Prefix.size() + 64 || !digest.starts_with(kSha256Prefix)) {
    return false;
  }
  for (char c : digest.substr(kSha256Prefix.size())) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string digest_hex(std::string_view digest) {
  if (!valid_digest(digest)) {
    throw Error(ErrorKind::kBadArtifact,
                "not a sha256 digest: '" + std::string(digest.substr(0, 80)) + "'");
  }
  return std::string(digest.substr(kSha256Prefix.size()));
}

}  // namespace gpusnap::store
