// The command-line flags that reach a registry and keep a node cache, defined once for the two
// programs that take them. gpusnap's push, pull and oci:// references spell them bare
// (`--ca-file`); gpusnap-agent spells the registry's after `--registry-` (`--registry-ca-file`),
// because there they stand among flags that configure the agent itself. Both read them into
// the same RegistryOptions, so a flag means the same in either.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/args.h"
#include "store/encryption.h"
#include "store/registry.h"
#include "store/signature.h"

namespace gpusnap::store {

struct TransferOptions;  // store/transfer.h

// PREFIXplain-http, PREFIXca-file, PREFIXauth-file ("--" or "--registry-").
std::vector<args::FlagSpec> registry_flags(const std::string& prefix);
// What those flags say, into `options` (retries, backoff and rate are left as they are).
void read_registry_flags(const args::Args& args, const std::string& prefix,
                         RegistryOptions& options);

// --cache and --cache-budget-mib.
std::vector<args::FlagSpec> cache_flags();
// --cache's folder, or kDefaultCache.
std::string cache_flag(const args::Args& args);
// --cache-budget-mib in bytes (default 64 GiB).
uint64_t cache_budget_flag(const args::Args& args);

// --signature-policy FILE, the same in both programs (docs/security.md).
args::FlagSpec signature_policy_flag();
// The node's signature policy (store/signature.h): --signature-policy's file, else
// /etc/gpusnap/policy.json when it exists, else none (every snapshot accepted).
std::shared_ptr<const SignaturePolicy> signature_policy(const args::Args& args);

// --decryption-key FILE|DIR (repeatable), the same in both programs: the node's private keys
// for encrypted snapshots (store/encryption.h).
args::FlagSpec decryption_key_flag();
// The keys --decryption-key names, read now (Error kKey for a file others may read); null when
// none is given.
std::shared_ptr<const DecryptionKeys> decryption_keys(const args::Args& args);

// --encrypt RECIPIENT (repeatable) and --dedup-secret FILE: what an encrypted push takes.
std::vector<args::FlagSpec> encrypt_flags();
// Their values into `options` (recipients and dedup secret).
void read_encrypt_flags(const args::Args& args, TransferOptions& options);

}  // namespace gpusnap::store
