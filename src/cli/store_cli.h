// The commands that move snapshots between nodes through an OCI registry (push, pull, import)
// and the oci:// references restore, inspect and verify accept. Kept apart from main.cc, which
// only dispatches to them.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/args.h"
#include "gpusnap/phases.h"
#include "store/blob_store.h"
#include "store/stream.h"

namespace gpusnap::cli {

using args::Args;
using args::FlagSpec;

// A subcommand as main's table holds it: its name, usage line, summary, flags and what runs it.
struct Command {
  std::string name;
  std::string usage;
  std::string summary;
  std::vector<FlagSpec> flags;
  std::function<int(const Args&)> run;
};

// push, pull and import, for main's table.
std::vector<Command> store_commands();
// Gives restore, inspect, verify and list what they need for oci:// references and the node
// cache (flags before --help, a line of help); other commands are left as they are.
void extend_for_store(const std::string& name, std::string& usage, std::string& summary,
                      std::vector<FlagSpec>& flags);

// True when ARTIFACT is an oci:// reference.
bool is_remote(const std::string& artifact);
// restore of an oci:// reference: the snapshot under RUN_DIR/pulled/DIGEST. Reused when
// already there; otherwise its manifest is read and checked (host and GPU, before any chunk)
// and its pull starts, for the restore to use as it arrives (gpusnap/restore.h,
// ArrivingArtifact).
struct RemoteRestore {
  // Held for the whole restore: the node cache's eviction leaves the snapshot's copy alone.
  store::SnapshotUse use;
  std::filesystem::path artifact;                  // the final path
  std::unique_ptr<Reporter> progress;              // the pull's (declared first: outlives it)
  std::unique_ptr<store::StreamingPull> arriving;  // null when already here
  // After the restore: a line on what the pull fetched, for the restore's notes.
  std::string summary() const;
};
RemoteRestore open_for_restore(const Args& args, const std::string& reference);
// inspect of an oci:// reference: reads the OCI manifest and config only.
int inspect_remote(const Args& args, const std::string& reference);
// verify of an oci:// reference: fetches every chunk (each checked against its digest), writes
// the artifact into a temporary directory, checks it against its manifest, removes it.
int verify_remote(const Args& args, const std::string& reference);
// list --cache DIR: the snapshots held in the node cache.
int list_cache(const Args& args);

}  // namespace gpusnap::cli
