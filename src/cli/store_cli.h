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
#include "gpusnap/restore.h"
#include "store/blob_store.h"
#include "store/reach.h"

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
// restore's ARTIFACT, a local directory or an oci:// reference, reached as store/reach.h
// reaches it for `restore` (RESTORE's artifact, CRIU, GPU map, copies and run directory): the
// host checked once, an oci:// snapshot reused from RUN_DIR/pulled/DIGEST or pulled there while
// the restore runs, its progress shown as pull's.
struct RestoreSource {
  std::unique_ptr<Reporter> progress;             // the pull's (declared first: outlives it)
  std::unique_ptr<store::SnapshotSource> source;  // prepare() the restore's options with it
  // The notes the pull kept for a --json document (a wait for another pull of the snapshot, a
  // damaged copy set aside); shown on stderr as they came otherwise.
  std::vector<std::string> notes() const;
};
RestoreSource reach_for_restore(const Args& args, const RestoreOptions& restore);
// inspect of an oci:// reference: reads the OCI manifest and config only.
int inspect_remote(const Args& args, const std::string& reference);
// verify of an oci:// reference: fetches every chunk (each checked against its digest), writes
// the artifact into a temporary directory, checks it against its manifest, removes it.
int verify_remote(const Args& args, const std::string& reference);
// list --cache DIR: the snapshots held in the node cache.
int list_cache(const Args& args);

}  // namespace gpusnap::cli
