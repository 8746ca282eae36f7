#include "store/pem_key.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>

namespace gpusnap::store {

namespace {

// Never asks for a passphrase (OpenSSL would prompt on a terminal): an encrypted key is refused.
int no_passphrase(char*, int, int, void*) { return -1; }

}  // namespace

std::string openssl_error() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "unknown OpenSSL error";
  char text[256];
  ERR_error_string_n(e, text, sizeof text);
  return text;
}

std::shared_ptr<EVP_PKEY> parse_pem_key(std::string_view pem, bool is_private) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), BIO_free);
  EVP_PKEY* key = is_private ? PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr)
                             : PEM_read_bio_PUBKEY(bio.get(), nullptr, no_passphrase, nullptr);
  if (key == nullptr) return nullptr;
  return {key, EVP_PKEY_free};
}

}  // namespace gpusnap::store
