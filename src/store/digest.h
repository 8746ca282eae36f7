// Content addresses: the sha256 digests that name every chunk of the store and every blob of an
// OCI registry, written as OCI writes them ("sha256:" and 64 lower-case hex digits).
#pragma once

#include <openssl/evp.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace gpusnap::store {

inline constexpr std::string_view kSha256Prefix = "sha256:";

// Incremental sha256 (OpenSSL's EVP, which uses the CPU's SHA extensions where present). Not
// thread-safe; one per thread.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  // "sha256:HEX" of everything added; the object is then reset.
  std::string finish();

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

std::string sha256_digest(std::string_view data);

// Whether `digest` is "sha256:" followed by exactly 64 lower-case hex digits. Every digest read
// from outside (a registry, a layout) is checked with this before it names a file.
bool valid_digest(std::string_view digest);

// The 64 hex digits of a valid digest. Throws Error(kBadArtifact) for an invalid one.
std::string digest_hex(std::string_view digest);

}  // namespace gpusnap::store
