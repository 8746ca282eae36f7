// The commands that move snapshots between nodes through an OCI registry (push, pull, import)
// and the oci:// references restore, inspect and verify accept. Kept apart from main.cc, which
// only dispatches to them.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/args.h"
#include "gpusnap/phases.h"

namespace gpusnap::cli {

using args::Args;
using args::FlagSpec;

struct StoreCommand {
  std::string name;
  std::string usage;
  std::string summary;
  std::vector<FlagSpec> flags;
  std::function<int(const Args&)> run;
};

// push, pull and import, for main's table.
std::vector<StoreCommand> store_commands();
// Gives restore, inspect, verify and list what they need for oci:// references and the node
// cache (flags before --help, a line of help); other commands are left as they are.
void extend_for_store(const std::string& name, std::string& usage, std::string& summary,
                      std::vector<FlagSpec>& flags);

// True when ARTIFACT is an oci:// reference.
bool is_remote(const std::string& artifact);
// restore: pulls the snapshot (host and GPU checks first, before any chunk) into the node cache
// and materialises it under RUN_DIR/pulled/DIGEST, reused when already there. Returns that
// directory.
std::filesystem::path pull_for_restore(const Args& args, const std::string& reference,
                                       Reporter& reporter);
// inspect of an oci:// reference: reads the OCI manifest and config only.
int inspect_remote(const Args& args, const std::string& reference);
// verify of an oci:// reference: fetches every chunk (each checked against its digest), writes
// the artifact into a temporary directory, checks it against its manifest, removes it.
int verify_remote(const Args& args, const std::string& reference);
// list --cache DIR: the snapshots held in the node cache.
int list_cache(const Args& args);

}  // namespace gpusnap::cli
