// What the store's signing (store/signature.h) and encryption (store/encryption.h) both read
// through OpenSSL: PEM keys, and OpenSSL's own error text for their messages.
#pragma once

#include <openssl/evp.h>

#include <memory>
#include <string>
#include <string_view>

namespace gpusnap::store {

// OpenSSL's last error, for a message (the queue is cleared).
std::string openssl_error();

// An unencrypted PEM private key (`is_private`) or public key; null when `pem` is none (or an
// encrypted key: OpenSSL is never let ask for a passphrase). The caller names what it wanted.
std::shared_ptr<EVP_PKEY> parse_pem_key(std::string_view pem, bool is_private);

}  // namespace gpusnap::store
